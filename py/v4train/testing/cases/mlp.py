"""v4_mlp: the SwiGLU MLP (dense layers, shared experts), LoRA inside."""

import torch

from v4train.ops import OPS
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import Sample, layout, make_leaf, seed, size, view_as_layout, weight_leaves, width
from v4train.reference.lora import bind
from v4train.reference.mlp import MlpWeights


def samples(draw, dtype: torch.dtype, device) -> Sample:
    tokens, hidden, inter = size(draw, 70), width(draw, 40, dtype), width(draw, 40, dtype)
    prefix = draw.sampled_from(["mlp.", "mlp.shared_experts."])
    x_layout, s = layout(draw), seed(draw)
    weights, scaling = weight_leaves(draw, {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight":
                                            (inter, hidden), prefix + "down_proj.weight": (hidden, inter)}, dtype, device, s)
    leaves = {"x": make_leaf((tokens, hidden), x_layout, dtype, device, s + 100), **weights}

    def build(lv):
        return (view_as_layout(lv["x"], x_layout), bind(MlpWeights, lv, prefix), scaling, 0.0), {}

    return Sample(leaves, build, note=f"x layout {x_layout}, adapters {sorted(k for k in weights if 'lora' in k)}")


def _weights(H=8, I=12, **replaced):
    """MlpWeights of zeros, with the tensors named in `replaced` ({"up_proj.weight": t}) replaced."""
    w = {"gate_proj.weight": torch.zeros(I, H), "up_proj.weight": torch.zeros(I, H), "down_proj.weight": torch.zeros(H, I)}
    return bind(MlpWeights, {**w, **replaced})


def _bench(device, dtype):
    """GLM-5's dense MLP (and, at intermediate 2048, its shared expert) on 4096 tokens."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: (0.02 * torch.randn(*s, generator=g)).to(device=device, dtype=dtype).requires_grad_()  # noqa: E731
    w = bind(MlpWeights, {"gate_proj.weight": r(12288, 6144), "up_proj.weight": r(12288, 6144),
                          "down_proj.weight": r(6144, 12288)})
    return "x [4096, 6144], intermediate 12288", (r(4096, 6144), w, 0.0, 0.0)


CASE = OpCase(
    OPS["v4_mlp"], samples=samples, benchmarks=(_bench,),
    errors=(
        ErrorCase("a weight on another device", lambda: (torch.zeros(3, 8), _weights(**{"up_proj.weight": torch.zeros(
            12, 8, device="meta")}), 0.0, 0.0), "weights.up_proj.weight is on meta but the input is on cpu"),
        ErrorCase("a weight of the wrong width", lambda: (torch.zeros(3, 8), _weights(**{"up_proj.weight": torch.zeros(
            12, 7)}), 0.0, 0.0), "up_proj.weight has shape [12, 7], expected [out, 8]"),
        ErrorCase("an adapter of the wrong shape",
                  lambda: (torch.zeros(3, 8), _weights(**{"up_proj.lora_A": torch.zeros(2, 8),
                                                          "up_proj.lora_B": torch.zeros(11, 2)}), 1.0, 0.0),
                  "the adapter of up_proj [12, 8] has A [2, 8] and B [11, 2]"),
        ErrorCase("FP8 scales of the wrong shape", lambda: (torch.zeros(3, 8), _weights(**{
            "up_proj.weight": torch.zeros(12, 8, dtype=torch.float8_e4m3fn), "up_proj.weight_scale_inv": torch.ones(2, 1)}),
            0.0, 0.0), "up_proj.weight_scale_inv has shape [2, 1], expected one scale per 128x128 block"),
        ErrorCase("an FP8 weight that requires a gradient", lambda: (torch.zeros(3, 8), _weights(**{
            "up_proj.weight": torch.zeros(12, 8, dtype=torch.float8_e4m3fn).requires_grad_(),
            "up_proj.weight_scale_inv": torch.ones(1, 1)}), 0.0, 0.0), "an FP8 base is frozen"),
        ErrorCase("3-D x", lambda: (torch.zeros(2, 3, 8), _weights(), 0.0, 0.0), "x must have 2 dimension(s)"),
        ErrorCase("integer x", lambda: (torch.zeros(3, 8, dtype=torch.int64), _weights(), 0.0, 0.0),
                  "x must be float32, bfloat16, float16 or float64"),
    ),
)
