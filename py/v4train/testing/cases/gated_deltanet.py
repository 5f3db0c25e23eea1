"""v4_gated_deltanet: Qwen3.5's Gated DeltaNet block (projections, conv, delta rule, gated norm, out_proj)."""

import torch

from v4train.testing.cases.gated_delta_rule import chunk_documents
from v4train.testing.cases.mla_dsa_attention import packed
from v4train.models.qwen3_5.deltanet import GatedDeltaNetWeights
from v4train.ops import OPS
from v4train.reference.lora import bind
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import RandomDraw, Sample, layout, make_leaf, seed, view_as_layout, weight_leaves, width
from v4train.models.qwen3_5.deltanet import v4_gated_deltanet


def block_leaves(draw, hidden: int, nk: int, nv: int, dk: int, dv: int, kernel: int, dtype, device, s: int):
    """The block's tensors as a transformers layer names them (A_log and dt_bias in float32, as
    transformers keeps them, float64 in float64), LoRA on a drawn subset of the projections."""
    kd, vd = nk * dk, nv * dv
    weights, scaling = weight_leaves(draw, {
        "linear_attn.in_proj_qkv.weight": (2 * kd + vd, hidden), "linear_attn.in_proj_z.weight": (vd, hidden),
        "linear_attn.in_proj_b.weight": (nv, hidden), "linear_attn.in_proj_a.weight": (nv, hidden),
        "linear_attn.out_proj.weight": (hidden, vd)}, dtype, device, s)
    fp32 = torch.float64 if dtype == torch.float64 else torch.float32
    weights["linear_attn.conv1d.weight"] = make_leaf((2 * kd + vd, 1, kernel), "contiguous", dtype, device, s + 60, 0.5)
    weights["linear_attn.A_log"] = make_leaf((nv,), "contiguous", fp32, device, s + 61, 0.5)
    weights["linear_attn.dt_bias"] = make_leaf((nv,), "contiguous", fp32, device, s + 62, 0.5, 1.0)
    weights["linear_attn.norm.weight"] = make_leaf((dv,), "contiguous", dtype, device, s + 63, 0.2, 1.0)
    return weights, scaling


def samples(draw, dtype: torch.dtype, device) -> Sample:
    lengths = chunk_documents(draw)
    nk = draw.integers(1, 2)
    nv = nk * draw.sampled_from([1, 2])
    hidden, dk, dv = width(draw, 24, dtype), width(draw, 12, dtype), width(draw, 12, dtype)
    h_layout, s = layout(draw), seed(draw)
    weights, scaling = block_leaves(draw, hidden, nk, nv, dk, dv, draw.integers(2, 4), dtype, device, s)
    _, cu = packed(lengths, device)
    leaves = {"h": make_leaf((sum(lengths), hidden), h_layout, dtype, device, s + 100), **weights}

    def build(lv):
        return (view_as_layout(lv["h"], h_layout), bind(GatedDeltaNetWeights, lv, "linear_attn."), nk, nv, dk, dv, 1e-6,
                cu.to(device), scaling, 0.0), {}

    return Sample(leaves, build, note=f"documents {lengths}, heads {nk}/{nv}, dims {dk}/{dv}, hidden {hidden}")


def _bench(device, dtype, tokens=4096):
    """A Qwen3.5-MoE proxy layer's Gated DeltaNet (hidden 2048, 16 key / 32 value heads of 128)."""

    weights, _ = block_leaves(RandomDraw(0), 2048, 16, 32, 128, 128, 4, dtype, device, 0)
    weights = bind(GatedDeltaNetWeights, {k: v for k, v in weights.items() if "lora" not in k}, "linear_attn.")
    h = torch.randn(tokens, 2048, device=device, dtype=dtype, requires_grad=True)
    return f"h [{tokens}, 2048], heads 16/32 of 128", (h, weights, 16, 32, 128, 128, 1e-6,
                                                       torch.tensor([0, tokens], device=device), 0.0, 0.0)


def _call(nv=2, qkv_rows=24):
    def args():
        w, _ = block_leaves(RandomDraw(0), 8, 1, 2, 4, 8, 4, torch.float32, "cpu", 0)
        w = {k: v for k, v in w.items() if "lora" not in k}
        w["linear_attn.in_proj_qkv.weight"] = torch.zeros(qkv_rows, 8)
        return (torch.zeros(5, 8), bind(GatedDeltaNetWeights, w, "linear_attn."), 1, nv, 4, 8, 1e-6,
                torch.tensor([0, 5]), 0.0, 0.0)
    return args


CASE = OpCase(
    OPS["v4_gated_deltanet"], samples=samples, benchmarks=(_bench,),
    errors=(
        ErrorCase("in_proj_qkv of the wrong height", _call(qkv_rows=20),
                  "in_proj_qkv.weight has shape [20, 8], expected [24, 8]"),
        ErrorCase("value heads not a multiple of key heads", _call(nv=0), "value heads must be a multiple of key heads"),
    ),
)
