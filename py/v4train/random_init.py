"""The random base of --model_config, drawn on the device that trains it, each rank only what it
keeps: its expert-parallel rank's routed experts and, of every other tensor, the rows of its FSDP2
shard. No file is written or read, so a base of any size (GLM-5's 744B: 744 GB in FP8) starts on
the devices themselves. `draw` returns what hf_checkpoint.load returns for a checkpoint (the
tensors FSDP2 shards on the meta device, their rows in the report for distributed.fill_shards).

FP8: where the config's quantization_config is FP8 in 128 x 128 blocks and --fp8=keep, the weights
the loader would keep FP8 (plan.is_fp8: a layer's linear maps the checkpoint quantises, packed
experts whose parts fill whole blocks) are float8_e4m3fn beside their fp32 `weight_scale_inv`
[..., ceil(out / 128), ceil(in / 128)], as the loader makes them; the rest in the run's dtype
(float32 where the family keeps it so). Every block's scale is FP8_SCALE, so a weight drawn
normal(0, 0.02) has its 4-sigma value at 448, float8's largest (the rarer values beyond are
clamped); one constant because FSDP2 shards a weight and its scales apart (rank r's weight rows
and the scale rows over them may be on different ranks), and each rank draws its part alone.

The values: element (row, col) of a tensor, viewed as [its dim 0, the rest flattened], is a
function of (--seed, the tensor's name, row, col) alone: a 32-bit integer hash (counter-based, as
Philox is, but computable for any rows), made a uniform and then the init's distribution. So one
seed gives one base whatever the number of processes or expert parallelism (1 and N processes
train the same model; an expert's data-parallel replicas agree), and a rank computes exactly its
rows. The integer part is exact everywhere; the float part (the normal's inverse CDF) may round
differently on the CPU and CUDA.
"""

from __future__ import annotations

import hashlib
import math

import torch

from v4train import plan
from v4train.distributed import fsdp_rows
from v4train.model import CausalLM, all_specs, linear_map_names
from v4train.models import ModelConfig
from v4train.models.config import ConfigError
from v4train.models.weights import A_LOG_RANGE, NORMAL_STD, WeightSpec
from v4train.reference.lora import FP8_BLOCK, FP8_MAX, scale_name

FP8_SCALE = 4 * NORMAL_STD / FP8_MAX
CHUNK = 2**24  # elements drawn at once (their int64 hashes: 128 MiB)
MASK = 2**32 - 1


def fp8_weights(cfg: ModelConfig, hf_config: dict, fp8: str, source: str) -> set[str]:
    """The names of the weights drawn in FP8 (none unless the config is an FP8 checkpoint's and
    fp8 is "keep"); an FP8 quantization_config the ops cannot take is a ConfigError naming `source`."""
    try:
        q = plan.fp8_config(hf_config)
    except plan.PlanError as e:
        raise ConfigError(f"{source}: {e}") from None
    maps = linear_map_names(cfg)
    return {s.name for s in all_specs(cfg) if plan.is_fp8(s, fp8, maps, q)}


def _mix(x: torch.Tensor) -> torch.Tensor:
    """x (int64 below 2**32) hashed to 32 bits in place: xor-shifts and products by odd constants
    below 2**31, so that no product leaves int64 and every device computes the same bits."""
    for shift, factor in ((16, 0x7FEB352D), (15, 0x2C1B3C6D)):
        x ^= x >> shift
        x *= factor
        x &= MASK
    x ^= x >> 16
    return x


