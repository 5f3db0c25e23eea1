"""Routing near-ties of the layer ops. A layer op's MoE input is the output of its attention, which
the C++ op and the reference round differently in a low-precision dtype; a token whose k-th and
(k+1)-th experts score within that rounding goes to either, and the expert weights' gradients
then differ by that token's whole contribution (seen with the wide profile: a bf16 Qwen3.5 layer
whose token 60 had router probabilities 0.4314 and 0.4307). Such a sample says nothing about
either implementation, so the parity check sets it aside when a comparison fails on it and the
two sides' routings differ."""

from __future__ import annotations

from typing import Callable

import torch

from v4train.ops.registry import OpTable

ROUTERS = ("v4_moe", "v4_qwen_moe")


def _routings(reference: Callable, args: tuple, kwargs: dict, table: OpTable) -> list[torch.Tensor]:
    """The routing ([tokens, top_k] expert indices) of each MoE call of the layer `reference`
    composed from `table`'s ops."""
    seen = []

    def wrap(name, fn, is_cpp):
        if name not in ROUTERS:
            return fn

        def call(*a, **k):
            out = fn(*a, **k)
            seen.append(out[1].sort(-1).values)
            return out
        return call

    with torch.no_grad():
        reference(*args, **kwargs, ops=OpTable(table.ops, table.cpp, wrap=wrap))
    return seen


def routing_near_tie(reference: Callable, args: tuple, kwargs: dict) -> str:
    """The layer `reference` (taking ops=) composed twice on args: from the pure references, and
    from the C++ ops (each checked alone against its reference, the routing bit for bit on the
    same input). Returns where the two route a token differently, or "" where they agree."""
    from v4train.ops import OPS, REFERENCE  # the registry imports the op modules, which import this one

    cpp = OpTable(OPS, frozenset(name for name, op in OPS.items() if op.has_cpp))
    for i, (a, b) in enumerate(zip(_routings(reference, args, kwargs, REFERENCE), _routings(reference, args, kwargs, cpp))):
        differ = (a != b).any(-1).nonzero()
        if len(differ):
            t = int(differ[0])
            return (f"MoE call {i} routes token {t} to experts {a[t].tolist()} on the references' input and "
                    f"{b[t].tolist()} on the C++ ops' (its input rounded another way, at a near-tie)")
    return ""
