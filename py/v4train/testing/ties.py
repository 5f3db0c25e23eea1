"""Routing near-ties of the layer ops. A layer op's MoE input is the output of its attention, which
the C++ op and the reference round differently in a low-precision dtype; a token whose k-th and
(k+1)-th experts score within that rounding goes to either, and the expert weights' gradients
then differ by that token's whole contribution (seen with the wide profile: a bf16 Qwen3.5 layer
whose token 60 had router probabilities 0.4314 and 0.4307). Where a comparison fails, the parity
check compares again against the reference (and its float64 truth) routed as the C++ ops routed:
a verdict on the rest of the layer, not an excuse; only this second comparison may take the
rounding-spread exit of check.judge (the spread replays the routing of the reference it runs).

Only a near-tie is a reason to route otherwise. A token counts as one when the C++ ops' choice is
the reference router's choice for some router logits within rounding of the reference's own:
each logit l_e = x . W_e may move by
    delta_e = ROUNDING_ULPS * u_x * sum_j |W_ej| |x_j| + u_l * |l_e|
(u_x the unit roundoff of the MoE input's dtype, u_l that of the logits': x's for Qwen3.5, fp32
for GLM-5): the input x rounded differently by a few units in each element (the attention and the
norm before it round in their own order), and the logit itself rounded once. A router that sends a token to another expert without such a tie fails the
layer's parity (parity/test_ties.py holds one)."""

from __future__ import annotations

from typing import Callable

import torch

from v4train.op import OpTable
from v4train.ops import OPS, REFERENCE
from v4train.testing.compare import UNIT_ROUNDOFF

# The number of units of roundoff by which each element of the MoE input may differ between two
# correct evaluations of the layer (see the module docstring). Every flip that 400 bf16 samples
# of each layer op's strategy met (5 Qwen3.5, 2 GLM-5) lies within a quarter of it.
ROUNDING_ULPS = 2


