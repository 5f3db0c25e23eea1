"""What an op is at run time (`Op`: its name, reference, dtypes and C++ entry), and the run's
choice of implementations (`OpTable`, made once from --cpp_ops). The records are listed in
v4train/ops (the shared blocks) and in each family's package (v4train/models/<family>: its
layer op and blocks); what tests need of an op (its parity samples, error cases, benchmark
shapes) lives in v4train/testing. This module imports nothing of v4train's: every layer may use it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Callable, Iterable

import torch


class CppOpUnavailable(ImportError):
    """The extension module of a C++ op could not be imported."""


# The dtypes of the ops that also run in float64: the layer ops and their building blocks, whose
# low-precision parity cannot judge tensors that are ill-conditioned in that dtype (see check.py).
F64 = (torch.float32, torch.bfloat16, torch.float64)


@dataclasses.dataclass(frozen=True)
class Op:
    """One op.

    name: v4_<op>, the name of the C++ function, of its nanobind module and of the reference.
    reference: the pure-PyTorch function. A `composite` op's reference (a layer) calls its
      building blocks through an OpTable given as the keyword argument `ops`.
    dtypes: the dtypes it runs in (F64: also float64, where the parity suite checks its math).
    """

    name: str
    reference: Callable
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    has_cpp: bool = True  # False while only the reference exists.
    inplace: bool = False  # Updates its tensor arguments in place (no autograd): the optimizer ops.
    composite: bool = False  # Its reference takes `ops`: the table its sub-ops are called through.
    limits: str = ""  # What the op does not support yet, in words.

    def cpp(self) -> Callable:
        """The C++ entry: function `name` of the nanobind module `name`."""
        if not self.has_cpp:
            raise CppOpUnavailable(f"{self.name} has no C++ implementation yet; it runs on the reference path")
        try:
            module = importlib.import_module(self.name)
        except ImportError as e:
            raise CppOpUnavailable(
                f"the C++ op {self.name} is not built or not importable ({e}). Run through "
                f"`tools/bazel run|test`, or build it without Bazel with `python tools/build_ext.py` "
                f"and put build/ext on PYTHONPATH; or keep it on the reference path (--cpp_ops=none)."
            ) from e
        if not hasattr(module, self.name):
            raise CppOpUnavailable(f"the C++ module {self.name} defines no function {self.name} (its binding, "
                                   f"cc/ops/bind/: m.def(\"{self.name}\", ...))")
        return getattr(module, self.name)


class OpTable:
    """The implementation of every op for one run: C++ for the ops in `cpp`, the reference for the
    others. Resolved once; ops are attributes (`table.v4_rms_norm(...)`). A composite op's
    reference is bound to this table, so its building blocks follow the same choice."""

    def __init__(self, ops: dict[str, Op], cpp: Iterable[str] = (), wrap: Callable | None = None):
        """wrap(name, fn, is_cpp) -> fn, if given, wraps every op (measurements: FLOPs, times)."""
        self.ops = ops
        self.cpp = frozenset(cpp)
        unknown = sorted(self.cpp - set(ops))
        if unknown:
            raise ValueError(f"OpTable: unknown op(s) {', '.join(unknown)}")
        self._fns = {}
        for name, op in ops.items():
            if name in self.cpp:
                fn = op.cpp()
            elif op.composite:
                fn = functools.partial(op.reference, ops=self)
            else:
                fn = op.reference
            if wrap is not None:
                fn = wrap(name, fn, name in self.cpp)
            self._fns[name] = fn
            setattr(self, name, fn)

    def __getitem__(self, name: str) -> Callable:
        return self._fns[name]

    def __repr__(self) -> str:
        return f"OpTable(cpp={sorted(self.cpp)})"


def parse_cpp_ops(spec: str, known: dict[str, Op]) -> set[str]:
    """`all`, `none` or a comma list of op names (with or without the v4_ prefix)."""
    spec = spec.strip()
    if spec == "all":
        return {name for name, op in known.items() if op.has_cpp}
    if spec == "none":
        return set()
    if not spec.strip(", "):  # (an empty value is no choice: a flagfile's line left unfinished, say)
        raise ValueError("--cpp_ops is empty; expected 'all', 'none' or a comma list of op names")
    names = {n if n.startswith("v4_") else "v4_" + n for n in (p.strip() for p in spec.split(",")) if n}
    unknown = sorted(names - set(known))
    if unknown:
        raise ValueError(
            f"--cpp_ops: unknown op(s) {', '.join(unknown)}; expected 'all', 'none' or a comma list of "
            f"{', '.join(sorted(known))}"
        )
    no_cpp = sorted(n for n in names if not known[n].has_cpp)
    if no_cpp:
        raise ValueError(f"--cpp_ops: {', '.join(no_cpp)} has no C++ implementation yet (ops with one: "
                         f"{', '.join(sorted(n for n, op in known.items() if op.has_cpp))})")
    return names
