"""The memory planner (//py:plan): what one GPU holds to train a model with the C++ layer ops.

Everything is counted in bytes from the config and the flags, tensor by tensor:

- weights by dtype: FP8 linear maps with their fp32 128 x 128 block scales where the config has
  an FP8 quantization_config and --fp8=keep, the rest in --dtype (fp32 where the family keeps it
  so); the routed experts divided over --expert_parallel, every other tensor sharded by FSDP2
  over all --gpus (FSDP2 splits dim 0 of each parameter, padded: ceil(rows / gpus) rows a GPU);
- what trains: LoRA factors (or, --finetune=full, every weight) with their gradients, AdamW's two
  fp32 moments and the fp32 master copy of a weight kept in lower precision (v4train.optim);
- activations: the tensors autograd keeps for the backward pass, op by op as the C++ layer ops
  make them (cc/models/*; Qwen3.5's delta rule on the path the op takes on Setup.device: its fused
  CUDA kernels on the GPU), and at the moments where they peak the transients beside them (the
  MoE combine's backward, the experts' dequantised FP8 weights, the LM head's fp32 logits); with
  --gradient_checkpointing each layer keeps only its input and its first pass's choices, and
  the backward pass holds one layer recomputed, its MLP or MoE a block of tokens at a time;
- communication: the all-to-all of the routed rows (sent and received, counted in the MoE's
  moments where they are alive) and FSDP2's all-gathered parameters (the layer computing and the
  one prefetched, and the unsharded root) and one layer's gradients before their reduce-scatter;
- the headroom left on the GPU, and the longest --seq_len that fits.

Which tensors a layer keeps is written out below, named; the sizes are per token from the
architecture. py/tests/test_plan.py checks the predictions against the peaks measured on one H200
(docs/benchmarks.md) and docs/distributed.md says what is not counted.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import os

from v4train import lora as lora_
from v4train.model import CausalLM, all_specs, linear_map_names
from v4train.models import ModelConfig, family_of
from v4train.reference.cross_entropy_loss import v4_cross_entropy_loss
from v4train.reference.lora import FP8_BLOCK

GIB = 2**30
# What PyTorch can allocate on one H200: the 143,771 MiB nvidia-smi shows (140.4 GiB), less about
# 1.4 GiB for the CUDA context, cuBLAS workspaces and NCCL's own buffers, which its allocator does
# not count (an allowance, not a measurement).
H200_USABLE_GIB = 139.0
# --seq_len steps of the search for the longest that fits.
SEQ_LEN_STEP = 1024
# Constants of the C++ ops the sizes depend on (py/tests/test_plan.py reads them from the sources):
MASKED_MAX_LEN = 8192  # glm5_layer_forward.cc kMaskedMaxLen: longer documents attend through MLA's latent
BLOCK_BYTES = 2**30  # mla_dsa_attention.cc block_bytes: the indexer's scores of a block of queries
GDR_CHUNK = 64  # gated_delta_rule.h kChunk: the delta rule's chunks (each document padded to them)
COMBINE_BLOCK_MIB = 256  # experts.cc kCombineBlockMiB: the MoE combine's fp32 [tokens, k, H] block
TAIL_BLOCK_MIB = 2048  # checkpoint.h kTailBlockMiB: a checkpointed layer's block of MLP / MoE activations
FUSED_MAX_DIM = 128  # gated_delta_rule.h kFusedMaxDim: the widest heads its fused CUDA kernels take
GDR_MAX_CLUSTER = 8  # gated_delta_rule.cu kMaxCluster: the most value heads a key head has on its plane kernels
CONV_MAX_KERNEL = 8  # causal_conv1d.h kMaxKernel: the longest conv its CUDA kernels take
NORM_MAX_WIDTH = 256  # gated_deltanet.h kMaxNormWidth: the widest head its gated-norm CUDA kernels take
COMBINE_MAX_SLOTS = 16  # experts.h kCombineMaxSlots: the most routed slots a token the combine's kernels take
COMBINE_MAX_ROW_BYTES = 32768  # experts.h kCombineMaxRowBytes: the widest row they take
TURN_MIB = 256  # fp8_grouped.cu kTurnBytes: transpose_global's buffer of a group of experts' turned weights
# The LM head's chunk of tokens (the C++ op takes the reference's default).
CE_CHUNK = inspect.signature(v4_cross_entropy_loss).parameters["chunk_tokens"].default
FP32 = 4
INT64 = 8


class PlanError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Term:
    """One tensor (or a group of alike ones): what it is and what keeps it alive; its bytes."""

    what: str
    bytes: int


def total(terms) -> int:
    return sum(t.bytes for t in terms)


@dataclasses.dataclass(frozen=True)
class Moment:
    """A point of a layer's pass where its memory peaks: label, and the layer's tensors alive then
    (the saved ones still held, the transients, the gradients of its weights made so far)."""

    label: str
    terms: tuple[Term, ...]


@dataclasses.dataclass
class LayerMemory:
    """One decoder layer's activation memory on this GPU.

    saved: what autograd keeps from a pass with gradients (a plain pass, or the recomputation of
    a checkpointed one), in the order made. kept: what a checkpointed call keeps from its first
    pass besides its input (the choices its recomputation repeats). forward / first_pass /
    backward: the moments of a pass with gradients, of a checkpointed first pass (no gradients)
    and of the backward pass. grads: the gradients of its weights (--finetune=full)."""

    input: Term
    saved: list[Term]
    kept: list[Term]
    forward: list[Moment]
    first_pass: list[Moment]
    backward: list[Moment]
    grads: int = 0


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the plan is for. tokens = micro_batch_size x seq_len on each GPU (expert-parallel
    ranks read their own data); documents: the lengths of the documents in those tokens (None:
    the worst packing of rows of seq_len tokens)."""

    cfg: ModelConfig
    hf_config: dict
    gpus: int = 1
    expert_parallel: int = 1
    finetune: str = "lora"
    fp8: str = "keep"
    seq_len: int = 4096
    micro_batch_size: int = 1
    lora_r: int = 16
    lora_target_modules: tuple[str, ...] = ("attention",)
    lora_experts: bool = True
    checkpointing: bool = True
    dtype_bytes: int = 2
    gpu_memory_gib: float = H200_USABLE_GIB
    documents: tuple[int, ...] | None = None
    device: str = "cuda"  # the ops' device: on "cuda" the delta rule takes its fused kernels where it can

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_len


# ----------------------------------------------------------------------------------------------
# Weights


def fp8_config(hf_config: dict) -> dict | None:
    """The config's quantization_config when it is the FP8 format the loader keeps (fp8, 128 x 128
    blocks), else None; an FP8 one with other blocks is an error (the ops take 128 x 128 only)."""
    q = hf_config.get("quantization_config") or (hf_config.get("text_config") or {}).get("quantization_config")
    if not q or q.get("quant_method") != "fp8":
        return None
    if list(q.get("weight_block_size") or []) != [FP8_BLOCK, FP8_BLOCK]:
        raise PlanError(f"quantization_config.weight_block_size={q.get('weight_block_size')}: the C++ ops take FP8 "
                        f"weights in {FP8_BLOCK} x {FP8_BLOCK} blocks only")
    return q


def not_converted(name: str, q: dict) -> bool:
    """Whether modules_to_not_convert keeps the weight `name` in high precision: an entry names a
    run of whole parts of its module's dotted name ("mlp.gate" is the router, not mlp.gate_proj;
    "lm_head" and "model.layers.3.mlp.gate" alike)."""
    parts = name.removesuffix(".weight").split(".")
    for entry in q.get("modules_to_not_convert") or []:
        e = entry.split(".")
        if any(parts[j:j + len(e)] == e for j in range(len(parts) - len(e) + 1)):
            return True
    return False


