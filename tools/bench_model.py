"""A training step of a model proxy in transformers and in v4train, side by side in one process.

    PYTHONPATH=py:build/ext:. python3 tools/bench_model.py --model glm5 --tokens 4096,16384,65536
    PYTHONPATH=py:build/ext:. python3 tools/bench_model.py --model qwen3_5 --tokens 4096,16384,65536

The proxies of ../shared/notes/baselines.md, bf16, random weights:
- glm5: GlmMoeDsaConfig's defaults (hidden 6144, 64 heads, MLA, DSA top-2048, vocabulary 154880)
  with 4 layers (1 dense + 3 MoE) and 32 routed experts top-8;
- qwen3_5: Qwen3_5MoeTextConfig's defaults (hidden 2048, 16 / 2 heads of 256, Gated DeltaNet 16
  key / 32 value heads of 128, experts of 512 top-8 with a shared one of 512, vocabulary 248320)
  with 4 layers (3 Gated DeltaNet + 1 gated attention) and 64 routed experts.
transformers (sdpa attention; for Qwen3.5 its PyTorch delta rule unless flash-linear-attention is
installed) builds it; v4train gets the very same parameter tensors (no copy) and the same tokens,
one sequence.
A step is forward + backward of the LM loss with every weight trainable (no optimizer), as in
the baselines. Per sequence length: median step time over --steps after --warmup, tokens/s,
the peak memory above the weights (gradients included), TFLOP/s (6 x active parameters per
token, attention not counted), and the loss difference; then, for v4train, the forward time of
each op call, the top CUDA kernels of one step (torch.profiler), and the share of the step's
FLOPs that ran in C++ ops; with --memory, the blocks alive at v4train's peak, grouped by the line
that allocated them (peak_breakdown). A run that runs out of memory is reported as such. Activation
checkpointing is used where --checkpointing says (auto: from 16,384 tokens for v4train; never
for transformers, whose own checkpointing runs out of memory at 16,384 on the GLM-5 proxy, see
baselines.md).
Prints markdown rows and writes JSON to --out.

--fp8 instead (the FP8 targets of issue 16): every linear map of the layers quantised in 128 x 128
blocks as the released FP8 checkpoints are (embeddings, norms, router and LM head not), LoRA of
--lora_rank on attention and experts; the model kept in FP8 against the same model dequantised to
bf16, on the same values and adapters: weight bytes, the LoRA step (forward + backward) and the
loss after --train_steps AdamW steps of each on one batch; with --fp8_tensor_cores the FP8 model
once per V4TRAIN_FP8_TENSOR_CORES value given (e.g. `none experts experts,dense_backward`), each
optionally with `@` and the V4TRAIN_FP8_E4M3_VARIANTS to run it under (`experts@transpose_global,wide`).
With --profile both models' kernels of one step, then the kernels whose device time differs most
between them (kernel_diff): where the FP8 step's milliseconds go.

--full_layer instead: one GLM-5 decoder layer at the released widths (GlmMoeDsaConfig's defaults:
hidden 6144, 64 heads, 256 routed experts of 2048, top-8), its linear maps FP8 with random values,
LoRA of --lora_rank on attention and experts: the step and its peak memory at each length (the
unit that a multi-GPU plan multiplies).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import re
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "py"))

from v4train import ops  # noqa: E402
from v4train.flops import FlopShare  # noqa: E402
from v4train.models import config_from_dict  # noqa: E402
from v4train.lora import LoraConfig, add_adapters, expand_targets  # noqa: E402
from v4train.model import CausalLM, Packed, all_specs, linear_map_names  # noqa: E402
from v4train.plan import fp8_config, not_converted  # noqa: E402
from v4train.reference.lora import dequantize_fp8, quantize_fp8, scale_name  # noqa: E402

GIB = 2**30


def glm5_proxy(**overrides):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    return GlmMoeDsaConfig(**{"num_hidden_layers": 4, "n_routed_experts": 32, "first_k_dense_replace": 1,
                              **overrides}), GlmMoeDsaForCausalLM


def qwen3_5_proxy(**overrides):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    layers = overrides.pop("num_hidden_layers", 4)
    types = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4) + ["linear_attention"] * (layers % 4)
    return Qwen3_5MoeTextConfig(**{"num_hidden_layers": layers, "layer_types": types, "num_experts": 64,
                                   **overrides}), Qwen3_5MoeForCausalLM


PROXIES = {"glm5": glm5_proxy, "qwen3_5": qwen3_5_proxy}


def build(model: str, dtype, device="cuda", **overrides):
    """(transformers' model, v4train's CausalLM on the same parameter tensors, v4train's config);
    `overrides` change the proxy's config (a small one for the CPU test of this script)."""
    hf_cfg, cls = PROXIES[model](**overrides)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(device):
        hf = cls(hf_cfg)
    torch.set_default_dtype(default)
    hf.train()
    config = hf_cfg.to_dict()
    ours_cfg = config_from_dict(config, "the proxy's config")
    # v4train's model on transformers' own tensors: the same names, no copy.
    tensors = dict(hf.named_parameters())
    tensors.update({n: b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")})
    ours = CausalLM(ours_cfg, {n: tensors[n] for n in CausalLM.empty(ours_cfg, {}).weights()}, config)
    for n, p in ours.named_parameters():
        p.requires_grad_(not ours.family.is_frozen(n))
    return hf, ours, ours_cfg


# Each family's released FP8 checkpoint (its config in testdata/released): the FP8 proxies quantise the
# layers' linear maps it quantises and keep the ones its modules_to_not_convert names (GLM-5's indexer
# weights_proj; Qwen3.5's in_proj_b and in_proj_a) as the bf16 twin has them.
RELEASED_FP8 = {"glm5": "GLM-5-FP8", "qwen3_5": "Qwen3.5-397B-A17B-FP8"}


def fp8_map_names(cfg) -> set[str]:
    """The layers' linear maps of cfg that its family's released FP8 checkpoint holds in FP8."""
    with open(os.path.join(ROOT, "testdata", "released", RELEASED_FP8[cfg.family], "config.json")) as f:
        q = fp8_config(json.load(f))
    return {n for n in linear_map_names(cfg) if not not_converted(n, q)}


def fp8_pair(hf, cfg, rank: int) -> tuple[CausalLM, CausalLM]:
    """(the model dequantised to bf16, the model kept in FP8), both with the same LoRA adapters of
    `rank` on attention and experts and every other weight frozen. The layers' linear maps that the
    released checkpoint quantises (fp8_map_names) are quantised in 128 x 128 blocks, and hf's own
    weights become their FP8 round trip in place, so that both models (and transformers) hold the
    same values."""
    tensors = dict(hf.named_parameters())
    tensors.update({n: b for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")})
    fp8 = {}
    with torch.no_grad():
        for name in sorted(fp8_map_names(cfg) & tensors.keys()):  # (the names of every kind of layer)
            q, scale = quantize_fp8(tensors[name])
            tensors[name].copy_(dequantize_fp8(q, scale, tensors[name].dtype))
            fp8[name], fp8[scale_name(name)] = q, scale
    base = {n: tensors[n] for n in CausalLM.empty(cfg, {}).weights()}
    config = hf.config.to_dict()
    models = CausalLM(cfg, base, config), CausalLM(cfg, {**base, **fp8}, config)
    for model in models:
        add_lora(model, rank)
    return models


def add_lora(model: CausalLM, rank: int) -> None:
    """LoRA of `rank` (alpha 2 rank) on attention and experts; every other weight frozen."""
    lcfg = LoraConfig(r=rank, alpha=2 * rank, dropout=0.0, target_modules=expand_targets(model, ["attention"]),
                      experts=True)
    embedding = model.weights()["model.embed_tokens.weight"]  # (never FP8)
    adapters = add_adapters(model, lcfg, embedding.dtype, embedding.device, seed=0)
    for n, p in model.named_parameters():
        p.requires_grad_(n in adapters)


def random_fp8_model(cfg, config: dict, device) -> CausalLM:
    """`cfg`'s model with random weights drawn on `device`: the layers' linear maps that the released
    checkpoint quantises (fp8_map_names) N(0, 0.02) quantised in 128 x 128 blocks (8 experts at a
    time: fp32 temporaries), the rest bf16 (fp32 where the family keeps it so)."""
    gen = torch.Generator(device).manual_seed(0)
    normal = lambda shape: torch.empty(shape, device=device).normal_(0.0, 0.02, generator=gen)  # noqa: E731
    fp8_names, tensors = fp8_map_names(cfg), {}
    for spec in all_specs(cfg):
        if spec.name in fp8_names:
            if len(spec.shape) == 3:  # [E, out, in]
                parts = [quantize_fp8(normal((min(8, spec.shape[0] - e), *spec.shape[1:])))
                         for e in range(0, spec.shape[0], 8)]
                q, scale = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            else:
                q, scale = quantize_fp8(normal(spec.shape))
            tensors[spec.name], tensors[scale_name(spec.name)] = q, scale
            continue
        if spec.init == "normal":
            t = normal(spec.shape)
        else:
            t = {"ones": torch.ones, "zeros": torch.zeros}[spec.init](spec.shape, device=device)
        tensors[spec.name] = t.to(torch.float32 if spec.fp32 else torch.bfloat16)
    return CausalLM(cfg, tensors, config)


def full_layer_config() -> dict:
    """--full_layer's model: GlmMoeDsaConfig's defaults (GLM-5's widths) with one MoE layer."""
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(num_hidden_layers=1, first_k_dense_replace=0).to_dict()


def full_layer(args, table) -> list[dict]:
    """The --full_layer mode: GLM-5's decoder layer at full size in FP8, with LoRA."""
    config = full_layer_config()
    cfg = config_from_dict(config, "GlmMoeDsaConfig's defaults")
    model = random_fp8_model(cfg, config, "cuda")
    add_lora(model, args.lora_rank)
    model.use_ops(table)
    size, dtypes = weight_bytes(model)
    layer = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("model.layers.0."))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; GLM-5 at full width, 1 decoder layer "
          f"({cfg.n_routed_experts} experts of {cfg.moe_intermediate_size}, top-{cfg.num_experts_per_tok}), FP8, LoRA "
          f"r={args.lora_rank}: frozen weights {size / GIB:.2f} GiB {dtypes}, the layer's own {layer / GIB:.2f} GiB "
          f"(with its adapters); allocated {torch.cuda.memory_allocated() / GIB:.2f} GiB", flush=True)
    print("| tokens | checkpointing | step s | tokens/s | peak GiB above weights |")
    print("|---|---|---|---|---|")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        batch = random_batch(cfg.vocab_size, tokens)
        model.checkpointing = {"on": True, "off": False, "auto": tokens >= 16384}[args.checkpointing]
        row = {"tokens": tokens, "checkpointing": model.checkpointing, "weight_bytes": size, "layer_bytes": layer}
        try:
            seconds, peak = timed_steps(backward_step(model, batch), args.warmup, args.steps)
            row.update(step_s=seconds, peak_gib=peak / GIB)
            print(f"| {tokens} | {model.checkpointing} | {seconds:.3f} | {tokens / seconds:,.0f} | {peak / GIB:.1f} |",
                  flush=True)
        except torch.OutOfMemoryError:
            row["oom"] = True
            print(f"| {tokens} | {model.checkpointing} | out of memory | - | - |", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        rows.append(row)
    return rows


def weight_bytes(model) -> tuple[int, dict[str, int]]:
    """(bytes of the frozen weights, their count per dtype), each storage once."""
    storages, dtypes = {}, collections.Counter()
    for p in model.parameters():
        if not p.requires_grad:
            storages[p.data_ptr()] = p.numel() * p.element_size()
            dtypes[str(p.dtype).removeprefix("torch.")] += 1
    return sum(storages.values()), dict(dtypes)


def fp8_main(args, hf, cfg, table) -> list[dict]:
    """The FP8 model against its dequantised bf16 twin at each length (the --fp8 mode)."""
    models = dict(zip(("bf16", "fp8"), fp8_pair(hf, cfg, args.lora_rank)))
    gc.collect()
    torch.cuda.empty_cache()
    for model in models.values():
        model.use_ops(table)
    sizes = {k: weight_bytes(m) for k, m in models.items()}
    for k, (size, dtypes) in sizes.items():
        print(f"{k}: frozen weights {size / GIB:.2f} GiB {dtypes}")
    print(f"FP8 weight bytes / bf16: {sizes['fp8'][0] / sizes['bf16'][0]:.3f}")
    print("| weights | tokens | checkpointing | LoRA step s | tokens/s | peak GiB above weights | "
          f"loss at step 1 | loss after {args.train_steps} steps |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    # The FP8 model once per V4TRAIN_FP8_TENSOR_CORES value (lora.h: read at each product).
    runs = [("bf16", None)] + [("fp8", v) for v in args.fp8_tensor_cores]
    e4m3_variants = os.environ.get("V4TRAIN_FP8_E4M3_VARIANTS", "")  # for a run that names none
    for tokens in (int(t) for t in args.tokens.split(",")):
        batch = random_batch(cfg.vocab_size, tokens)
        ckpt = {"on": True, "off": False, "auto": tokens >= 16384}[args.checkpointing]
        for weights, switch in runs:
            model = models[weights]
            model.checkpointing = ckpt
            kind = weights
            if switch is not None:
                os.environ["V4TRAIN_FP8_TENSOR_CORES"], at, variants = switch.partition("@")
                os.environ["V4TRAIN_FP8_E4M3_VARIANTS"] = variants if at else e4m3_variants
                kind = f"fp8 ({switch})" if len(runs) > 2 else weights
            row = {"weights": kind, "tokens": tokens, "checkpointing": ckpt, "weight_bytes": sizes[weights][0]}
            try:
                seconds, peak = timed_steps(backward_step(model, batch), args.warmup, args.steps)
                trained = [p for p in model.parameters() if p.requires_grad]
                start = [p.detach().clone() for p in trained]
                losses = train_adapters(model, batch, args.train_steps, args.lr)
                with torch.no_grad():  # the adapters as they were, for the next length
                    for p, p0 in zip(trained, start):
                        p.copy_(p0)
                row.update(step_s=seconds, tokens_per_s=tokens / seconds, peak_gib=peak / GIB, first_loss=losses[0],
                           last_loss=losses[-1])
                print(f"| {kind} | {tokens} | {ckpt} | {seconds:.3f} | {tokens / seconds:,.0f} | {peak / GIB:.1f} | "
                      f"{losses[0]:.5f} | {losses[-1]:.5f} |", flush=True)
            except torch.OutOfMemoryError:
                row["oom"] = True
                print(f"| {kind} | {tokens} | {ckpt} | out of memory | - | - | - | - |", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
            rows.append(row)
        done = {r["weights"]: r for r in rows if r["tokens"] == tokens and "step_s" in r}
        for kind, f in done.items():
            if kind != "bf16" and "bf16" in done:
                b = done["bf16"]
                print(f"at {tokens} tokens: {kind} step {f['tokens_per_s'] / b['tokens_per_s']:.3f}x bf16's tokens/s; "
                      f"loss after {args.train_steps} steps differs by "
                      f"{abs(f['last_loss'] - b['last_loss']) / b['last_loss']:.2e} (relative)")
        if args.profile:  # both: the kernels of the FP8 model against those of its bf16 twin
            times = {}
            for kind, model in models.items():
                model.checkpointing = ckpt
                print(f"{kind} model at {tokens} tokens, forward ms per op (one step):",
                      {k: round(v, 2) for k, v in per_op_times(model, batch).items()})
                table, times[kind] = profile(model, batch)
                print(table)
            for kind in times.keys() - {"bf16"}:
                print(f"at {tokens} tokens, one step's kernels, {kind} against bf16:")
                print(kernel_diff(times["bf16"], times[kind], ("bf16", kind)))
    return rows


def train_adapters(model: CausalLM, batch: Packed, steps: int, lr: float) -> list[float]:
    """`steps` AdamW steps (no weight decay) of model's trainable parameters on batch: the loss
    before each."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        loss = model.loss(batch, batch.num_targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def active_params(cfg) -> int:
    """Parameters one token multiplies with (experts: top-k of them); embeddings excluded."""
    from v4train.model import all_specs

    total = 0
    for s in all_specs(cfg):
        n = 1
        for d in s.shape:
            n *= d
        if s.name == "model.embed_tokens.weight" or "indexer" in s.name:
            continue
        if s.experts:
            n = n // s.shape[0] * cfg.num_experts_per_tok
        total += n
    return total


def random_batch(vocab_size: int, tokens: int) -> Packed:
    """One sequence of `tokens` random ids on the GPU, seeded by its length."""
    ids = torch.randint(0, vocab_size, (1, tokens), generator=torch.Generator().manual_seed(tokens)).cuda()
    return Packed.from_rows(ids)


def backward_step(model: CausalLM, batch: Packed):
    """step(): forward + backward of model's loss on batch, its gradients dropped after."""
    def step():
        model.loss(batch, batch.num_targets).backward()
        zero_grads(model)
    return step


def timed_steps(step, warmup: int, steps: int) -> tuple[float, float]:
    """(median seconds, peak bytes above the start) of step() on CUDA."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def exact_loss(hf, ids) -> float:
    """transformers' loss on a float64 copy of its weights (the answer both bf16 runs round)."""
    import copy

    hf64 = copy.deepcopy(hf).double()
    hf64.set_experts_implementation("eager")  # torch._grouped_mm has no float64
    with torch.no_grad():
        loss = hf64(input_ids=ids, labels=ids).loss.item()
    del hf64
    gc.collect()
    torch.cuda.empty_cache()
    return loss


def zero_grads(model):
    for p in model.parameters():
        p.grad = None


def per_op_times(model, batch) -> dict[str, float]:
    """Forward milliseconds per op over one forward+backward (CUDA events around each call)."""
    times = collections.defaultdict(float)

    def wrap(name, fn, is_cpp):
        def call(*args, **kwargs):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = fn(*args, **kwargs)
            e.record()
            torch.cuda.synchronize()
            times[name] += s.elapsed_time(e)
            return out
        return call

    table = model.ops
    model.use_ops(ops.OpTable(table.ops, table.cpp, wrap=wrap))
    try:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = model.loss(batch, batch.num_targets)
        mid = torch.cuda.Event(enable_timing=True)
        mid.record()
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        times["(backward of the whole step)"] = mid.elapsed_time(end)
    finally:
        model.use_ops(table)
        zero_grads(model)
    return dict(times)


def peak_breakdown(trace: list[dict], tokens: int, top: int = 12) -> tuple[int, list[dict]]:
    """(bytes at the peak above the start, the groups of blocks alive then, largest first) from one
    device's trace of the caching allocator (torch.cuda.memory._snapshot()["device_traces"][i]).
    Replaying alloc and free_completed in order gives the bytes in use after every event; the peak
    is the largest. Blocks allocated before the recording started are the base and are not named;
    their frees count, so the sum is relative to the start. A group is the Python line that
    allocated (innermost frame in the repository; "(autograd backward)" for the engine's thread,
    which has no Python frames) and the block's size; bytes per token tells [T, width] tensors
    apart (2 x width for bf16, 4 x width for fp32)."""
    def replay(stop):
        alive, used, peak, at = {}, 0, 0, -1
        for i, e in enumerate(trace[:stop]):
            if e["action"] == "alloc":
                alive[e["addr"]] = e
                used += e["size"]
            elif e["action"] == "free_completed":
                alive.pop(e["addr"], None)
                used -= e["size"]
            if used > peak:
                peak, at = used, i
        return alive, peak, at

    _, peak, at = replay(len(trace))
    alive, _, _ = replay(at + 1)
    groups = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    for e in alive.values():
        frames = [f for f in e.get("frames", []) if "v4train" in f["filename"] or "/tools/" in f["filename"]]
        where = (f"{os.path.basename(frames[0]['filename'])}:{frames[0]['line']} {frames[0]['name']}"
                 if frames else "(autograd backward)")
        g = groups[(where, e["size"])]
        g["count"] += 1
        g["bytes"] += e["size"]
    rows = [{"where": w, "block_bytes": size, "bytes_per_token": size / tokens, **g} for (w, size), g in groups.items()]
    return peak, sorted(rows, key=lambda r: -r["bytes"])[:top]


def memory_at_peak(step, tokens: int) -> str:
    """One step() with the allocator's history recorded: what is alive at its peak (peak_breakdown)."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=2_000_000)
    try:
        step()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, rows = peak_breakdown(trace, tokens)
    lines = [f"{peak / GIB:.2f} GiB above the step's start at its peak; the largest groups alive then:",
             "| where allocated | blocks | block MiB | bytes per token | GiB |", "|---|---|---|---|---|"]
    lines += [f"| {r['where']} | {r['count']} | {r['block_bytes'] / 2**20:.1f} | {r['bytes_per_token']:,.0f} | "
              f"{r['bytes'] / GIB:.2f} |" for r in rows]
    return "\n".join(lines)


def profile(model, batch, top: int = 25) -> tuple[str, dict[str, float]]:
    """One step's top CUDA kernels, then the ATen ops (with their input shapes) that launched the
    most device time (which op an elementwise kernel belongs to); and each kernel's device ms by
    kernel_name (for kernel_diff)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        model.loss(batch, batch.num_targets).backward()
        torch.cuda.synchronize()
    zero_grads(model)
    kernels = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top)
    ops = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cuda_time_total", row_limit=top + 15, max_name_column_width=40, max_shapes_column_width=70)
    times: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:  # a kernel, copy or fill on the device: its span
            times[kernel_name(e.name)] = times.get(kernel_name(e.name), 0.0) + e.time_range.elapsed_us() / 1e3
    return kernels + "\nATen ops by the device time of the kernels they launched:\n" + ops, times


def kernel_name(name: str) -> str:
    """A kernel's name without its return type, anonymous namespaces, template arguments and
    parameters (the variants of one kernel, and the profiler's truncations, as one)."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    return re.split(r"[<(]", name, maxsplit=1)[0][:80]


def kernel_diff(base: dict[str, float], other: dict[str, float], names: tuple[str, str], top: int = 15) -> str:
    """The kernels whose device ms differ most between two profiled steps (by the size of the
    difference), then all kernels' sums: where one model's step spends time the other does not."""
    rows = sorted(base.keys() | other.keys(), key=lambda k: (-abs(other.get(k, 0.0) - base.get(k, 0.0)), k))
    lines = [f"| kernel | {names[0]} ms | {names[1]} ms | difference |", "|---|---|---|---|"]
    for k in rows[:top]:
        b, o = base.get(k, 0.0), other.get(k, 0.0)
        lines.append(f"| {k} | {b:.2f} | {o:.2f} | {o - b:+.2f} |")
    b, o = sum(base.values()), sum(other.values())
    lines.append(f"| all kernels | {b:.2f} | {o:.2f} | {o - b:+.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="glm5", choices=sorted(PROXIES))
    parser.add_argument("--tokens", default="4096,16384,65536")
    parser.add_argument("--impls", default="transformers,v4train")
    parser.add_argument("--cpp_ops", default="all", help="v4train's --cpp_ops: the ops that run in C++ (the rest on the reference)")
    parser.add_argument("--checkpointing", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="per-op times, kernel table and FLOP share at every length")
    parser.add_argument("--memory", action="store_true",
                        help="for v4train at every length, the blocks alive at the step's peak, grouped by where they were allocated")
    parser.add_argument("--exact", action="store_true",
                        help="also the loss in float64 (transformers on the same weights) up to 8,192 tokens: which side rounds less")
    parser.add_argument("--fp8", action="store_true", help="the FP8 model against its dequantised bf16 twin, LoRA")
    parser.add_argument("--fp8_tensor_cores", nargs="+", default=[os.environ.get("V4TRAIN_FP8_TENSOR_CORES", "none")],
                        help="--fp8: time the FP8 model under each of these V4TRAIN_FP8_TENSOR_CORES values "
                             "(e.g. none experts experts,dense_backward), side by side in one process; "
                             "VALUE@VARIANTS also sets V4TRAIN_FP8_E4M3_VARIANTS")
    parser.add_argument("--full_layer", action="store_true", help="one GLM-5 decoder layer at full size, FP8, LoRA")
    parser.add_argument("--lora_rank", type=int, default=16)
    parser.add_argument("--train_steps", type=int, default=50, help="--fp8: AdamW steps of each model on one batch")
    parser.add_argument("--lr", type=float, default=1e-4, help="--fp8: the adapters' learning rate (1e-3 drives both losses to 0 on one batch)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    dtype = torch.bfloat16
    table = ops.resolve(args.cpp_ops)
    if args.full_layer:
        rows = full_layer(args, table)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "time": time.time()}, f, indent=1)
        return 0
    hf, ours, cfg = build(args.model, dtype)
    if args.fp8:
        del ours
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.model} proxy, FP8 against bf16, "
              f"LoRA r={args.lora_rank} on attention and experts; C++ ops: {sorted(table.cpp)}", flush=True)
        rows = fp8_main(args, hf, cfg, table)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "time": time.time()}, f, indent=1)
        return 0
    ours.use_ops(table)
    weights_gib = torch.cuda.memory_allocated() / GIB
    flops_per_token = 6 * active_params(cfg)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers "
          f"{__import__('transformers').__version__}; {args.model} proxy, weights {weights_gib:.1f} GiB, "
          f"{flops_per_token / 1e9:.1f} GFLOP per token (6 x active parameters); C++ ops: {sorted(ours.ops.cpp)}",
          flush=True)
    print("| impl | tokens | checkpointing | step s | tokens/s | peak GiB above weights | TFLOP/s | loss |")
    print("|---|---|---|---|---|---|---|---|")
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        gen = torch.Generator().manual_seed(tokens)
        ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=gen).cuda()
        batch = Packed.from_rows(ids)
        losses = {}
        for impl in args.impls.split(","):
            ckpt = {"on": True, "off": False, "auto": impl == "v4train" and tokens >= 16384}[args.checkpointing]
            if impl == "transformers":
                if ckpt:
                    hf.gradient_checkpointing_enable({"use_reentrant": False})
                else:
                    hf.gradient_checkpointing_disable()

                def step():
                    loss = hf(input_ids=ids, labels=ids).loss
                    loss.backward()
                    losses[impl] = loss.item()
                    zero_grads(hf)
            else:
                ours.checkpointing = ckpt

                def step():
                    loss = ours.loss(batch, batch.num_targets)
                    loss.backward()
                    losses[impl] = loss.item()
                    zero_grads(ours)
            row = {"impl": impl, "tokens": tokens, "checkpointing": ckpt}
            try:
                seconds, peak = timed_steps(step, args.warmup, args.steps)
                row.update(step_s=seconds, tokens_per_s=tokens / seconds, peak_gib=peak / GIB,
                           tflops=flops_per_token * tokens / seconds / 1e12, loss=losses[impl])
                print(f"| {impl} | {tokens} | {ckpt} | {seconds:.3f} | {tokens / seconds:,.0f} | {peak / GIB:.1f} | "
                      f"{row['tflops']:.0f} | {losses[impl]:.5f} |", flush=True)
            except torch.OutOfMemoryError:
                row["oom"] = True
                print(f"| {impl} | {tokens} | {ckpt} | out of memory | - | - | - | - |", flush=True)
            except RuntimeError as e:  # reported, and the other rows still run
                row["error"] = str(e)[:2000]
                print(f"| {impl} | {tokens} | {ckpt} | error: {str(e).splitlines()[0][:200]} | - | - | - | - |", flush=True)
            if args.memory and impl == "v4train" and "step_s" in row:
                print(f"v4train at {tokens} tokens, checkpointing {ckpt}: " + memory_at_peak(step, tokens), flush=True)
            zero_grads(hf)
            gc.collect()
            torch.cuda.empty_cache()
            results.append(row)
        if len(losses) == 2:
            print(f"loss difference at {tokens} tokens: {abs(losses['transformers'] - losses['v4train']):.2e}")
        if args.exact and tokens <= 8192:  # transformers in float64 runs out of memory beyond
            exact = exact_loss(hf, ids)
            print(f"loss in float64 at {tokens} tokens: {exact:.6f}; distance of " +
                  ", ".join(f"{impl} {abs(loss - exact):.2e}" for impl, loss in losses.items()))
        if args.profile and "v4train" in args.impls:
            ours.checkpointing = {"on": True, "off": False, "auto": tokens >= 16384}[args.checkpointing]
            print(f"v4train at {tokens} tokens, forward ms per op (one step):",
                  {k: round(v, 2) for k, v in per_op_times(ours, batch).items()})
            # The layer split: the layers composed from the same C++ ops, each sub-op timed.
            layer_ops = {n for n in table.cpp if n.endswith("_layer_forward")}
            ours.use_ops(ops.OpTable(table.ops, table.cpp - layer_ops))
            print(f"v4train at {tokens} tokens, forward ms per sub-op of the layers (composed from the C++ ops):",
                  {k: round(v, 2) for k, v in per_op_times(ours, batch).items()})
            ours.use_ops(table)
            with FlopShare(ours.ops) as share:
                ours.use_ops(share.table)
                ours.loss(batch, batch.num_targets).backward()
            ours.use_ops(table)
            zero_grads(ours)
            s = share.summary()
            print(f"FLOP share in C++ ops: {100 * s['cpp_share']:.2f}% of {s['total'] / 1e12:.1f} TFLOP")
            print(profile(ours, batch)[0])
            gc.collect()
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": results, "time": time.time()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
