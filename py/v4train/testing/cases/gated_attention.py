"""v4_gated_attention: Qwen3.5's gated full attention (q/gate, zero-centred q/k norms, partial RoPE, o_proj)."""

import torch

from v4train.models import config_from_dict
from v4train.testing.cases.mla_dsa_attention import documents, packed
from v4train.models.qwen3_5.attention import GatedAttentionWeights
from v4train.ops import OPS
from v4train.reference.lora import bind
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import RandomDraw, Sample, layout, make_leaf, seed, view_as_layout, weight_leaves, width
from v4train.models.qwen3_5.attention import v4_gated_attention


def small_rope(head_dim: int, partial: float, yarn: bool):
    """The Rope of a qwen3_5 config with this head_dim and partial rotary factor."""
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
    if yarn:
        params.update(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    return config_from_dict({"model_type": "qwen3_5", "num_hidden_layers": 1, "head_dim": head_dim,
                             "rope_parameters": params}).rope


def attention_leaves(draw, hidden: int, nh: int, nkv: int, hd: int, dtype, device, s: int):
    weights, scaling = weight_leaves(draw, {
        "self_attn.q_proj.weight": (nh * 2 * hd, hidden), "self_attn.k_proj.weight": (nkv * hd, hidden),
        "self_attn.v_proj.weight": (nkv * hd, hidden), "self_attn.o_proj.weight": (hidden, nh * hd)}, dtype, device, s)
    weights["self_attn.q_norm.weight"] = make_leaf((hd,), "contiguous", dtype, device, s + 40, 0.2)
    weights["self_attn.k_norm.weight"] = make_leaf((hd,), "contiguous", dtype, device, s + 41, 0.2)
    return weights, scaling


def samples(draw, dtype: torch.dtype, device) -> Sample:
    nkv = draw.integers(1, 2)
    nh = nkv * draw.sampled_from([1, 2])
    hd = 8 * draw.integers(1, 2)  # rotary dims (a quarter, half or all of it) stay even
    rope = small_rope(hd, draw.sampled_from([0.25, 0.5, 1.0]), draw.booleans())
    hidden, h_layout, s = width(draw, 24, dtype), layout(draw), seed(draw)
    lengths = documents(draw, draw.integers(1, 8)) + [draw.sampled_from([0, 1])]
    weights, scaling = attention_leaves(draw, hidden, nh, nkv, hd, dtype, device, s)
    positions, cu = packed(lengths, device)
    leaves = {"h": make_leaf((sum(lengths), hidden), h_layout, dtype, device, s + 100), **weights}

    def build(lv):
        return (view_as_layout(lv["h"], h_layout), bind(GatedAttentionWeights, lv, "self_attn."), nh, nkv, hd, rope, 1e-6,
                positions, cu.to(device), scaling, 0.0), {}

    return Sample(leaves, build, note=f"documents {lengths}, heads {nh}/{nkv} of {hd}, rope {rope}")


def _bench(device, dtype, tokens=4096):
    """A Qwen3.5-MoE proxy layer's gated attention (hidden 2048, 16 heads / 2 kv heads of 256)."""

    weights, _ = attention_leaves(RandomDraw(0), 2048, 16, 2, 256, dtype, device, 0)
    weights = bind(GatedAttentionWeights, {k: v for k, v in weights.items() if "lora" not in k}, "self_attn.")
    h = torch.randn(tokens, 2048, device=device, dtype=dtype, requires_grad=True)
    positions, cu = packed([tokens], device)
    return f"h [{tokens}, 2048], 16/2 heads of 256", (h, weights, 16, 2, 256, small_rope(256, 0.25, False), 1e-6,
                                                      positions, cu, 0.0, 0.0)


def _call(nh=2, q_rows=32, positions=lambda: torch.arange(5)):
    def args():
        w, _ = attention_leaves(RandomDraw(0), 8, 2, 1, 8, torch.float32, "cpu", 0)
        w = {k: v for k, v in w.items() if "lora" not in k}
        w["self_attn.q_proj.weight"] = torch.zeros(q_rows, 8)
        return (torch.zeros(5, 8), bind(GatedAttentionWeights, w, "self_attn."), nh, 1, 8, small_rope(8, 0.5, False),
                1e-6, positions(), torch.tensor([0, 5]), 0.0, 0.0)
    return args


CASE = OpCase(
    OPS["v4_gated_attention"], samples=samples, benchmarks=(_bench,),
    errors=(
        ErrorCase("q_proj without the gate rows", _call(q_rows=16),
                  "q_proj.weight has shape [16, 8], expected [32, 8] (query and gate per head)"),
        ErrorCase("int32 positions", _call(positions=lambda: torch.arange(5, dtype=torch.int32)), "positions must be int64 [5]"),
    ),
)
