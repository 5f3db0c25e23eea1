"""v4_glm5_moe: GLM-5's MoE block: sigmoid group-limited router, grouped-GEMM experts, shared expert."""

import torch

from v4train.ops import OPS
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import Sample, kernel_width, layout, make_leaf, seed, size, view_as_layout, weight_leaves
from v4train.models.glm5.moe import Glm5MoeWeights
from v4train.reference.lora import bind, quantize_fp8, scale_name


def samples(draw, dtype: torch.dtype, device) -> Sample:
    """Routing covers: experts with no token, all tokens on one expert (a large correction bias),
    top_k = the number of experts, groups. The C++ router runs the reference's ATen calls on the
    same inputs in the same order, so its choice is identical bit for bit, near-ties included;
    the routing output is compared exactly."""
    tokens, hidden, inter = size(draw, 40), kernel_width(draw, 24, dtype), kernel_width(draw, 24, dtype)
    n_group = draw.sampled_from([1, 2, 4])
    experts = n_group * draw.sampled_from([2, 3])
    topk_group = draw.integers(1, n_group)
    top_k = draw.sampled_from([1, 2, topk_group * (experts // n_group)])
    skew = draw.booleans()  # one expert's bias dwarfs the scores: with top_k 1 every token picks it
    given = draw.booleans() and draw.booleans()  # a recomputation's routing
    x_layout, s = layout(draw), seed(draw)
    p = "mlp."
    weights, scaling = weight_leaves(draw, {
        p + "experts.gate_up_proj": (experts, 2 * inter, hidden), p + "experts.down_proj": (experts, hidden, inter),
        p + "shared_experts.gate_proj.weight": (inter, hidden), p + "shared_experts.up_proj.weight": (inter, hidden),
        p + "shared_experts.down_proj.weight": (hidden, inter)}, dtype, device, s)
    weights[p + "gate.weight"] = make_leaf((experts, hidden), "contiguous", torch.float32, device, s + 50)
    bias = make_leaf((experts,), "contiguous", torch.float32, device, s + 51, scale=0.1)
    if skew:
        bias[s % experts] = 10.0
    weights[p + "gate.e_score_correction_bias"] = bias
    norm = draw.booleans()
    gen = torch.Generator().manual_seed(s)
    routing = torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :top_k].sort(-1).values.to(device) if given else None
    leaves = {"x": make_leaf((tokens, hidden), x_layout, dtype, device, s + 100), **weights}

    def build(lv):
        w = {k: v for k, v in lv.items() if k != "x"}
        return (view_as_layout(lv["x"], x_layout), bind(Glm5MoeWeights, w, p), top_k, n_group, topk_group, norm, 2.5,
                scaling, 0.0, routing), {}

    return Sample(leaves, build, note=f"{experts} experts in {n_group} groups, top {top_k} of {topk_group} groups, "
                                      f"skewed {skew}, routing given {given}, norm {norm}")


def glm5_moe_weights(device, dtype, experts=32, hidden=6144, inter=2048, gen=None):
    """A GLM-5 MoE layer's tensors (the proxy's 32 experts), for benchmarks."""
    gen = gen or torch.Generator().manual_seed(0)
    r = lambda *s, dt=dtype: (0.02 * torch.randn(*s, generator=gen)).to(device=device, dtype=dt).requires_grad_()  # noqa: E731
    return {"mlp.gate.weight": r(experts, hidden, dt=torch.float32),
            "mlp.gate.e_score_correction_bias": torch.zeros(experts, device=device),
            "mlp.experts.gate_up_proj": r(experts, 2 * inter, hidden), "mlp.experts.down_proj": r(experts, hidden, inter),
            "mlp.shared_experts.gate_proj.weight": r(inter, hidden), "mlp.shared_experts.up_proj.weight": r(inter, hidden),
            "mlp.shared_experts.down_proj.weight": r(hidden, inter)}


def _bench(device, dtype):
    w = glm5_moe_weights(device, dtype)
    x = torch.randn(4096, 6144, device=device, dtype=dtype, requires_grad=True)
    return "x [4096, 6144], 32 experts top-8 (intermediate 2048) + shared", (x, bind(Glm5MoeWeights, w, "mlp."), 8, 1, 1,
                                                                            True, 2.5, 0.0, 0.0, None)


def _bench_fp8(device, dtype):
    """The same with the routed experts' weights in FP8 as the released checkpoints store them
    (128 x 128 blocks): on CUDA, cc/common/fp8_grouped.cu's kernel both ways. An FP8 base is frozen,
    so its backward has no weight gradient for them (the case above has): compare the forwards."""
    w = glm5_moe_weights(device, dtype)
    for name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        w[name], w[scale_name(name)] = quantize_fp8(w[name].detach())
    x = torch.randn(4096, 6144, device=device, dtype=dtype, requires_grad=True)
    return "the same, routed experts FP8 (frozen)", (x, bind(Glm5MoeWeights, w, "mlp."), 8, 1, 1, True, 2.5, 0.0, 0.0,
                                                     None)


def _weights(E=4, H=8, I=6, **replaced):
    """Glm5MoeWeights of zeros, with the tensors named in `replaced` replaced."""
    w = {"gate.weight": torch.zeros(E, H), "gate.e_score_correction_bias": torch.zeros(E),
         "experts.gate_up_proj": torch.zeros(E, 2 * I, H), "experts.down_proj": torch.zeros(E, H, I),
         "shared_experts.gate_proj.weight": torch.zeros(I, H), "shared_experts.up_proj.weight": torch.zeros(I, H),
         "shared_experts.down_proj.weight": torch.zeros(H, I)}
    return bind(Glm5MoeWeights, {**w, **replaced})


def _call(x=lambda: torch.zeros(5, 8), w=_weights, top_k=2, n_group=1, topk_group=1, routing=None):
    return lambda: (x(), w(), top_k, n_group, topk_group, True, 2.5, 0.0, 0.0, routing and routing())


CASE = OpCase(
    OPS["v4_glm5_moe"], samples=samples, benchmarks=(_bench, _bench_fp8),
    errors=(
        ErrorCase("top_k above the experts", _call(top_k=5), "top_k=5 must lie in [1, 4]"),
        ErrorCase("groups that do not divide the experts", _call(n_group=3), "n_group=3, topk_group=1 do not fit 4 experts"),
        ErrorCase("a down_proj of the wrong width", _call(w=lambda: _weights(**{"experts.down_proj": torch.zeros(4, 8, 5)})),
                  "experts.down_proj has shape [4, 8, 5], expected [4, 8, 6]"),
        ErrorCase("a router on another device", _call(w=lambda: _weights(**{"gate.weight": torch.zeros(4, 8, device="meta")})),
                  "weights.gate is on meta but the input is on cpu"),
        ErrorCase("routing naming no expert", _call(routing=lambda: torch.full((5, 2), 4)), "routing must name experts in [0, 4)"),
        ErrorCase("routing of the wrong shape", _call(routing=lambda: torch.zeros(5, 3, dtype=torch.int64)),
                  "routing must be int64 [5, 2]"),
    ),
)