def is_fp8(spec, fp8: str, maps: set[str], q: dict | None) -> bool:
    """Whether the loader (hf_checkpoint.load, with --fp8=`fp8`) keeps this weight FP8: a layer's
    linear map (in `maps`) that the checkpoint quantises (q: fp8_config); a packed experts' tensor
    only where its parts fill whole 128-row scale blocks. The random base of --model_config draws
    the same weights FP8 (v4train.random_init)."""
    if q is None or fp8 != "keep" or spec.name not in maps or not_converted(spec.name, q):
        return False
    if spec.experts:
        return (spec.shape[1] // len(spec.experts)) % FP8_BLOCK == 0
    return True


@dataclasses.dataclass(frozen=True)
class WeightLine:
    name: str
    shape: tuple[int, ...]
    dtype: str  # "float8_e4m3fn", "bfloat16", "float32"
    bytes: int  # on this GPU, the FP8 scales included
    scale_bytes: int
    expert: bool
    trains: bool


def _dtype_name(nbytes: int) -> str:
    return {2: "bfloat16", 4: "float32"}[nbytes]


def _shard_rows(rows: int, world: int) -> int:
    """FSDP2's rows of a dim-0 shard: torch.chunk's largest piece (the others are padded to it)."""
    return -(-rows // world)


def weight_lines(setup: Setup) -> list[WeightLine]:
    """Every weight of the model as one GPU holds it."""
    cfg, family = setup.cfg, family_of(setup.cfg)
    q, maps = fp8_config(setup.hf_config), linear_map_names(setup.cfg)
    out = []
    for spec in all_specs(cfg):
        rows, rest = spec.shape[0], math.prod(spec.shape[1:])
        if spec.experts:  # [E, out, in]: E / expert_parallel experts here
            rows //= setup.expert_parallel
        elif setup.gpus > 1:
            rows = _shard_rows(rows, setup.gpus)
        n = rows * rest
        scale = 0
        if is_fp8(spec, setup.fp8, maps, q):
            dtype, per = "float8_e4m3fn", 1
            # The scales [(E,) ceil(out / 128), ceil(in / 128)] split as their weight does: the
            # experts over expert parallelism, a 2-D one by FSDP2 along its own dim 0.
            *lead, o, i = spec.shape
            block_rows, block_cols = -(-o // FP8_BLOCK), -(-i // FP8_BLOCK)
            if spec.experts:
                blocks = lead[0] // setup.expert_parallel * block_rows * block_cols
            else:
                blocks = _shard_rows(block_rows, setup.gpus) * block_cols
            scale = FP32 * blocks
        else:
            per = FP32 if spec.fp32 else setup.dtype_bytes
            dtype = _dtype_name(per)
        trains = setup.finetune == "full" and not family.is_frozen(spec.name)
        out.append(WeightLine(spec.name, spec.shape, dtype, n * per + scale, scale, bool(spec.experts), trains))
    return out


@dataclasses.dataclass(frozen=True)
class Training:
    """What trains, on this GPU: parameters (LoRA factors, or the weights themselves), their
    gradients, AdamW's moments (fp32) and master weights (fp32, for parameters in lower precision)."""

    parameters: int  # LoRA factors (--finetune=full: the weights, counted with the weights)
    gradients: int
    moments: int
    masters: int
    count: int  # trained values on this GPU


def adapter_shapes(setup: Setup) -> dict[str, tuple[int, ...]]:
    """The LoRA factors by full name, as lora.add_adapters makes them (all experts' factors);
    a target that matches nothing is a ValueError naming --lora_target_modules."""
    return dict(_adapter_shapes(setup.cfg, setup.lora_r, tuple(setup.lora_target_modules), setup.lora_experts))


@functools.lru_cache(maxsize=16)
def _adapter_shapes(cfg, r: int, targets: tuple[str, ...], experts: bool) -> tuple:
    model = CausalLM.empty(cfg, {})  # shapes only (the meta device)
    lcfg = lora_.LoraConfig(r, 2.0 * r, 0.0, lora_.expand_targets(model, targets), experts)
    return tuple((name, shape) for name, (shape, _) in lora_.adapter_shapes(model, lcfg).items())


def training(setup: Setup, weights: list[WeightLine]) -> Training:
    master = 0 if setup.dtype_bytes == FP32 else FP32
    if setup.finetune == "full":
        n = sum(w.bytes // (FP32 if w.dtype == "float32" else setup.dtype_bytes) for w in weights if w.trains)
        fp32 = sum(w.bytes // FP32 for w in weights if w.trains and w.dtype == "float32")
        return Training(0, sum(w.bytes for w in weights if w.trains), 2 * FP32 * n, master * (n - fp32), n)
    n = 0
    for name, shape in adapter_shapes(setup).items():
        rows = shape[0]
        if len(shape) == 3:  # an experts' factor [E, ...]: this rank's experts
            rows //= setup.expert_parallel
        elif setup.gpus > 1:
            rows = _shard_rows(rows, setup.gpus)
        n += rows * math.prod(shape[1:])
    return Training(n * setup.dtype_bytes, n * setup.dtype_bytes, 2 * FP32 * n, master * n, n)


# ----------------------------------------------------------------------------------------------
# Activations: what each layer op keeps


@dataclasses.dataclass(frozen=True)
class Ctx:
    """What the layer models need: the setup, the tokens here, their documents, which linear maps
    keep their input for the backward pass (a trained weight's gradient or a LoRA factor's), the
    bytes of activations (b) and of the ops' float32 math (f)."""

    setup: Setup
    tokens: int
    documents: tuple[int, ...]
    adapted: frozenset[str]  # "{layer}:{name}" of the weights with an adapter ("3:self_attn.o_proj.weight")
    fp8: frozenset[str]  # "{layer}:{name}" of the weights kept in FP8
    b: int
    f: int

    @property
    def cfg(self):
        return self.setup.cfg

    def keeps_input(self, layer: int, name: str) -> bool:
        """A linear map's input is saved when its weight trains or it has an adapter."""
        return self.trains(name) or self.is_adapted(layer, name)

    def is_adapted(self, layer: int, name: str) -> bool:
        return f"{layer}:{name}" in self.adapted

    def trains(self, name: str) -> bool:
        return self.setup.finetune == "full" and not family_of(self.cfg).is_frozen(name)

    def is_fp8(self, layer: int, name: str) -> bool:
        return f"{layer}:{name}" in self.fp8

    @property
    def r(self) -> int:
        return self.setup.lora_r


def key(t: Term) -> str:
    """A term's name, the part before its ':' (the same name is the same tensor)."""
    return t.what.split(":", 1)[0]


class Saved(list):
    """A layer's saved tensors in the order its op makes them, and marks between them (the
    points of the pass that moments refer to)."""

    def __init__(self):
        super().__init__()
        self.marks: dict[str, int] = {}

    def add(self, name: str, what: str, nbytes: int, when: bool = True) -> None:
        if when and nbytes:
            self.append(Term(f"{name}: {what}", int(nbytes)))

    def mark(self, name: str) -> None:
        self.marks[name] = len(self)

    def before(self, mark: str) -> list[Term]:
        return list(self[:self.marks[mark]])

    def since(self, mark: str) -> list[Term]:
        return list(self[self.marks[mark]:])

    def but(self, terms: list[Term], *names: str) -> list[Term]:
        return [t for t in terms if key(t) not in names]


def lora_terms(saved: Saved, c: Ctx, i: int, name: str, weight: str, rows: int) -> None:
    """An adapted map keeps x A [rows, r] for its B factor's gradient (its input x is counted
    where it is made)."""
    saved.add(name + ".lora", "x A of its adapter [rows, r]", rows * c.r * c.b, c.is_adapted(i, weight))


def mlp_terms(c: Ctx, i: int, s: Saved, prefix: str, I: int, T: int) -> None:
    """v4_mlp (cc/ops/mlp.cc) on [T, H] (T: the tail's tokens, tail_tokens): silu keeps gate, the
    product silu(gate) and up, down its input where its weight trains or is adapted."""
    b = c.b
    for m in ("gate_proj", "up_proj"):
        lora_terms(s, c, i, prefix + m, prefix + m + ".weight", T)
    s.add(prefix + "gate_up", "gate and up [T, I] each (SwiGLU's inputs)", 2 * T * I * b)
    s.add(prefix + "silu", "silu(gate) [T, I]", T * I * b)
    s.add(prefix + "act", "silu(gate) * up [T, I] (down's input)", T * I * b,
          c.keeps_input(i, prefix + "down_proj.weight"))
    lora_terms(s, c, i, prefix + "down_proj", prefix + "down_proj.weight", T)


def moe_terms(c: Ctx, i: int, s: Saved, E: int, k: int, H: int, I: int, T: int,
              first_pass_locals: list[Term]) -> tuple[list[Moment], list[Moment], list[Moment], int]:
    """The routed experts of either family (cc/common/experts.cc) on the T k routed rows of the
    tail's T tokens (tail_tokens), grouped by expert; with expert parallelism the rows of this
    rank's E / expert_parallel experts, T k on average (balanced routing assumed). Adds their saved
    tensors to `s`; returns the moments of the forward pass, of a checkpointed first pass and of
    the backward, and the experts' weight gradients (--finetune=full)."""
    b = c.b
    rows = T * k
    local = E // c.setup.expert_parallel
    gu, dn = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
    s.add("dispatch", "the routed rows' order and inverse (int64; the gathers' backward)", 2 * rows * INT64)
    s.mark("rows")
    s.add("rows", "the routed rows [T k, H] (gate_up's input)", rows * H * b, c.keeps_input(i, gu))
    lora_terms(s, c, i, "rows", gu, rows)
    s.add("gate_up", "gate_up's output [T k, 2I] (SwiGLU's inputs)", rows * 2 * I * b)
    if not fused_swiglu(c.setup, I):
        s.add("silu", "silu(gate) [T k, I]", rows * I * b)
    s.add("act", "silu(gate) * up [T k, I] (down's input)", rows * I * b, c.keeps_input(i, dn))
    lora_terms(s, c, i, "act", dn, rows)
    s.mark("combined")
    s.add("combined", "the experts' outputs in routed order [T k, H] and each row's token (the combine's backward)",
          rows * (H * b + INT64))
    # FP8 off the experts' kernel: this rank's experts dequantised at once for the product, in the
    # forward pass and again in the backward (Fp8Product keeps the FP8 weight, not the copy).
    deq = not fused_fp8_experts(c.setup)
    deq_gu = Term("gate_up's FP8 weights dequantised [E / ep, 2I, H]", local * 2 * I * H * b if deq and c.is_fp8(i, gu)
                  else 0)
    deq_dn = Term("down's FP8 weights dequantised [E / ep, H, I]", local * H * I * b if deq and c.is_fp8(i, dn) else 0)
    # On FP8 tensor cores each product's input (forward) or output gradient (backward) is quantised
    # for the product: a byte a value and a scale per 128 (fp8.cuh quantize_rows), freed after it.
    tc = fp8_tensor_cores() if fused_fp8_experts(c.setup) else frozenset()
    e4m3, e4m3_forward = "experts" in tc, bool({"experts", "experts_forward"} & tc)
    q_gu = Term("gate_up's input quantised to e4m3 with its scales [T k, H]",
                quantised_rows_bytes(rows, H) if e4m3_forward and c.is_fp8(i, gu) else 0)
    turn = e4m3 and "transpose_global" in e4m3_variants()  # (the backward's weights turned, a group at a time)
    g_gu = local * 2 * I * H * b if c.trains(gu) else 0
    g_dn = local * H * I * b if c.trains(dn) else 0
    gathered = Term("the routed rows [T k, H]", rows * H * b)
    gu_out = Term("gate_up's output [T k, 2I]", rows * 2 * I * b)
    # Expert parallelism (routed_experts): the rows sent and the rows arrived stay alive (locals)
    # while this rank's experts compute on the arrived ones grouped by expert; their outputs go
    # back grouped by source and arrive as another [T k, H].
    ep = c.setup.expert_parallel > 1
    exchange = [Term("all-to-all: the rows sent and the rows arrived [T k, H] each", 2 * rows * H * b if ep else 0)]
    back = [Term("all-to-all: the experts' outputs, regrouped by source, and arrived back [T k, H] each",
                 3 * rows * H * b)]
    # The combine (experts.cc Combine) on ATen weighs and sums a block of tokens at a time, B k H
    # elements (B: its fp32 [B, k, H] within COMBINE_BLOCK_MIB); its backward, block by block,
    # gathers the rows, in fp32, times the incoming gradient (fp32), then writes y's gradient over
    # y's rows. Its CUDA kernels read the rows in place (no block).
    block = (0 if fused_combine(c.setup, H, k)
             else min(T, max(1, (COMBINE_BLOCK_MIB << 20) // (FP32 * k * H))) * k * H)
    weigh = [Term("combine: the output [T, H]; a block's rows gathered and weighed [B, k, H]", T * H * b + 2 * block * b)]
    combine = [Term("combine backward: a block's rows gathered, in fp32, times the incoming gradient (fp32)",
                    block * (b + (FP32 if b < FP32 else 0) + FP32))]
    forward = [
        Moment("MoE dispatch", tuple(s.before("rows") + [Term("dispatch: x expanded to [T k, H]", rows * H * b),
                                                          gathered])),
        Moment("experts' gate_up product", tuple(s.before("rows") + exchange + [gathered, deq_gu, q_gu, gu_out])),
        Moment("MoE combine", tuple(s + weigh)),
    ]
    first_pass = [
        Moment("experts' gate_up product", tuple(first_pass_locals + exchange + [gathered, deq_gu, q_gu, gu_out])),
        Moment("MoE combine", tuple(first_pass_locals + [Term("the experts' outputs [T, k, H]", rows * H * b)] +
                                    weigh)),
    ]
    backward = []
    if ep:
        unsaved = [] if c.keeps_input(i, gu) else [gathered]
        forward.append(Moment("all-to-all of the experts' outputs", tuple(s.before("combined") + exchange + unsaved +
                                                                           back)))
        first_pass.append(Moment("all-to-all of the experts' outputs", tuple(first_pass_locals + exchange + back)))
        backward.append(Moment("all-to-all of the outputs' gradients", tuple(s.but(s, "combined") + [
            Term("all-to-all backward: the outputs' gradients sent and arrived [T k, H] each", 2 * rows * H * b)])))
    backward += [
        Moment("MoE combine backward", tuple(s + combine)),
        Moment("experts' down backward", tuple(s.but(s, "combined") + [
            Term("down backward: its output's gradient [T k, H]", rows * H * b), deq_dn,
            Term("down backward: that gradient quantised to e4m3 with its scales [T k, H]",
                 quantised_rows_bytes(rows, H) if e4m3 and c.is_fp8(i, dn) else 0),
            Term("down backward: a group of its FP8 weights turned [G, I, H], all its scales turned",
                 turned_weight_bytes(local, H, I) if turn and c.is_fp8(i, dn) else 0),
            Term("down backward: its input's gradient [T k, I]", rows * I * b),
            Term("down_proj's weight gradient", g_dn)])),
        Moment("experts' gate_up backward", tuple(s.but(s, "combined", "act", "act.lora", "silu", "gate_up") + [
            Term("gate_up backward: its output's gradient [T k, 2I]", rows * 2 * I * b), deq_gu,
            Term("gate_up backward: that gradient quantised to e4m3 with its scales [T k, 2I]",
                 quantised_rows_bytes(rows, 2 * I) if e4m3 and c.is_fp8(i, gu) else 0),
            Term("gate_up backward: a group of its FP8 weights turned [G, H, 2I], all its scales turned",
                 turned_weight_bytes(local, 2 * I, H) if turn and c.is_fp8(i, gu) else 0),
            Term("gate_up backward: its input's gradient [T k, H]", rows * H * b),
            Term("the experts' weight gradients", g_dn + g_gu)])),
    ]
    return forward, first_pass, backward, g_gu + g_dn


def layer_grads(c: Ctx, i: int, exclude: tuple[str, ...] = (), within: str = "") -> int:
    """--finetune=full: the gradients of layer i's trained weights named `within`... on this GPU,
    as sharded (the names in `exclude` are counted where they are made)."""
    out = 0
    for spec in family_of(c.cfg).layer_specs(c.cfg, i):
        if c.trains(spec.name) and spec.name not in exclude and spec.name.startswith(within):
            rows = (spec.shape[0] // c.setup.expert_parallel if spec.experts else
                    _shard_rows(spec.shape[0], c.setup.gpus))
            out += rows * math.prod(spec.shape[1:]) * (FP32 if spec.fp32 else c.b)
    return out


def tail_tokens(c: Ctx, i: int) -> int:
    """The tokens that layer i's tail (its MLP or MoE, after post_attention_layernorm) takes at
    once: all T in a plain call. A checkpointed call (cc/common/checkpoint.cc tail_block) runs,
    recomputes and differentiates it a block at a time, as many tokens as TAIL_BLOCK_MIB of its
    largest activations hold (swiglu_tail_bytes: 2 H + 4 I values for each of an MoE's top-k
    routed rows, or an MLP's one row, a token); under expert parallelism one block, so that every
    rank's all-to-alls pair up."""
    cfg, T = c.cfg, c.tokens
    if not c.setup.checkpointing or c.setup.expert_parallel > 1:
        return T
    moe = cfg.mlp_layer_types[i] == "sparse" if cfg.family == "glm5" else cfg.is_moe
    rows, I = (cfg.num_experts_per_tok, cfg.moe_intermediate_size) if moe else (1, cfg.intermediate_size)
    return min(T, max(1, (TAIL_BLOCK_MIB << 20) // (rows * (2 * cfg.hidden_size + 4 * I) * c.b)))


def beside(moments: list[Moment], terms: list[Term]) -> list[Moment]:
    return [Moment(m.label, m.terms + tuple(terms)) for m in moments]


def checkpoint_terms(c: Ctx, tail_T: int, tail_grads: int) -> tuple[list[Term], list[Term]]:
    """What a checkpointed call's backward (checkpoint.cc) holds besides the saved tensors. Beside
    the moments of its tail's recomputation and backward (a block of tail_T tokens at a time): h's
    gradient dh [T, H], filled block by block, and from the second block on the tail's weight
    gradients of the blocks before, summed (--finetune=full; LoRA's are small; counted beside a
    whole block, though a second one may be shorter). Beside those of its head's backward, which
    comes last: dh and the head's outputs mid and h (the call's locals). A plain call: none."""
    if not c.setup.checkpointing:
        return [], []
    TH = c.tokens * c.cfg.hidden_size * c.b
    dh = Term("dh: h's gradient, filled a block of the tail at a time [T, H]", TH)
    summed = Term("the tail's weight gradients of the blocks before, summed", tail_grads if tail_T < c.tokens else 0)
    outputs = Term("the head's outputs mid and h [T, H], held to the end of the call's backward", 2 * TH)
    return [dh, summed], [outputs, dh]


def glm5_layer(c: Ctx, i: int) -> LayerMemory:
    """v4_glm5_layer_forward (cc/models/glm5): RMSNorm, MLA with the DSA indexer
    (mla_dsa_attention.cc), RMSNorm, the dense MLP or the MoE (glm5_moe.cc)."""
    cfg, T, b = c.cfg, c.tokens, c.b
    H, nh, K = cfg.hidden_size, cfg.num_attention_heads, cfg.index_topk
    nope, rope, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    C, qr = cfg.kv_lora_rank, cfg.q_lora_rank
    docs = c.documents
    # Documents up to MASKED_MAX_LEN attend densely (per-head keys and values for every token, a
    # [queries, keys] mask past index_topk); longer ones through the latent (per-head keys only
    # for their first index_topk tokens, which attend causally).
    dense_rows = sum(L if L <= MASKED_MAX_LEN else min(L, K) for L in docs)
    latent_queries = sum(L - K for L in docs if L > MASKED_MAX_LEN)
    long_docs = [L for L in docs if L > MASKED_MAX_LEN]
    mask = sum((L - K) * L for L in docs if K < L <= MASKED_MAX_LEN)
    full_indexer = cfg.indexer_types[i] == "full"
    a = "self_attn."
    s = Saved()
    s.add("norms", "the four RMSNorms' 1 / rms [T, 1] (fp32)", 4 * T * FP32)
    s.add("normed", "input_layernorm's output [T, H] (q_a_proj's and kv_a_proj's input)", T * H * b,
          c.keeps_input(i, a + "q_a_proj.weight") or c.keeps_input(i, a + "kv_a_proj_with_mqa.weight"))
    lora_terms(s, c, i, "q_a", a + "q_a_proj.weight", T)
    s.add("q_a", "q_a_proj's output [T, q_lora_rank] (q_a_layernorm's input)", T * qr * b)
    s.add("q_resid", "q_a_layernorm's output [T, q_lora_rank] (q_b_proj's input)", T * qr * b,
          c.keeps_input(i, a + "q_b_proj.weight"))
    lora_terms(s, c, i, "q_b", a + "q_b_proj.weight", T)
    lora_terms(s, c, i, "kv_a", a + "kv_a_proj_with_mqa.weight", T)
    s.add("kv_a", "kv_a_proj_with_mqa's output [T, kv_lora_rank + rope] (kv_a_layernorm's input)", T * (C + rope) * b)
    s.add("latent", "kv_a_layernorm's output [T, kv_lora_rank] (kv_b_proj's input)", T * C * b,
          c.keeps_input(i, a + "kv_b_proj.weight") or bool(long_docs))
    s.add("rope", "RoPE's cos and sin [T, rope] (its backward)", 2 * T * rope * b)
    s.add("q", "the RoPE'd queries [T, heads, nope + rope] (attention's backward)", T * nh * (nope + rope) * b)
    lora_terms(s, c, i, "kv_b", a + "kv_b_proj.weight", dense_rows)
    s.add("kv", "kv_b_proj's output [rows, heads, nope + v], the values (attention's backward)",
          dense_rows * nh * (nope + dv) * b)
    s.add("k", "the per-head keys [rows, heads, nope + rope] (attention's backward)",
          dense_rows * nh * (nope + rope) * b)
    s.add("selection", "the DSA selection [T, index_topk] (int64; the 'shared' layers' carry)", T * K * INT64,
          full_indexer)
    s.mark("attend")
    s.add("sdpa", "dense attention's output [rows, heads, v] and log-sum-exp (its backward)",
          dense_rows * nh * (dv * b + FP32))
    s.add("mask", "each document's [queries, keys] mask as sdpa's additive bias (its backward)", mask * b)
    # The latent path (SparseLatentAttention): the queries in the latent space, [latent | k_rope]
    # per key, the output and its log-sum-exp (a checkpointed call's stash), and kv_b's per-head
    # maps (dense, any adapter folded in) for the two batched products.
    s.add("latent_q", "the latent queries [queries, heads, kv_lora_rank + rope] (sparse attention's backward)",
          latent_queries * nh * (C + rope) * b)
    s.add("latent_kv", "[latent | k_rope] of each key [tokens, kv_lora_rank + rope]", sum(long_docs) * (C + rope) * b)
    stash = latent_queries * nh * (C * b + FP32)
    s.add("stash", "sparse attention's output [queries, heads, kv_lora_rank] and log-sum-exp", stash)
    s.add("kv_b_maps", "kv_b_proj's per-head maps, dense (once per long document)",
          len(long_docs) * nh * (nope + dv) * C * b)
    s.add("attn", "attention's output [T, heads, v] (o_proj's input)", T * nh * dv * b,
          c.keeps_input(i, a + "o_proj.weight"))
    lora_terms(s, c, i, "o", a + "o_proj.weight", T)
    s.mark("mid")
    s.add("mid", "the residual after attention [T, H] (post_attention_layernorm's input)", T * H * b)
    s.mark("mlp")
    kept = [Term("selection: the DSA selection [T, index_topk] (int64)", T * K * INT64 if full_indexer else 0),
            Term("stash: sparse attention's output and log-sum-exp (the recomputation takes them)", stash)]
    # The DSA indexer (no gradient, in every pass that is not a recomputation): its queries (and
    # their RoPE'd copy), a block of queries' fp32 scores against all keys, their top-k and sort.
    blocks = [min(L - K, max(1, BLOCK_BYTES // (L * FP32))) for L in docs if L > K]
    indexer = [Term("indexer: queries [T, index heads, index dim] and their RoPE'd copy",
                    2 * T * cfg.index_n_heads * cfg.index_head_dim * b),
               Term("indexer: a block of queries' fp32 scores [queries, keys]",
                    max((n * L * FP32 for n, L in zip(blocks, [L for L in docs if L > K])), default=0)),
               Term("indexer: the block's top-k values, indices and their sort",
                    max(blocks, default=0) * K * (FP32 + 3 * INT64))]
    attention_locals = [Term("attention's locals: input norm, q_resid, kv_a, latent, cos / sin, queries",
                             T * (H + qr + 2 * C + 3 * rope + nh * (nope + rope)) * b),
                        Term("attention's locals: per-head keys and values",
                             dense_rows * nh * (2 * nope + rope + dv) * b)]
    forward = [Moment("DSA indexer", tuple(s.before("attend") + indexer))] if full_indexer else []
    first_pass = [Moment("DSA indexer", tuple(attention_locals + [kept[0]] + indexer))] if full_indexer else []
    # The tail (MLP or MoE) on Tt tokens at once: a block of them in a checkpointed call. Beside
    # a checkpointed first pass's blocks: the head's outputs mid and h, the output being summed
    # (mid's clone), the stash and selection. Its backward holds h (the head's output) throughout.
    Tt, ckpt = tail_tokens(c, i), c.setup.checkpointing
    layer_locals = [Term("the layer's locals: mid, h and the output summed block by block [T, H]",
                         3 * T * H * b)] + kept
    if cfg.mlp_layer_types[i] == "sparse":
        E, k, I = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        sh = "mlp.shared_experts."
        s.add("h", "post_attention_layernorm's output [T, H] (the shared expert's input)", T * H * b,
              ckpt or c.keeps_input(i, sh + "gate_proj.weight") or c.keeps_input(i, sh + "up_proj.weight"))
        s.add("router_x", "the router's input in fp32 [T, H] (the router weight's gradient)", Tt * H * FP32,
              c.trains("mlp.gate.weight"))
        s.add("router", "the router's fp32 weight copy [E, H], sigmoid scores [T, E], routing weights [T, k] (fp32)",
              E * H * FP32 + Tt * E * FP32 + 2 * Tt * k * FP32)
        mlp_terms(c, i, s, sh, I * cfg.n_shared_experts, Tt)
        kept.append(Term("routing: the MoE routing [T, k] (int64)", T * k * INT64))
        moe_locals = layer_locals + [Term("the MoE's locals: the shared expert's output [T, H], scores [T, E]",
                                          Tt * (H * b + E * FP32))]
        fwd_moe, first_moe, back_moe, g_experts = moe_terms(c, i, s, E, k, H, I, Tt, moe_locals)
        grads = layer_grads(c, i, exclude=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
    else:
        s.add("h", "post_attention_layernorm's output [T, H] (the MLP's input)", T * H * b,
              ckpt or c.keeps_input(i, "mlp.gate_proj.weight") or c.keeps_input(i, "mlp.up_proj.weight"))
        mlp_terms(c, i, s, "mlp.", cfg.intermediate_size, Tt)
        fwd_moe, first_moe, back_moe, g_experts = [], [], [], 0
        grads = layer_grads(c, i)
    # The attention's backward (the MLP's tensors freed): o_proj's input gradient; dense
    # attention's dq, dk, dv; the sparse kernel's dq and the latents' fp32 gradient.
    attn_back = [Term("attention backward: o_proj's input gradient [T, heads, v]", T * nh * dv * b),
                 Term("attention backward: dense attention's dq, dk, dv", dense_rows * nh * 3 * (nope + rope) * b),
                 Term("attention backward: sparse dq and the latents' fp32 gradient",
                      latent_queries * nh * (C + rope) * b + sum(long_docs) * (C + rope) * FP32),
                 # (latent_attention's last product gives it transposed, [heads, queries, C], which
                 # the CUDA kernel reads in place)
                 Term("attention backward: the latent output's gradient [queries, heads, kv_lora_rank]",
                      latent_queries * nh * C * b),
                 Term("the MLP's / experts' weight gradients", g_experts)]
    attention = Moment("attention backward", tuple(s.before("mid") + attn_back))
    by_tail, by_head = checkpoint_terms(c, Tt, layer_grads(c, i, within="mlp."))
    return LayerMemory(Term("input: the layer's input [T, H]", T * H * b), s, kept, forward + beside(fwd_moe, by_tail),
                       first_pass + first_moe, beside(back_moe, by_tail) + beside([attention], by_head),
                       grads + g_experts)


def device_kernels(setup: Setup) -> bool:
    """Whether the ops' CUDA kernels can run at all: the CUDA device, bf16 or fp32 (each op's own
    bounds below)."""
    return setup.device == "cuda" and setup.dtype_bytes in (2, FP32)


def fused_delta_rule(setup: Setup) -> bool:
    """Whether v4_gated_delta_rule runs its fused CUDA kernels, as gated_delta_rule.cc picks them:
    CUDA tensors q, k, v of one dtype that is not float64 (the block's are), Dk and Dv at most
    kFusedMaxDim. Otherwise (the CPU, float64, wider heads) the ATen path."""
    cfg = setup.cfg
    return device_kernels(setup) and max(cfg.linear_key_head_dim, cfg.linear_value_head_dim) <= FUSED_MAX_DIM


def fused_conv(setup: Setup) -> bool:
    """Whether v4_causal_conv1d runs its CUDA kernels (causal_conv1d.cc picks them): CUDA, bf16 or
    fp32, at most CONV_MAX_KERNEL taps. Otherwise the ATen path."""
    return device_kernels(setup) and setup.cfg.linear_conv_kernel_dim <= CONV_MAX_KERNEL


def fused_dqkwg(setup: Setup) -> bool:
    """Whether the fused delta rule's backward takes its state and intra gradients as one kernel on
    planes (gated_delta_rule.cu dqkwg_planes_kernel, whose dq_state, dk_tilde and dgamma stay in
    shared memory): wherever the plane kernels run (bf16 at widths 128). A switch of its own so that
    the peaks measured before it (three kernels, those three tensors in memory) are predicted as
    that code ran."""
    return True


def fused_key_sums(setup: Setup) -> bool:
    """Whether the plane kernels write q's and k's gradients summed over each key head's value heads
    (gated_delta_rule.cu sum_over_value_heads, in clusters of a key head's value heads: bf16 [T, key
    heads, dk]), where the kernels before wrote each value head's share in fp32 and a kernel after
    them summed. A switch of its own so that the peaks measured before it are predicted as that
    code ran."""
    return True


def fused_bf16_dv_local(setup: Setup) -> bool:
    """Whether the plane kernels keep dv_local, v_new's gradient from each chunk's own outputs (local_grads'
    output, the reverse recurrence's base), in bf16, where the kernels before kept it in fp32. A switch
    of its own so that the peaks measured before it are predicted as that code ran."""
    return True


def fused_norm(setup: Setup) -> bool:
    """Whether the Gated DeltaNet block's gated RMSNorm runs its CUDA kernels (gated_deltanet.cc's
    gated_norm picks them): CUDA, bf16 or fp32, heads at most NORM_MAX_WIDTH wide."""
    return device_kernels(setup) and setup.cfg.linear_value_head_dim <= NORM_MAX_WIDTH


def fused_loss(setup: Setup) -> bool:
    """Whether v4_cross_entropy_loss forms a chunk's loss and gradient by its CUDA kernel
    (cross_entropy_loss.cc picks it): CUDA, bf16 or fp32; the gradient is written over the logits.
    Otherwise ATen's float32 chain (the logits cast, log_softmax'ed, then the gradient)."""
    return device_kernels(setup)


def fused_swiglu(setup: Setup, inter: int) -> bool:
    """Whether the experts' SwiGLU runs its CUDA kernels (experts.cc swiglu): CUDA, bf16 or fp32,
    the intermediate width a multiple of 8. They keep gate_up alone; ATen also kept silu(gate)."""
    return device_kernels(setup) and inter % 8 == 0


def fused_fp8_experts(setup: Setup) -> bool:
    """Whether the routed experts' products on FP8 weights run their CUDA kernel (fp8_grouped.cu,
    both ways): CUDA (a Hopper GPU), bf16 activations; the packed experts are FP8 only in whole
    128 x 128 scale blocks (is_fp8). It dequantises a tile at a time in shared memory; otherwise each
    product dequantises this rank's experts whole first."""
    return setup.device == "cuda" and setup.dtype_bytes == 2


FP8_TENSOR_CORE_PRODUCTS = ("experts", "experts_forward", "dense_backward", "dense_forward")


def env_words(name: str) -> list[str]:
    """An environment variable's comma list, as backend.h env_words reads it (a trailing comma ends it)."""
    value = os.environ.get(name, "")
    words = value.split(",") if value else []
    if words and not words[-1]:
        words.pop()
    return words


def fp8_tensor_cores() -> frozenset[str]:
    """The FP8 products on FP8 tensor cores, as the C++ ops read V4TRAIN_FP8_TENSOR_CORES (lora.cc
    fp8_tensor_cores), word by word: FP8_TENSOR_CORE_PRODUCTS, all (or 1: every one but the
    forward-only experts_forward, which experts covers), none (or 0); unset or empty: none."""
    value = os.environ.get("V4TRAIN_FP8_TENSOR_CORES", "")
    products: set[str] = set()
    for word in env_words("V4TRAIN_FP8_TENSOR_CORES"):
        if word in ("all", "1"):
            products |= set(FP8_TENSOR_CORE_PRODUCTS) - {"experts_forward"}
        elif word in FP8_TENSOR_CORE_PRODUCTS:
            products.add(word)
        elif word not in ("none", "0"):
            raise ValueError(f"V4TRAIN_FP8_TENSOR_CORES={value}: unknown product {word!r}; expected a comma list "
                             f"of {', '.join(FP8_TENSOR_CORE_PRODUCTS)}, or all, 1, none, 0")
    return frozenset(products)


E4M3_VARIANTS = ("transpose_global", "wide")


def e4m3_variants() -> frozenset[str]:
    """The e4m3 experts kernel's variants, as fp8_grouped.cu e4m3_variants reads
    V4TRAIN_FP8_E4M3_VARIANTS: words of E4M3_VARIANTS, or none; unset or empty: all of them."""
    words = env_words("V4TRAIN_FP8_E4M3_VARIANTS")
    if not words:
        return frozenset(E4M3_VARIANTS)
    for word in words:
        if word not in E4M3_VARIANTS + ("none",):
            listed = f"{', '.join(E4M3_VARIANTS[:-1])} and {E4M3_VARIANTS[-1]}"  # (as env_variants lists them)
            raise ValueError(f"V4TRAIN_FP8_E4M3_VARIANTS={os.environ['V4TRAIN_FP8_E4M3_VARIANTS']}: unknown variant "
                             f"{word!r}; expected a comma list of {listed}, or none")
    return frozenset(words) - {"none"}


def turned_weight_bytes(experts: int, rows: int, cols: int) -> int:
    """transpose_global's backward (fp8_grouped.cu launch_e4m3): the FP8 weight [E, rows, cols] turned
    a group of experts at a time (at most a quarter of them and TURN_MIB) into one buffer, and all
    their block scales turned (fp32)."""
    per = rows * cols
    group = max(1, min(-(-experts // 4), (TURN_MIB << 20) // per))
    return min(group, experts) * per + experts * (rows // 128) * (cols // 128) * FP32


def quantised_rows_bytes(rows: int, cols: int) -> int:
    """fp8.cuh quantize_rows' output for [rows, cols]: e4m3 values and fp32 scales per 128 columns,
    the rows padded to 16."""
    padded = -(-rows // 16) * 16
    return padded * cols + padded * (cols // 128) * FP32


def fused_combine(setup: Setup, hidden: int, k: int) -> bool:
    """Whether the MoE combine runs its CUDA kernels (experts.cc Combine::fused): CUDA, bf16 or
    fp32, rows a multiple of 8 wide and at most COMBINE_MAX_ROW_BYTES, at most COMBINE_MAX_SLOTS
    slots a token. They read the routed rows in place; ATen gathered a block of them, and in the
    backward widened it to fp32."""
    return (device_kernels(setup) and hidden % 8 == 0 and hidden * setup.dtype_bytes <= COMBINE_MAX_ROW_BYTES
            and k <= COMBINE_MAX_SLOTS)


def padded_tokens(c: Ctx) -> int:
    """P: the tokens with each document padded to whole chunks of 64 (the delta rule's slots)."""
    return sum(-(-L // GDR_CHUNK) * GDR_CHUNK for L in c.documents)


def delta_rule_aten(c: Ctx, s: Saved, conv: int) -> tuple[list[Moment], list[Moment], list[Moment]]:
    """The delta rule's ATen path (gated_delta_rule.cc below FusedRule): adds what its autograd
    graph keeps to the block's `s`; returns the moments of its forward pass, of a checkpointed
    first pass and of its backward."""
    cfg, T, b, f = c.cfg, c.tokens, c.b, c.f
    nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    # The delta rule's [chunks, value heads, 64, dim] tensors, in fp32, each document padded to
    # whole chunks: U a [.., dk] (or dv) row, M a [.., 64] row per padded token, S the state
    # [dk, dv] at each chunk's start per padded token.
    P = padded_tokens(c)
    U, M, S = nv * dk * f, nv * GDR_CHUNK * f, nv * dk * dv * f // GDR_CHUNK
    # gated_delta_rule.cc: q and k repeated to the value heads (the L2 norms' input); q, k, v in
    # chunks; k * beta; at::matmul's contiguous copies of its non-contiguous chunk views (q,
    # k^T twice, k * beta), which its batched products keep; the decay matrices and the two
    # masked products with them; the UT solve's result [u | w]; w, k_out and v_new (the
    # scan's); the states; q decayed to the chunk start, copied for the output product.
    s.add("gdr_l2", "q and k repeated to the value heads [T, heads, dk] (fp32; the L2 norms' input)", 2 * T * U)
    s.add("gdr_chunks", "q, k, v and k * beta in chunks (fp32)", 4 * P * U)
    s.add("gdr_copies", "matmul's contiguous copies of q, k (twice, transposed), k * beta", 4 * P * U)
    s.add("gdr_decay", "the decay matrices and the two products masked by them [chunks, heads, 64, 64]", 5 * P * M)
    s.add("gdr_uw", "the UT transform's solution [u | w] (the solve's backward)", 2 * P * U)
    s.add("gdr_scan", "w, k_out, v_new (the scan's backward)", 3 * P * U)
    s.add("gdr_state", "the state at each chunk's start [chunks, heads, dk, dv]", P * S)
    s.add("gdr_out", "q decayed to the chunk start, copied for the output product", P * U)
    held = list(s)
    # While the rule runs: its locals (q, k L2-normed, v * beta, u) and its output reordered.
    rule_locals = [Term("delta rule's locals: q, k L2-normed, v * beta, u", 2 * T * U + 2 * P * U),
                   Term("delta rule's output and its reordered copies", 3 * P * U)]
    forward = [Moment("gated delta rule", tuple(held + rule_locals))]
    first_pass = [Moment("gated delta rule", (
        Term("the block's locals: h, qkv after the conv, z", T * (cfg.hidden_size + conv + nv * dv) * b),
        Term("delta rule's locals: q, k, v, k * beta, v * beta, the solution, u, w, k_out, v_new",
             2 * T * U + 12 * P * U),
        Term("delta rule's decays, products and states", 3 * P * M + P * S)) + tuple(rule_locals[1:]))]
    # The scan's backward: the incoming gradients of the states and values, the reverse scan's
    # states and outputs, dw and dk_out (and a temporary), q's gradient held for its sum.
    backward = [Moment("delta rule's scan backward", tuple(s.but(held, "gdr_out") + [
        Term("scan backward: the states' and values' incoming gradients", P * S + P * U),
        Term("scan backward: the reverse scan's states and outputs", P * S + P * U),
        Term("scan backward: dw, dk_out and a temporary", 3 * P * U),
        Term("scan backward: q's gradient in chunks, and the rule's output gradient (fp32)", P * U + T * U)]))]
    return forward, first_pass, backward


def fused_bf16_u(setup: Setup) -> bool:
    """Whether the plane kernels keep U, the values the forward's recurrence corrects (prepare's output,
    its base), in bf16, where the kernels before kept it in fp32. A switch of its own so that the peaks
    measured before it are predicted as that code ran."""
    return True


def delta_rule_fused(c: Ctx, s: Saved, conv: int) -> tuple[list[Moment], list[Moment], list[Moment]]:
    """The delta rule's fused path (gated_delta_rule.cc's FusedRule, gated_delta_rule.cu's host
    function fused()): adds what the autograd node keeps to the block's `s`; returns the moments of
    its forward pass, of a checkpointed first pass and of its backward. The kernels' work tensors
    are fp32 (float64 for dg) whatever the model's dtype, but for the states across chunks (h,
    d_state), U, v_new, dv_local and dv_new, which its plane kernels (bf16 at widths 128: gated_delta_rule.cu's
    kPlanes) keep in bf16."""
    cfg, T, b = c.cfg, c.tokens, c.b
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    P = padded_tokens(c)
    chunks = P // GDR_CHUNK

    def rows(d: int) -> int:  # fused()'s rows(d): [chunks, value heads, 64, d] fp32
        return P * nv * d * FP32

    # FixedDims<128, 128> (the fused path takes fp32 or bf16: 2 bytes is bf16), a key head's value heads one cluster
    planes = b == 2 and dk == dv == 128 and nv // nk <= GDR_MAX_CLUSTER
    one_kernel = planes and fused_dqkwg(c.setup)
    state = chunks * nv * dk * dv * (b if planes else FP32)  # [chunks, value heads, dk, dv]
    values = P * nv * dv * (b if planes else FP32)  # v_new and dv_new [chunks, value heads, 64, dv]
    gamma = chunks * nv * FP32  # the chunks' decays [chunks, value heads] fp32 (and their gradient)
    # FusedRule saves its inputs as the kernels read them: q, k, v copied by contiguous() (the
    # block's are views of the conv's output), g as it is (float64: beta_g), beta cast to fp32 (in
    # an fp32 model beta itself, which sigmoid keeps: beta_g), the slots; and the forward pass's
    # states at each chunk's start and v_new.
    s.mark("gdr")
    s.add("gdr_inputs", "q, k [T, key heads, dk] and v [T, value heads, dv] made contiguous",
          T * (2 * nk * dk + nv * dv) * b)
    s.add("gdr_beta", "beta in fp32 [T, value heads]", T * nv * FP32, b != FP32)
    s.add("gdr_slots", "the token of each chunk slot [P] (int64)", P * INT64)
    s.add("gdr_state", "h: the state at each chunk's start [chunks, value heads, dk, dv] (fp32; bf16 on planes)", state)
    s.add("gdr_v_new", "v_new [chunks, value heads, 64, dv] (fp32; bf16 on planes)", values)
    held, rule = list(s), s.since("gdr")
    # The forward pass: the block's locals alive around the call, fused()'s U, W, K~ and decays
    # (freed when it returns), the output.
    block = Term("the block's locals: qkv before and after the conv [T, conv dim], z [T, vd], a (float64)",
                 T * ((2 * conv + nv * dv) * b + nv * INT64))
    u = P * nv * dv * (b if planes and fused_bf16_u(c.setup) else FP32)  # U [chunks, value heads, 64, dv]
    work = [Term("delta rule forward: U [.., dv] (fp32; bf16 on planes), W and K~ [.., dk] (fp32) and the chunks' "
                 "decays", u + 2 * rows(dk) + gamma),
            Term("delta rule's output o [T, value heads, dv]", T * nv * dv * b)]
    forward = [Moment("gated delta rule", tuple(held + [block] + work))]
    inputs = Term("the block's input h [T, H], beta and g (float64)", T * (cfg.hidden_size * b + nv * (b + INT64)))
    first_pass = [Moment("gated delta rule", tuple([inputs, block] + rule + work))]
    # The backward pass (fused() with backward): o's incoming gradient, and z's, whose node comes
    # after the rule's in the engine's order; W (its memory then takes dW), K~ and the decays
    # throughout. It peaks in the reverse recurrence (dv_local, dh_local, d_state, dv_new) or at
    # its end: wy_grads' inputs and outputs, then the key heads' sums of dq and dk (sum, then cast; on
    # planes the kernels write the sums, bf16 [T, key heads, dk], and no value head's share).
    incoming = Term("the rule's output gradient [T, value heads, dv], and z's waiting", 2 * T * nv * dv * b)
    wk = Term("delta rule backward: W (then dW), K~ [.., dk], prepare's Ai and L * K K^T for wy_grads [.., 64] and "
              "the chunks' decays (fp32)", 2 * rows(dk) + 2 * rows(GDR_CHUNK) + gamma)
    cast = b if b < FP32 else 0  # .to() of an fp32 sum to fp32 is the sum itself
    # dh_local: fp32 [chunks, value heads, dk, dv] from local_grads, or on planes the E Q (bf16 [.., 64,
    # dk]) that the reverse recurrence forms it from.
    dh = P * nv * dk * b if planes else chunks * nv * dk * dv * FP32
    # dq, dk: each value head's share [T, value heads, dk] (fp32) and the key heads' sums (dk's in fp32,
    # then cast); on planes the sums alone, in bf16.
    summed = planes and fused_key_sums(c.setup)
    local = P * nv * dv * (b if planes and fused_bf16_dv_local(c.setup) else FP32)  # dv_local [chunks, value heads, 64, dv]
    shares = 0 if summed else T * nv * 2 * dk * FP32
    sums = T * nk * dk * (2 * b if summed else b + FP32 + cast)
    backward = [
        Moment("delta rule's reverse recurrence", tuple(held + [incoming, wk, Term(
            "reverse recurrence: dv_local [.., 64, dv] (fp32; bf16 on planes), dv_new (as v_new); dh_local (fp32; on "
            "planes E Q [.., 64, dk]), d_state (as h) [chunks, value heads, dk, dv]", local + values + dh + state)])),
        Moment("delta rule's UT-transform gradients", tuple(held + [incoming, wk, Term(
            "state and intra gradients: dv_new (as v_new), dk_part [.., dk] (fp32), dg_part [chunks, value heads, 64] "
            "(float64); off planes also dq_state, dk_tilde [.., dk] (fp32) and dgamma (on planes one kernel keeps them "
            "in shared memory)", values + rows(dk) + P * nv * INT64 + (0 if one_kernel else 2 * rows(dk) + gamma)), Term(
            "UT-transform gradients: dq, dk [T, value heads, dk] (fp32; not on planes), dv [T, value heads, dv], "
            "dbeta (fp32), dg (float64)", shares + T * nv * (dv * b + FP32 + INT64)), Term(
            "key heads' sums: dq and dk summed over each key head's value heads [T, key heads, dk] (dk's sum in "
            "fp32, then cast; on planes both bf16, summed in the kernels)", sums)]))]
    return forward, first_pass, backward


def qwen3_5_layer(c: Ctx, i: int) -> LayerMemory:
    """v4_qwen3_5_layer_forward (cc/models/qwen3_5): zero-centred RMSNorm, Gated DeltaNet
    (gated_deltanet.cc, causal_conv1d.cc, gated_delta_rule.cc) or gated attention
    (gated_attention.cc), RMSNorm, the MoE (qwen3_5_moe.cc) or the dense MLP."""
    cfg, T, b, f = c.cfg, c.tokens, c.b, c.f
    H = cfg.hidden_size
    s = Saved()
    s.add("norms", "the two RMSNorms' 1 / rms [T, 1] (fp32)", 2 * T * FP32)
    forward, first_pass, backward = [], [], []
    if cfg.layer_types[i] == "linear_attention":
        la = "linear_attn."
        nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        conv = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + nv * dv
        projections = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        s.add("h", "input_layernorm's output [T, H] (the projections' input)", T * H * b,
              any(c.keeps_input(i, la + m + ".weight") for m in projections))
        for m in projections:
            lora_terms(s, c, i, m, la + m + ".weight", T)
        s.add("beta_g", "beta, a and the log decay g [T, value heads] (float64)", T * nv * (b + 3 * INT64))
        if fused_conv(c.setup):  # the kernels' node keeps the conv's input (and its weight in fp32)
            s.add("conv", "the conv's input [T, conv dim] (the fused conv's)", T * conv * b)
        else:
            # causal_conv1d in fp32: silu keeps its input, and index_add keeps each shifted tap's
            # product (its source) [T - j, conv dim]; a trained conv weight also keeps the conv's
            # input and each tap's gathered rows (the products' other factor).
            taps = sum(max(L - j, 0) for L in c.documents for j in range(1, cfg.linear_conv_kernel_dim))
            s.add("conv", "the conv's pre-activation [T, conv dim] (fp32; silu's input)", T * conv * f)
            s.add("conv_taps", "each shifted tap's product [T - j, conv dim] (fp32; index_add's source)",
                  taps * conv * f)
            s.add("conv_rows", "the conv's fp32 input and each tap's gathered rows (the conv weight's gradient)",
                  (T + taps) * conv * f, c.trains(la + "conv1d.weight"))
        # The delta rule as the op runs it on the device planned for.
        rule = delta_rule_fused if fused_delta_rule(c.setup) else delta_rule_aten
        forward, first_pass, backward = rule(c, s, conv)
        s.mark("norm")
        if fused_norm(c.setup):  # the kernels' node keeps the rule's output, z and 1 / rms
            s.add("norm_in", "the rule's output and z [T, vd], 1 / rms [T, value heads] (fp32; the fused gated norm's)",
                  2 * T * nv * dv * b + T * nv * FP32)
        else:
            # The gated RMSNorm: the rule's output in fp32 (the norm's input), normed times its
            # weight (the gate's product), silu(z) and z in fp32.
            s.add("norm_in", "the rule's output in fp32 [T, vd] (the gated norm's input)", T * nv * dv * f)
            s.add("norm_out", "the normalised output times its weight [T, vd] (the gate's product)", T * nv * dv * b)
            s.add("norm_w", "the normalised output [T, vd] (the norm weight's gradient)", T * nv * dv * b,
                  c.trains(la + "norm.weight"))
            s.add("z", "z and silu(z) in fp32 [T, vd] (the gate)", 2 * T * nv * dv * f)
        # The gated output (out_proj's input).
        s.add("y", "the gated output [T, vd] (out_proj's input)", T * nv * dv * b,
              c.keeps_input(i, la + "out_proj.weight"))
        lora_terms(s, c, i, "out_proj", la + "out_proj.weight", T)
    else:
        sa = "self_attn."
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        s.add("h", "input_layernorm's output [T, H] (q, k, v projections' input)", T * H * b,
              any(c.keeps_input(i, sa + m + ".weight") for m in ("q_proj", "k_proj", "v_proj")))
        for m in ("q_proj", "k_proj", "v_proj"):
            lora_terms(s, c, i, m, sa + m + ".weight", T)
        s.add("q_gate", "q_proj's output [T, heads, 2 head_dim] (q_norm's input)", T * nh * 2 * hd * b)
        s.add("k_lin", "k_proj's output [T, kv heads, head_dim] (k_norm's input)", T * nkv * hd * b)
        s.add("rope", "RoPE's cos and sin [T, rope dim]", 2 * T * cfg.rope.dim * b)
        # sdpa keeps the RoPE'd queries, the keys and values repeated to the query heads
        # (repeat_interleave copies them), its output and log-sum-exp.
        s.add("sdpa", "queries, keys and values [T, heads, head_dim], the output and log-sum-exp (sdpa's backward)",
              T * nh * (4 * hd * b + FP32))
        s.add("attn", "attention's output and sigmoid(gate) [T, heads * head_dim] (the gate's product)",
              2 * T * nh * hd * b)
        s.add("gated", "the gated output [T, heads * head_dim] (o_proj's input)", T * nh * hd * b,
              c.keeps_input(i, sa + "o_proj.weight"))
        lora_terms(s, c, i, "o_proj", sa + "o_proj.weight", T)
        s.mark("norm")
        backward.append(Moment("gated attention backward", tuple(s.before("norm") + [
            Term("attention backward: the output's gradient, dq, dk and dv (repeated)", 4 * T * nh * hd * b)])))
    s.mark("mid")
    s.add("mid", "the residual after the mixer [T, H] (post_attention_layernorm's input)", T * H * b)
    kept = []
    # The tail (MoE or MLP) on Tt tokens at once, as in glm5_layer: beside a checkpointed first
    # pass's blocks mid, h2 and the output being summed; its backward holds h2 throughout.
    Tt, ckpt = tail_tokens(c, i), c.setup.checkpointing
    layer_locals = [Term("the layer's locals: mid, h2 and the output summed block by block [T, H]", 3 * T * H * b)]
    if cfg.is_moe:
        E, k, I = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        sh = "mlp.shared_expert."
        s.add("h2", "post_attention_layernorm's output [T, H] (the router's and shared expert's input)", T * H * b,
              ckpt or c.trains("mlp.gate.weight") or c.keeps_input(i, sh + "gate_proj.weight") or
              c.keeps_input(i, sh + "up_proj.weight"))
        s.add("router", "the router's softmax [T, E] (fp32), top-k values, normalised and cast [T, k], indices",
              Tt * E * FP32 + Tt * k * (FP32 + b + INT64))
        mlp_terms(c, i, s, sh, cfg.shared_expert_intermediate_size, Tt)
        s.add("shared_out", "the shared expert's output [T, H] and its sigmoid gate (their product)", Tt * (H + 1) * b)
        kept.append(Term("routing: the MoE routing [T, k] (int64)", T * k * INT64))
        moe_locals = layer_locals + kept + [Term("the MoE's locals: shared expert's output, softmax",
                                                 Tt * (H * b + E * FP32))]
        fwd_moe, first_moe, back_moe, g_experts = moe_terms(c, i, s, E, k, H, I, Tt, moe_locals)
        grads = layer_grads(c, i, exclude=("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) + g_experts
    else:
        s.add("h2", "post_attention_layernorm's output [T, H] (the MLP's input)", T * H * b,
              ckpt or c.keeps_input(i, "mlp.gate_proj.weight") or c.keeps_input(i, "mlp.up_proj.weight"))
        mlp_terms(c, i, s, "mlp.", cfg.intermediate_size, Tt)
        fwd_moe, first_moe, back_moe = [], [], []
        grads = layer_grads(c, i)
    by_tail, by_head = checkpoint_terms(c, Tt, layer_grads(c, i, within="mlp."))
    return LayerMemory(Term("input: the layer's input [T, H]", T * H * b), s, kept, forward + beside(fwd_moe, by_tail),
                       first_pass + first_moe, beside(back_moe, by_tail) + beside(backward, by_head), grads)


LAYERS = {"glm5": glm5_layer, "qwen3_5": qwen3_5_layer}


# ----------------------------------------------------------------------------------------------
# The step: the layers' passes, the LM head, and where the peak is


@dataclasses.dataclass(frozen=True)
class Peak:
    bytes: int
    where: str
    terms: tuple[Term, ...]


@functools.lru_cache(maxsize=64)
def _adapted_and_fp8(cfg, hf_key: str, finetune: str, fp8: str, r: int, targets: tuple, experts: bool, gpus: int,
                     ep: int) -> tuple[frozenset, frozenset]:
    setup = Setup(cfg, json.loads(hf_key), gpus, ep, finetune, fp8, lora_r=r, lora_target_modules=targets,
                  lora_experts=experts)
    adapted = set()
    if finetune == "lora":
        for name in adapter_shapes(setup):
            layer, rest = name.split(".", 3)[2:]
            # X.lora_A of X.weight; a fused experts' tensor X's factors are X_lora_A (adapter_names)
            weight = rest[:-len(".lora_A")] + ".weight" if rest.endswith((".lora_A", ".lora_B")) else \
                rest[:-len("_lora_A")]
            adapted.add(f"{layer}:{weight}")
    q, maps = fp8_config(setup.hf_config), linear_map_names(cfg)
    fp8_names = {f"{s.name.split('.', 3)[2]}:{s.name.split('.', 3)[3]}" for s in all_specs(cfg)
                 if s.name.startswith("model.layers.") and is_fp8(s, setup.fp8, maps, q)}
    return frozenset(adapted), frozenset(fp8_names)


def _ctx(setup: Setup, documents: tuple[int, ...]) -> Ctx:
    adapted, fp8 = _adapted_and_fp8(setup.cfg, json.dumps(setup.hf_config, sort_keys=True), setup.finetune, setup.fp8,
                                    setup.lora_r, tuple(setup.lora_target_modules), setup.lora_experts, setup.gpus,
                                    setup.expert_parallel)
    return Ctx(setup, sum(documents), documents, adapted, fp8, setup.dtype_bytes, max(FP32, setup.dtype_bytes))


def lm_head_terms(setup: Setup, T: int) -> tuple[list[Term], list[Term], int]:
    """The final norm and the LM head's loss (cc/ops/cross_entropy_loss.cc), a chunk of tokens at a
    time, its gradients formed in the forward pass: (the forward pass's tensors, the backward
    pass's, the LM head's gradient that stays)."""
    cfg, b = setup.cfg, setup.dtype_bytes
    H, V, c = cfg.hidden_size, cfg.vocab_size, min(CE_CHUNK, T)
    held = [Term("the final norm's input and output [T, H] (their backward)", 2 * T * H * b)]
    # Forward, in training: the op forms the gradients there beside the hidden states' gradient and
    # the LM head's (and, past the first chunk, the next chunk's part before it is added): a chunk's
    # logits in the model dtype, the kernel's gradient written over them; or on ATen the logits in
    # fp32 and log_softmax'ed, then the gradient in fp32 and cast.
    grad_w = V * H * b if setup.finetune == "full" else 0
    parts = 2 if T > CE_CHUNK else 1
    grad_h = Term("the hidden states' gradient [T, H], formed in the LM head's forward", T * H * b)
    if fused_loss(setup):
        chunk = Term("LM head forward: a chunk's logits, then its gradient over them (and the LM head's)",
                     c * V * b + parts * grad_w)
    else:
        chunk = Term("LM head forward: a chunk's logits in fp32 and log_softmax'ed (or its gradient and the LM "
                     "head's)", max(c * V * (b + 2 * FP32), c * V * (FP32 + b) + parts * grad_w))
    fwd = held + [grad_h, chunk]
    # Backward: those gradients, scaled in place.
    bwd = held + [grad_h, Term("the LM head's gradient, formed in its forward", grad_w)]
    stays = _shard_rows(V, setup.gpus) * H * b if setup.finetune == "full" else 0
    return fwd, bwd, stays


def activation_peak(setup: Setup, documents: tuple[int, ...] | None = None) -> Peak:
    """The most memory a training step allocates above the weights and the training state on one
    GPU, and where: activations and transients, and with --finetune=full the weight gradients
    made by then. documents: the lengths of the documents in the GPU's tokens (default: one per
    row of seq_len)."""
    documents = documents or (setup.seq_len,) * setup.micro_batch_size
    c = _ctx(setup, documents)
    cfg, T, b = setup.cfg, c.tokens, c.b
    layers = [LAYERS[cfg.family](c, i) for i in range(cfg.num_hidden_layers)]
    ckpt = setup.checkpointing
    # What each layer holds from its forward pass to its backward: its input and (checkpointed)
    # its first pass's choices, or (not checkpointed) every tensor it saved.
    held = [[l.input] + (l.kept if ckpt else l.saved) for l in layers]
    what = "inputs and first-pass choices" if ckpt else "saved tensors"

    def below(i):  # the layers before layer i, as one line
        return [Term(f"layers 0-{i - 1}: their {what}", total(t for h in held[:i] for t in h))] if i else []

    def own(l):  # a layer's own held tensors beside its moment (a recomputation saves the kept ones again: once)
        if not ckpt:
            return [l.input]
        saved = {key(t) for t in l.saved}
        return [l.input] + [t for t in l.kept if key(t) not in saved]

    flow = [Term("gradient: the layer's output's [T, H]", T * cfg.hidden_size * b),
            Term("gradient: the layer's input's, being summed [T, H]", T * cfg.hidden_size * b)]
    candidates = []

    def consider(where, *groups):
        terms = tuple(t for g in groups for t in g if t.bytes)
        candidates.append(Peak(total(terms), where, terms))

    for i, l in enumerate(layers):
        for m in (l.first_pass if ckpt else l.forward):
            consider(f"forward of layer {i}: {m.label}", below(i), [l.input], m.terms)
    fwd_head, bwd_head, grads = lm_head_terms(setup, T)
    everything = [Term(f"every layer's {what}", total(t for h in held for t in h))]
    consider("LM head forward", everything, fwd_head)
    consider("LM head backward", everything, bwd_head)
    for i in reversed(range(len(layers))):
        l = layers[i]
        done = [Term("weight gradients of the LM head and the layers after this one", grads)]
        for m in l.backward:
            consider(f"backward of layer {i}{' (recomputed)' if ckpt else ''}: {m.label}", below(i), own(l), m.terms,
                     flow, done)
        if ckpt:
            for m in l.forward:
                consider(f"recomputation of layer {i}: {m.label}", below(i), own(l), m.terms, flow[:1], done)
        grads += l.grads
    if setup.finetune == "full":  # the final norm's and the embeddings' gradients last
        world = setup.gpus
        grads += (_shard_rows(cfg.vocab_size, world) * cfg.hidden_size + _shard_rows(cfg.hidden_size, world)) * b
        consider("end of the backward pass", [Term("every weight's gradient", grads)])
    return max(candidates, key=lambda p: p.bytes)


def layouts(setup: Setup) -> list[tuple[int, ...]]:
    """The document layouts of rows of seq_len tokens whose memory differs: one document a row;
    for GLM-5 also documents of MASKED_MAX_LEN, the longest that attend densely (every token keeps
    per-head keys and values, which longer documents do not)."""
    out = [(setup.seq_len,) * setup.micro_batch_size]
    if setup.cfg.family == "glm5" and setup.seq_len > MASKED_MAX_LEN:
        n, rest = divmod(setup.seq_len, MASKED_MAX_LEN)
        out.append(((MASKED_MAX_LEN,) * n + ((rest,) if rest else ())) * setup.micro_batch_size)
    return out


@dataclasses.dataclass(frozen=True)
class Communication:
    all_to_all: int  # the routed rows sent and received (in the activation peak's moments, not added again)
    all_gather: int  # FSDP2's unsharded parameters: two decoder layers and the root
    reduce_scatter: int  # FSDP2's unsharded gradients of one layer before they are scattered

    @property
    def bytes(self) -> int:
        """What comes on top of the activation peak: FSDP2's buffers, alive beside every layer's
        compute. (The all-to-all's are tensors of the MoE's own moments: moe_terms.)"""
        return self.all_gather + self.reduce_scatter


def communication(setup: Setup, weights: list[WeightLine]) -> Communication:
    """The collectives' buffers. All-to-all: T k routed rows of H values each way, in the model
    dtype (the MoE moments count them where they are alive). FSDP2 (gpus > 1): the all-gathered
    parameters of the layer computing and of the one prefetched, and of the root module
    (embeddings, final norm, LM head), which stays unsharded through the step; and one layer's
    unsharded gradients of what trains before their reduce-scatter."""
    cfg = setup.cfg
    a2a = 0
    if setup.expert_parallel > 1:
        a2a = 2 * setup.tokens * cfg.num_experts_per_tok * cfg.hidden_size * setup.dtype_bytes
    gather = scatter = 0
    if setup.gpus > 1:
        full = {w.name: _unsharded(w, setup) for w in weights if not w.expert}
        per_layer = [sum(v for n, v in full.items() if n.startswith(f"model.layers.{i}."))
                     for i in range(cfg.num_hidden_layers)]
        gather = 2 * max(per_layer) + sum(v for n, v in full.items() if not n.startswith("model.layers."))
        if setup.finetune == "full":
            scatter = max(sum(_unsharded(w, setup) for w in weights if w.trains and not w.expert and
                              w.name.startswith(f"model.layers.{i}.")) for i in range(cfg.num_hidden_layers))
        else:
            shapes = adapter_shapes(setup)
            scatter = setup.dtype_bytes * max(sum(math.prod(sh) for n, sh in shapes.items()
                                                  if n.startswith(f"model.layers.{i}.") and len(sh) == 2)
                                              for i in range(cfg.num_hidden_layers))
    return Communication(a2a, gather, scatter)


def _unsharded(w: WeightLine, setup: Setup) -> int:
    per = {"float8_e4m3fn": 1, "bfloat16": 2, "float32": 4}[w.dtype]
    blocks = 0
    if w.scale_bytes:
        blocks = math.prod(w.shape[:-2]) * -(-w.shape[-2] // FP8_BLOCK) * -(-w.shape[-1] // FP8_BLOCK)
    return math.prod(w.shape) * per + blocks * FP32


# ----------------------------------------------------------------------------------------------
# The plan


@dataclasses.dataclass(frozen=True)
class Plan:
    setup: Setup
    weights: list[WeightLine]
    training: Training
    peak: Peak
    comm: Communication

    @property
    def weight_bytes(self) -> int:
        return sum(w.bytes for w in self.weights)

    @property
    def state_bytes(self) -> int:
        t = self.training
        return t.parameters + t.gradients + t.moments + t.masters

    @property
    def total_bytes(self) -> int:
        # A full fine-tune's gradients are in the peak where they exist; LoRA's are counted with
        # the factors (small, and kept between micro-batches of an accumulating step).
        grads = self.training.gradients if self.setup.finetune == "full" else 0
        return self.weight_bytes + self.state_bytes - grads + self.peak.bytes + self.comm.bytes

    @property
    def headroom_bytes(self) -> int:
        return int(self.setup.gpu_memory_gib * GIB) - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0


def check(setup: Setup) -> None:
    """Flags that cannot describe a run, named: an error before any arithmetic."""
    cfg = setup.cfg
    for name in ("gpus", "expert_parallel", "seq_len", "micro_batch_size", "lora_r"):
        if getattr(setup, name) < 1:
            raise PlanError(f"--{name}={getattr(setup, name)}: expected an integer >= 1")
    if setup.gpus % setup.expert_parallel:
        raise PlanError(f"--expert_parallel={setup.expert_parallel} does not divide --gpus={setup.gpus}: "
                        "expert-parallel groups split the GPUs evenly (the rest of the world is data parallel)")
    field = "n_routed_experts" if cfg.family == "glm5" else "num_experts"
    experts = getattr(cfg, field)
    if setup.expert_parallel > 1 and (not experts or experts % setup.expert_parallel):
        raise PlanError(f"--expert_parallel={setup.expert_parallel} does not divide the config's {field}={experts}: "
                        "each rank holds an equal share of the routed experts")
    if not setup.gpu_memory_gib > 0:
        raise PlanError(f"--gpu_memory_gib={setup.gpu_memory_gib}: expected a number > 0")
    if setup.finetune == "full" and setup.fp8 == "keep" and fp8_config(setup.hf_config):
        raise PlanError("--finetune=full with --fp8=keep: the config is an FP8 checkpoint's, whose FP8 weights are a "
                        "frozen base; full fine-tuning trains every weight: pass --fp8=dequantize")
    if setup.finetune == "lora":
        try:
            adapter_shapes(setup)
        except ValueError as e:
            raise PlanError(str(e)) from None


def plan(setup: Setup) -> Plan:
    check(setup)
    weights = weight_lines(setup)
    peaks = [activation_peak(setup, d) for d in ([setup.documents] if setup.documents else layouts(setup))]
    return Plan(setup, weights, training(setup, weights), max(peaks, key=lambda p: p.bytes),
                communication(setup, weights))


def longest_seq_len(setup: Setup, step: int = SEQ_LEN_STEP) -> int:
    """The longest multiple of `step` up to the model's max_position_embeddings at which this
    setup fits, every shorter multiple fitting too (a row of seq_len tokens may hold shorter
    documents); 0 when not even `step` fits."""
    # (the trainer cuts rows at max_position_embeddings; a config without it: its rope's length)
    limit = setup.hf_config.get("max_position_embeddings") or \
        (setup.hf_config.get("text_config") or {}).get("max_position_embeddings") or \
        setup.cfg.rope.original_max_position_embeddings
    best = 0
    for n in range(step, limit + 1, step):
        if not plan(dataclasses.replace(setup, seq_len=n, documents=None)).fits:
            break
        best = n
    return best
