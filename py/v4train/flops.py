"""Where a training step's FLOPs run: in C++ ops, in reference (Python) ops, or outside any op.

`FlopShare(table)` gives a copy of the run's OpTable whose every op call is attributed, and
counts the FLOPs of every ATen call that runs (forward and backward, matrix products and
attention by torch.utils.flop_counter's formulas, plus grouped GEMMs) under the innermost op
call that made it. The backward of an op is attributed through the autograd nodes its call
created. The share in C++ is then a number anyone can read (`summary()`).
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from v4train.ops import OpTable

OUTSIDE = "outside any op"


def _grouped_mm_flops(a, b, *args, out_val=None, **kwargs) -> int:
    """2 x M x N x K summed over the groups of at::_grouped_mm (which flop_counter lacks)."""
    if a.dim() == 2 and b.dim() == 2:  # groups split K: out [G, M, N], K in total a.shape[1]
        return 2 * (out_val.numel() // out_val.shape[0]) * a.shape[1]
    return 2 * out_val.numel() * a.shape[-1]


_FORMULAS = {**flop_registry, torch.ops.aten._grouped_mm: _grouped_mm_flops}


class FlopShare(TorchDispatchMode):
    def __init__(self, table: OpTable):
        super().__init__()
        self.flops: collections.Counter = collections.Counter()  # (op name or OUTSIDE, "cpp"|"reference") -> FLOPs
        self._owner = [(OUTSIDE, "")]
        self._nodes: dict[torch.autograd.graph.Node, tuple[str, str]] = {}
        self.table = OpTable(table.ops, table.cpp, wrap=self._wrap)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        formula = _FORMULAS.get(func._overloadpacket)
        if formula is not None:
            self.flops[self._owner[-1]] += int(formula(*args, **(kwargs or {}), out_val=out))
        return out

    def _walk(self, roots, owner) -> None:
        """Gives every node reachable from roots that has no owner yet to `owner`."""
        todo = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in self._nodes:
                continue
            self._nodes[node] = owner
            if owner[0] != OUTSIDE:  # its backward runs under its owner
                node.register_prehook(lambda grads, o=owner: self._owner.append(o) and None)
                node.register_hook(lambda grads_in, grads_out: self._owner.pop() and None)
            todo += [n for n, _ in node.next_functions]

    def _wrap(self, name, fn, is_cpp):
        owner = (name, "cpp" if is_cpp else "reference")

        def call(*args, **kwargs):
            # What existed before the call was made by the caller (an enclosing op, or no op).
            self._walk(tree_flatten((args, kwargs))[0], self._owner[-1])
            self._owner.append(owner)
            try:
                out = fn(*args, **kwargs)
            finally:
                self._owner.pop()
            self._walk(tree_flatten(out)[0], owner)
            return out

        return call

    def summary(self) -> dict:
        """{"total": FLOPs, "cpp": FLOPs in C++ ops, "cpp_share": fraction, "by_op": {...}}."""
        total = sum(self.flops.values())
        cpp = sum(v for (_, kind), v in self.flops.items() if kind == "cpp")
        by_op = {f"{name} ({kind})" if kind else name: v for (name, kind), v in sorted(self.flops.items())}
        return {"total": total, "cpp": cpp, "cpp_share": cpp / total if total else 0.0, "by_op": by_op}