def draw_rows(spec: WeightSpec, rows: tuple[int, int], device, seed: int) -> torch.Tensor:
    """Rows rows[0]..rows[1] - 1 of spec's tensor as its init gives them (module docstring), fp32
    on `device`. Everything of a base but the FP8 scales comes through here (the tests count it)."""
    a, b = rows
    shape = (b - a, *spec.shape[1:])
    if spec.init in ("ones", "zeros"):
        return torch.full(shape, float(spec.init == "ones"), device=device)
    digest = hashlib.blake2b(f"{seed}/{spec.name}".encode(), digest_size=8).digest()
    row_key, col_key = int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")
    cols = math.prod(spec.shape[1:])
    col_hash = _mix(torch.arange(cols, device=device) ^ col_key)
    u = torch.empty(b - a, cols, device=device)
    step = max(1, CHUNK // max(cols, 1))
    for r in range(a, b, step):
        h = _mix(_mix(torch.arange(r, min(r + step, b), device=device) ^ row_key)[:, None] ^ col_hash)
        u[r - a:r - a + len(h)] = (h >> 9).float().add_(0.5).mul_(2.0**-23)  # 23 bits: exactly in (0, 1)
    if spec.init == "normal":
        return torch.special.ndtri(u).mul_(NORMAL_STD).view(shape)
    if spec.init == "a_log":
        low, high = A_LOG_RANGE
        return u.mul_(high - low).add_(low).log_().view(shape)
    raise ValueError(f"{spec.name}: unknown init {spec.init!r}")


def _part(spec: WeightSpec, rows: tuple[int, int], dtype: torch.dtype, device, seed: int,
          fp8: bool) -> torch.Tensor:
    """This rank's rows of spec's tensor: float8 values on the FP8_SCALE grid where `fp8`, else in
    `dtype`; drawn CHUNK elements at a time (a packed experts' tensor an expert at a time)."""
    start, stop = rows
    out = torch.empty((stop - start, *spec.shape[1:]), dtype=torch.float8_e4m3fn if fp8 else dtype, device=device)
    step = max(1, CHUNK // max(math.prod(spec.shape[1:]), 1))
    for a in range(start, stop, step):
        t = draw_rows(spec, (a, min(a + step, stop)), device, seed)
        out[a - start:a - start + len(t)] = (t / FP8_SCALE).clamp_(-FP8_MAX, FP8_MAX) if fp8 else t
    return out


def draw(cfg: ModelConfig, hf_config: dict, dtype: torch.dtype, device="cpu", fp8: str = "keep", seed: int = 0,
         experts: tuple[int, int] | None = None, shard: tuple[int, int] | None = None,
         source: str = "config.json") -> tuple[CausalLM, dict]:
    """The random model of `cfg`, in the shape hf_checkpoint.load gives a checkpoint with the same
    `experts` (start, stop: the routed experts this rank keeps, [stop - start, ...] tensors) and
    `shard` (rank, size: of every tensor FSDP2 shards, only this rank's rows are drawn; the model
    holds it on the meta device and the report's 'rows' {name: rows} the part). `fp8`: the
    trainer's --fp8 (module docstring)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    kept = fp8_weights(cfg, hf_config, fp8, source)
    tensors, rows_drawn = {}, {}
    for spec in all_specs(cfg):
        parts = [(spec, False)]
        if spec.name in kept:
            *lead, out, inn = spec.shape
            parts = [(spec, True), (WeightSpec(scale_name(spec.name), (*lead, -(-out // FP8_BLOCK),
                                                                         -(-inn // FP8_BLOCK)), fp32=True), None)]
        own_experts = bool(spec.experts and experts)
        for s, is_fp8 in parts:
            n = s.shape[0]
            sharded = shard is not None and not own_experts
            rows = experts if own_experts else fsdp_rows(n, *shard) if sharded else (0, n)
            if is_fp8 is None:  # the scales: every block FP8_SCALE
                t = torch.full((rows[1] - rows[0], *s.shape[1:]), FP8_SCALE, dtype=torch.float32, device=device)
            else:
                t = _part(s, rows, torch.float32 if s.fp32 else dtype, device, seed, is_fp8)
            if sharded:
                rows_drawn[s.name] = t
                t = torch.empty(s.shape, dtype=t.dtype, device="meta")
            tensors[s.name] = t
    return CausalLM(cfg, tensors, hf_config), ({"rows": rows_drawn} if shard is not None else {})
