"""v4_qwen3_5_moe: Qwen3.5-MoE's MoE block: softmax router, grouped-GEMM experts, sigmoid-gated shared expert."""

import torch

from v4train.ops import OPS
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import Sample, kernel_width, layout, make_leaf, seed, size, view_as_layout, weight_leaves
from v4train.models.qwen3_5.moe import Qwen35MoeWeights
from v4train.reference.lora import bind


def samples(draw, dtype: torch.dtype, device) -> Sample:
    """Routing covers experts with no token, all tokens on one expert (one router row dwarfs the
    others), top_k = the number of experts, and a given routing (a recomputation's). The C++ router
    runs the reference's ATen calls in the same order, so its choice is identical bit for bit,
    near-ties included; the routing output is compared exactly."""
    tokens, hidden, inter = size(draw, 40), kernel_width(draw, 24, dtype), kernel_width(draw, 24, dtype)
    experts = draw.sampled_from([2, 3, 4, 8])
    top_k = draw.sampled_from([1, 2, experts])
    top_k = min(top_k, experts)
    skew, given, norm = draw.booleans(), draw.booleans() and draw.booleans(), draw.booleans()
    x_layout, s = layout(draw), seed(draw)
    p = "mlp."
    weights, scaling = weight_leaves(draw, {
        p + "experts.gate_up_proj": (experts, 2 * inter, hidden), p + "experts.down_proj": (experts, hidden, inter),
        p + "shared_expert.gate_proj.weight": (inter, hidden), p + "shared_expert.up_proj.weight": (inter, hidden),
        p + "shared_expert.down_proj.weight": (hidden, inter)}, dtype, device, s)
    gate = make_leaf((experts, hidden), "contiguous", dtype, device, s + 50)
    if skew:  # x is positive-leaning below: a large row wins every token's first choice
        with torch.no_grad():
            gate[s % experts] = 3.0
    weights[p + "gate.weight"] = gate
    weights[p + "shared_expert_gate.weight"] = make_leaf((1, hidden), "contiguous", dtype, device, s + 51)
    gen = torch.Generator().manual_seed(s)
    routing = torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :top_k].to(device) if given else None
    leaves = {"x": make_leaf((tokens, hidden), x_layout, dtype, device, s + 100, shift=0.5 if skew else 0.0), **weights}

    def build(lv):
        w = {k: v for k, v in lv.items() if k != "x"}
        return (view_as_layout(lv["x"], x_layout), bind(Qwen35MoeWeights, w, p), top_k, norm, scaling, 0.0, routing), {}

    return Sample(leaves, build, note=f"{experts} experts, top {top_k}, skewed {skew}, routing given {given}, norm {norm}")


def _bench(device, dtype, tokens=4096):
    """A Qwen3.5-MoE proxy layer's MoE (hidden 2048, 64 experts top-8, intermediate 512 + shared 512)."""
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: (0.02 * torch.randn(*s, generator=gen)).to(device=device, dtype=dtype).requires_grad_()  # noqa: E731
    H, E, I = 2048, 64, 512
    w = bind(Qwen35MoeWeights, {
        "gate.weight": r(E, H), "experts.gate_up_proj": r(E, 2 * I, H), "experts.down_proj": r(E, H, I),
        "shared_expert.gate_proj.weight": r(I, H), "shared_expert.up_proj.weight": r(I, H),
        "shared_expert.down_proj.weight": r(H, I), "shared_expert_gate.weight": r(1, H)})
    x = torch.randn(tokens, H, device=device, dtype=dtype, requires_grad=True)
    return f"x [{tokens}, {H}], {E} experts top-8 (intermediate {I}) + gated shared", (x, w, 8, True, 0.0, 0.0, None)


def _weights(E=4, H=8, I=6, **replaced):
    """Qwen35MoeWeights of zeros, with the tensors named in `replaced` replaced."""
    w = {"gate.weight": torch.zeros(E, H), "shared_expert_gate.weight": torch.zeros(1, H),
         "experts.gate_up_proj": torch.zeros(E, 2 * I, H), "experts.down_proj": torch.zeros(E, H, I),
         "shared_expert.gate_proj.weight": torch.zeros(I, H), "shared_expert.up_proj.weight": torch.zeros(I, H),
         "shared_expert.down_proj.weight": torch.zeros(H, I)}
    return bind(Qwen35MoeWeights, {**w, **replaced})


def _call(w=_weights, top_k=2, routing=None):
    return lambda: (torch.zeros(5, 8), w(), top_k, True, 0.0, 0.0, routing and routing())


CASE = OpCase(
    OPS["v4_qwen3_5_moe"], samples=samples, benchmarks=(_bench,),
    errors=(
        ErrorCase("top_k above the experts", _call(top_k=5), "top_k=5 must lie in [1, 4]"),
        ErrorCase("a shared expert gate of the wrong shape",
                  _call(w=lambda: _weights(**{"shared_expert_gate.weight": torch.zeros(2, 8)})),
                  "shared_expert_gate has shape [2, 8], expected [1, 8]"),
        ErrorCase("a routing of the wrong shape", _call(routing=lambda: torch.zeros(5, 3, dtype=torch.int64)),
                  "routing must be int64 [5, 2]"),
    ),
)
