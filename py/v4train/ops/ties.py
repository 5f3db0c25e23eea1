"""Routing near-ties of the layer ops. A layer op's MoE input is the output of its attention, which
the C++ op and the reference round differently in a low-precision dtype; a token whose k-th and
(k+1)-th experts score within that rounding goes to either, and the expert weights' gradients
then differ by that token's whole contribution (seen with the wide profile: a bf16 Qwen3.5 layer
whose token 60 had router probabilities 0.4314 and 0.4307). Where a comparison fails and the
routings differ, the parity check compares again against the reference (and its float64 truth)
routed as the C++ ops routed: a verdict on the rest of the layer, not an excuse."""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from v4train.ops.registry import OpTable

ROUTERS = ("v4_moe", "v4_qwen_moe")  # their `routing` argument, given, replaces the router's choice


def _table(base: OpTable, routings: list[torch.Tensor] | None, seen: list) -> OpTable:
    """base's ops, with each MoE call's routing recorded into `seen` and, given `routings`, the
    i-th call routed by routings[i] instead of by its router (a given routing is how a
    checkpointed layer's recomputation repeats its first pass)."""
    def wrap(name, fn, is_cpp):
        if name not in ROUTERS:
            return fn
        at = list(inspect.signature(base.ops[name].reference).parameters).index("routing")

        def call(*a, **k):
            if routings is not None:  # a checkpointed layer's recomputation calls again, in the same order
                given = routings[len(seen) % len(routings)].to(a[0].device)
                if len(a) > at:
                    a = a[:at] + (given,) + a[at + 1:]
                else:
                    k = {**k, "routing": given}
            out = fn(*a, **k)
            seen.append(out[1])
            return out
        return call

    return OpTable(base.ops, base.cpp, wrap=wrap)


def rerouted(reference: Callable, args: tuple, kwargs: dict, cpp_out: torch.Tensor) -> Callable | None:
    """The layer `reference` (taking ops=) composed from the C++ ops on args: where that
    composition gives the C++ layer op's output `cpp_out` bit for bit (it calls the same C++ ops)
    and routes some token otherwise than the references' composition, a reference callable that
    routes each MoE call as the C++ ops did; else None (the failed comparison stands)."""
    from v4train.ops import OPS, REFERENCE  # the registry imports the op modules, which import this one

    cpp_table = OpTable(OPS, frozenset(name for name, op in OPS.items() if op.has_cpp))
    theirs, ours = [], []
    with torch.no_grad():
        reference(*args, **kwargs, ops=_table(REFERENCE, None, theirs))
        composed = reference(*args, **kwargs, ops=_table(cpp_table, None, ours))
    composed = composed[0] if isinstance(composed, tuple) else composed
    if len(ours) != len(theirs) or not torch.equal(composed, cpp_out.detach()):
        return None
    if all(torch.equal(a.sort(-1).values, b.sort(-1).values) for a, b in zip(theirs, ours)):
        return None

    def reference_routed_as_cpp(*a, **k):
        return reference(*a, **k, ops=_table(REFERENCE, ours, []))
    return reference_routed_as_cpp
