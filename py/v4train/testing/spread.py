"""An op's rounding spread: how far the exact (float64) answer of its reference moves when every
intermediate of the computation, forward and backward, is rounded as working in a low precision
would round it. The op-level twin of compare.rounding_spread (which rounds module outputs of a
whole model); check.judge's last exit for bf16 and fp16 results (see its docstring).

Under `Rounding`, a TorchDispatchMode, every floating output of every functional, non-view aten op
is multiplied by 1 + u xi (u the dtype's unit roundoff, xi = +-1 drawn per element from a seeded
generator). What it leaves alone, and why:
- views (func.is_view): they alias a tensor that was rounded where it was made;
- in-place and out= ops (a mutable schema): the few the references make fill a tensor made (and
  rounded) by a functional op (an index_put_ of selected keys, a scatter_ of a mask); the rounding
  of their own arithmetic, where they have any, is left out, which makes the spread smaller:
  stricter, never looser;
- integer and bool outputs (top-k and sort indices, argmax, masks from comparisons, routing):
  recorded in order by an unperturbed run under the same mode and replayed in the perturbed runs,
  so that the spread measures rounding given the same choices. A flipped choice would move the
  answer by O(1), and a spread that large would let anything pass. Where the perturbed run's
  sequence of ops departs from the record (another op or shape at the same position), the spread
  is undefined (None): no exit is taken on it;
- random ops draw what they drew in the record: the caller seeds each run alike, and xi comes from
  a generator of its own.
"""

from __future__ import annotations

import math
from typing import Callable, Hashable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from v4train.testing.compare import UNIT_ROUNDOFF

DRAWS = 4  # as compare.rounding_spread


def _discrete(t) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex()


def _rounds(t) -> bool:  # (an FP8 tensor is a stored weight's exact values)
    return isinstance(t, torch.Tensor) and (t.is_complex() or (t.is_floating_point() and torch.finfo(t.dtype).bits >= 16))


class Rounding(TorchDispatchMode):
    """Records the ops of a run (no `gen`), or replays that record's discrete outputs while
    rounding every floating output by 1 + u xi (see the module docstring). `diverged` says whether
    the run left the record."""

    def __init__(self, u: float = 0.0, gen: torch.Generator | None = None, record: list | None = None):
        super().__init__()
        self.u, self.gen = u, gen
        self.record = [] if record is None else record  # per op: (op and its outputs' dtypes and shapes, discrete outputs)
        self.replaying = record is not None
        self.position, self.diverged = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat, spec = tree_flatten(out)
        key = (func, tuple((t.dtype, t.shape) if isinstance(t, torch.Tensor) else None for t in flat))
        functional = not func.is_view and not func._schema.is_mutable
        if not self.replaying:  # clones: a later in-place op may change the output
            self.record.append((key, [t.clone() if functional and _discrete(t) else None for t in flat]))
            return out
        if self.diverged or self.position >= len(self.record) or self.record[self.position][0] != key:
            self.diverged = True
            return out
        recorded = self.record[self.position][1]
        self.position += 1
        if not functional:
            return out
        return tree_unflatten([r.clone() if r is not None else self._rounded(t) if _rounds(t) else t
                               for t, r in zip(flat, recorded)], spec)

    def _rounded(self, t: torch.Tensor) -> torch.Tensor:
        xi = torch.randint(0, 2, t.shape, generator=self.gen).mul_(2).sub_(1)
        return t * (1 + self.u * xi).to(dtype=t.dtype, device=t.device)


def op_spread(run: Callable[[Rounding], dict[Hashable, torch.Tensor | None]], dtype: torch.dtype,
              draws: int = DRAWS) -> dict[Hashable, float | None] | None:
    """For each tensor `run(mode)` returns (float64, computed under `mode`), max over `draws` of
    ||rounded - exact|| on the exact tensor's finite elements, with u the unit roundoff of `dtype`;
    None where a draw made it non-finite. None altogether where a draw's ops left the record."""
    record = Rounding()
    exact = run(record)
    spread = {k: 0.0 for k, e in exact.items() if e is not None}
    for draw in range(draws):
        mode = Rounding(UNIT_ROUNDOFF[dtype], torch.Generator().manual_seed(draw), record.record)
        rounded = run(mode)
        if mode.diverged or mode.position != len(record.record):
            return None
        for k in spread:
            e = exact[k].detach().double()
            d = math.inf if rounded[k] is None else (rounded[k].detach().double() - e)[e.isfinite()].norm().item()
            spread[k] = max(spread[k], d) if math.isfinite(d) else math.inf
    return {k: s if math.isfinite(s) else None for k, s in spread.items()}
