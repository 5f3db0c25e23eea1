"""What FP8 activations would do to issue 16's loss target, before a kernel is built for them.

    PYTHONPATH=py:. python3 tools/fp8_activation_probe.py              # a small GLM-5 proxy on the CPU
    PYTHONPATH=py:. python3 tools/fp8_activation_probe.py --full_proxy # bench_model's GLM-5 proxy (GPU)

bench_model.py --fp8's GLM-5 pair (the same FP8 base, the same LoRA adapters), trained --steps AdamW
steps on one batch as bench_model does, on the reference path, with the FP8 model's products
emulating an FP8 x FP8 kernel: the activation rounded to e4m3 in 1 x 128 blocks (scale amax / 448,
as cc/common/fp8.cu's quantize_rows_kernel does) before the product with the dequantised weight,
and, where asked, the backward's dy likewise before dy W. Variants:
- none: the dequantised products (the FP8 model's loss equals the bf16 twin's: the check);
- experts_fwd, experts_fwd_bwd: the routed experts' products alone (DeepGEMM's design: the only
  products that an experts kernel of FP8 x FP8 would change);
- dense_fwd: the forward of every FP8 dense map of whole 128 x 128 blocks through the layers' `linear`
  (what V4TRAIN_FP8_TENSOR_CORES=dense_forward does on CUDA: 6.4e-2 on the GLM-5 proxy on the H200,
  docs/benchmarks.md), a rough calibration against the GPU's measurement: CUDA also rounds the
  indexer's wq_b and wk, whose reference products (F.linear on dense_weight) the probe leaves alone;
- dense_bwd: those maps' backward alone (dy rounded before dy W; the forward exact), what a dense
  backward on FP8 tensor cores (the experts' transposing kernel as one expert) would change.
Prints, per variant, the loss after --steps and its relative distance from none's (the target: 1%).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "py"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_model import build, fp8_pair, train_adapters  # noqa: E402
from v4train import ops  # noqa: E402
from v4train.model import Packed  # noqa: E402
from v4train.models.glm5 import attention as glm5_attention  # noqa: E402
from v4train.reference import lora as ref_lora, mlp as ref_mlp, moe as ref_moe  # noqa: E402

E4M3_MAX, BLOCK = 448.0, 128
# A GLM-5 proxy small enough for two CPU cores: every width a multiple of the 128 blocks where the
# released model's are (hidden, q_lora_rank, the experts'), 4 layers (1 dense + 3 MoE).
SMALL = dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=256, kv_lora_rank=128,
             qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, index_n_heads=4, index_head_dim=64,
             index_topk=128, intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=16,
             num_experts_per_tok=4, n_group=1, topk_group=1, vocab_size=4096)


def e4m3_rows(t: torch.Tensor) -> torch.Tensor:
    """t rounded to e4m3 in blocks of 128 along its last dimension, each block scaled by amax / 448
    (1 for an all-zero block), and back to t's dtype."""
    k = t.shape[-1]
    x = F.pad(t.float(), (0, -k % BLOCK)).unflatten(-1, (-1, BLOCK))
    amax = x.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).clamp_min(torch.finfo(torch.float32).tiny)
    return ((x / s).to(torch.float8_e4m3fn).float() * s).flatten(-2)[..., :k].to(t.dtype)


class E4m3Product(torch.autograd.Function):
    """x W^T with x rounded by e4m3_rows where `forward`; its gradient dy W, dy rounded so where
    `backward`. W is a frozen base (no gradient)."""

    @staticmethod
    def forward(ctx, x, weight, forward: bool, backward: bool):
        ctx.save_for_backward(weight)
        ctx.backward = backward
        return F.linear(e4m3_rows(x) if forward else x, weight)

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        return (e4m3_rows(dy) if ctx.backward else dy) @ weight, None, None, None


VARIANTS = ("none", "experts_fwd", "experts_fwd_bwd", "dense_fwd", "dense_bwd")


def emulate(variant: str):
    """Patch the reference's products for `variant` (see the module's docstring); 'none' restores them."""
    for module in (glm5_attention, ref_mlp, ref_lora):
        module.linear = _linear[0]
    ref_moe._grouped = _grouped[0]
    if variant.startswith("dense"):
        forward = variant == "dense_fwd"

        def linear(x, w, lora):  # (whole 128 x 128 blocks only, as cc/common/fp8.cu's fp8_linear)
            if w.weight_scale_inv is None or w.weight.shape[-1] % BLOCK or w.weight.shape[-2] % BLOCK:
                return _linear[0](x, w, lora)
            y = E4m3Product.apply(x, ref_lora.dense_weight(w, x.dtype), forward, not forward)
            return y + ref_lora._update(x, lora, w.lora_A, w.lora_B) if w.lora_A is not None else y
        for module in (glm5_attention, ref_mlp, ref_lora):
            module.linear = linear
    elif variant.startswith("experts"):
        backward_too = variant == "experts_fwd_bwd"

        def grouped(rows, w, counts, lora):
            if w.weight_scale_inv is None or sum(counts) == 0:
                return _grouped[0](rows, w, counts, lora)
            weight = ref_lora.dense_weight(w, rows.dtype)
            outs, start = [], 0
            for e, n in enumerate(counts):
                if n:
                    x = rows[start:start + n]
                    y = E4m3Product.apply(x, weight[e], True, backward_too)
                    if w.lora_A is not None:
                        y = y + F.linear(F.linear(x, w.lora_A[e]), w.lora_B[e]) * lora.scaling
                    outs.append(y)
                start += n
            return torch.cat(outs)
        ref_moe._grouped = grouped


_linear, _grouped = [ref_lora.linear], [ref_moe._grouped]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full_proxy", action="store_true", help="bench_model's GLM-5 proxy (hidden 6144; a GPU)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-4, help="bench_model --fp8's")
    parser.add_argument("--lora_rank", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", help="the model's (float32: bf16's products are slow on a CPU)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: {', '.join(sorted(unknown))} unknown; expected some of {', '.join(VARIANTS)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(os.cpu_count() or 1)
    dtype = getattr(torch, args.dtype)
    hf, _, cfg = build("glm5", dtype, device, **({} if args.full_proxy else SMALL))
    _, model = fp8_pair(hf, cfg, args.lora_rank)
    del hf
    model.use_ops(ops.resolve("none"))  # the reference path, whose products the variants patch
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(args.tokens))
    batch = Packed.from_rows(ids.to(device))
    trained = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in trained]
    print(f"GLM-5 proxy ({'full' if args.full_proxy else 'small'}), {device}, {args.dtype}, {args.tokens} tokens, "
          f"LoRA r={args.lora_rank}, {args.steps} AdamW steps at lr {args.lr}")
    print("| variant | loss at step 1 | loss after the steps | relative to none |")
    print("|---|---|---|---|")
    try:
        run_variants(args, model, batch, trained, start)
    finally:
        emulate("none")


def run_variants(args, model, batch, trained, start) -> None:
    """Each variant's training from the same adapters, printed as a row."""
    base = None
    for variant in args.variants.split(","):
        with torch.no_grad():
            for p, p0 in zip(trained, start):
                p.copy_(p0)
        emulate(variant)
        losses = train_adapters(model, batch, args.steps, args.lr)
        with torch.no_grad():
            last = model.loss(batch, batch.num_targets).item()  # the trained adapters' loss
        base = last if variant == "none" else base
        rel = f"{abs(last - base) / base:.2e}" if base is not None else "-"
        print(f"| {variant} | {losses[0]:.5f} | {last:.5f} | {rel} |", flush=True)


if __name__ == "__main__":
    main()