def _logit_bounds(x: torch.Tensor, weight: torch.Tensor, logit_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The router logits of x in float64 [T, E], and how far rounding may move each (delta_e):
    x's elements by ROUNDING_ULPS units of x's dtype, the logit by one of `logit_dtype`."""
    xd, wd = x.detach().double(), weight.detach().double()
    logits = xd @ wd.T
    return logits, ROUNDING_ULPS * UNIT_ROUNDOFF[x.dtype] * (xd.abs() @ wd.abs().T) + UNIT_ROUNDOFF[logit_dtype] * logits.abs()


def _topk_set(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, scores.topk(k, dim=-1).indices, True)


def _chosen(routing: torch.Tensor, experts: int) -> torch.Tensor:
    return torch.zeros(routing.shape[0], experts, dtype=torch.bool, device=routing.device).scatter_(1, routing, True)


def _softmax_reachable(call: dict, routing: torch.Tensor) -> torch.Tensor:
    """Per token: whether the softmax top-k router (v4_qwen3_5_moe) picks `routing` for some logits
    within their rounding (softmax is monotone in the logits: raise the chosen, lower the rest)."""
    logits, delta = _logit_bounds(call["x"], call["weights"].gate, call["x"].dtype)
    want = _chosen(routing.to(logits.device), logits.shape[1])
    return (_topk_set(torch.where(want, logits + delta, logits - delta), call["top_k"]) == want).all(-1)


def _grouped_sigmoid_reachable(call: dict, routing: torch.Tensor) -> torch.Tensor:
    """The same for GLM-5's router (v4_glm5_moe): sigmoid scores plus the correction bias, the best
    topk_group groups by the sum of their two best, then the top_k experts among them. The
    groups of the chosen experts are raised for the group choice, the chosen experts for theirs."""
    w = call["weights"]
    logits, delta = _logit_bounds(call["x"], w.gate, torch.float32)
    bias = w.e_score_correction_bias.detach().double()
    # sigmoid moves by at most sigmoid' * delta over the interval: bound it by its largest there.
    slope = torch.maximum((logits - delta).sigmoid() * (1 - (logits - delta).sigmoid()),
                          (logits + delta).sigmoid() * (1 - (logits + delta).sigmoid()))
    slope = torch.where((logits - delta < 0) & (logits + delta > 0), torch.full_like(slope, 0.25), slope)
    scores, spread = logits.sigmoid() + bias, slope * delta
    T, E = scores.shape
    n_group, topk_group, top_k = call["n_group"], call["topk_group"], call["top_k"]
    want = _chosen(routing.to(scores.device), E)
    want_groups = want.view(T, n_group, -1).any(-1)
    raised = torch.where(want_groups.repeat_interleave(E // n_group, dim=1), scores + spread, scores - spread)
    groups = raised.view(T, n_group, -1).topk(2 if E // n_group >= 2 else 1, dim=-1).values.sum(-1)
    kept = _topk_set(groups, topk_group).repeat_interleave(E // n_group, dim=1)
    choice = torch.where(want, scores + spread, scores - spread).masked_fill(~kept, float("-inf"))
    return (_topk_set(choice, top_k) == want).all(-1)


# The MoE ops whose `routing` argument, given, replaces the router's choice; and, per op, the
# per-token test of whether a routing is the router's choice within rounding.
ROUTERS: dict[str, Callable[[dict, torch.Tensor], torch.Tensor]] = {
    "v4_glm5_moe": _grouped_sigmoid_reachable,
    "v4_qwen3_5_moe": _softmax_reachable,
}


def _table(base: OpTable, routings: list[torch.Tensor] | None, seen: list) -> OpTable:
    """base's ops, with each MoE call recorded into `seen` as (its arguments by name, the routing
    it took) and, given `routings`, the i-th call routed by routings[i] instead of by its router
    (a given routing is how a checkpointed layer's recomputation repeats its first pass). The
    layer references call the MoE ops by keyword, so the arguments are known by name."""
    def wrap(name, fn, is_cpp):
        if name not in ROUTERS:
            return fn

        def call(*a, **k):
            if a:
                raise TypeError(f"{name}: a layer reference must call it by keyword (ties.py reads its arguments "
                                f"by name), got {len(a)} positional")
            if routings is not None:  # a checkpointed layer's recomputation calls again, in the same order
                k["routing"] = routings[len(seen) % len(routings)].to(k["x"].device)
            out = fn(**k)
            seen.append((name, dict(k), out[1]))
            return out
        return call

    return OpTable(base.ops, base.cpp, wrap=wrap)


def unexplained_flips(theirs: list, ours: list) -> int:
    """How many tokens the C++ ops (`ours`) route otherwise than the references (`theirs`) where
    the reference's router logits show no near-tie (see the module docstring)."""
    count = 0
    for (name, call, their_routing), (_, _, our_routing) in zip(theirs, ours):
        differs = ~(their_routing.sort(-1).values == our_routing.sort(-1).values).all(-1)
        if differs.any():
            count += int((differs & ~ROUTERS[name](call, our_routing).to(differs.device)).sum())
    return count


def rerouted(reference: Callable, args: tuple, kwargs: dict, cpp_out: torch.Tensor, seed: int = 0) -> Callable | None:
    """The layer `reference` (taking ops=) composed from the C++ ops on args: where that
    composition gives the C++ layer op's output `cpp_out` bit for bit (it calls the same C++ ops)
    and routes every token as the references' composition does or, where otherwise, at a
    near-tie, a reference callable that routes each MoE call as the C++ ops did (the C++ result's
    own choices, which the rounding spread of check.judge must replay); else None (the failed
    comparison stands). Each composition starts the random generators from `seed`, as the
    C++ layer's run did (the same LoRA dropout masks)."""

    cpp_table = OpTable(OPS, frozenset(name for name, op in OPS.items() if op.has_cpp))
    theirs, ours = [], []
    with torch.no_grad():
        torch.manual_seed(seed)
        reference(*args, **kwargs, ops=_table(REFERENCE, None, theirs))
        torch.manual_seed(seed)
        composed = reference(*args, **kwargs, ops=_table(cpp_table, None, ours))
    composed = composed[0] if isinstance(composed, tuple) else composed
    if len(ours) != len(theirs) or not torch.equal(composed, cpp_out.detach()):
        return None
    if unexplained_flips(theirs, ours):
        return None
    routes = [r for _, _, r in ours]

    def reference_routed_as_cpp(*a, **k):
        return reference(*a, **k, ops=_table(REFERENCE, routes, []))
    return reference_routed_as_cpp
