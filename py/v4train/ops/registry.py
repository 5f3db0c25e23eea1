"""The op registry: each op's reference, its C++ entry, its dtypes and known limits.

The parity suite loops over it, and the trainer reads it to switch each op between C++ and
the reference (`select_cpp_ops`, driven by the --cpp_ops flag).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

import torch


class CppOpUnavailable(ImportError):
    """The extension module of a C++ op could not be imported."""


@dataclasses.dataclass(frozen=True)
class OpInfo:
    name: str  # v4_<op>: the C++ function, its nanobind module and the reference function.
    reference: Callable
    dtypes: tuple[torch.dtype, ...]
    has_cpp: bool = True  # False while only the reference exists.
    inplace: bool = False  # Updates its tensor arguments in place (no autograd): the optimizer ops.
    limits: str = ""  # What the op does not support yet, in words.
    # (dtype, device) -> a small argument tuple for the trainer's self-check; floating tensors
    # among them get gradients.
    example: Callable | None = None

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
        return getattr(module, self.name)


_CPP_SELECTED: set[str] = set()


def dispatch(op: OpInfo) -> Callable:
    """The implementation the run selected for `op`: C++ when selected, else the reference."""
    return op.cpp() if op.name in _CPP_SELECTED else op.reference


def parse_cpp_ops(spec: str, known: dict[str, OpInfo]) -> set[str]:
    """`all`, `none` or a comma list of op names (with or without the v4_ prefix)."""
    spec = spec.strip()
    if spec == "all":
        return {name for name, op in known.items() if op.has_cpp}
    if spec in ("none", ""):
        return set()
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


def select_cpp_ops(spec: str, known: dict[str, OpInfo]) -> set[str]:
    """Turns on the C++ path for the ops `spec` names; fails now if one of them is not built."""
    names = parse_cpp_ops(spec, known)
    for name in sorted(names):
        known[name].cpp()
    _CPP_SELECTED.clear()
    _CPP_SELECTED.update(names)
    return names


def self_check(op: OpInfo, dtype: torch.dtype, device) -> None:
    """One forward and backward of the C++ entry against the reference on op.example's inputs;
    raises naming the op when an output or a gradient differs beyond the dtype's tolerance."""
    from v4train.ops.tolerances import TOLERANCES

    if op.example is None:
        raise ValueError(f"{op.name}: no example inputs for the self-check")
    args = op.example(dtype, device)
    results = []
    for fn in (op.reference, op.cpp()):
        if op.inplace:  # compare what it returns and every tensor it updated
            copied = [[t.clone() for t in a] if isinstance(a, list) else a for a in args]
            out = fn(*copied)
            results.append(([out] if isinstance(out, torch.Tensor) else [])
                           + [t for a in copied if isinstance(a, list) for t in a])
            continue
        leaves = [a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point()
                  else a for a in args]
        out = fn(*leaves)
        gen = torch.Generator().manual_seed(0)
        out.backward(torch.randn(out.shape, generator=gen).to(out.dtype).to(out.device))
        results.append([out] + [a.grad for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad])
    tol = TOLERANCES[dtype]
    for i, (ref, cpp) in enumerate(zip(*results)):
        what = f"tensor {i}" if op.inplace else "output" if i == 0 else f"gradient of argument {i - 1}"
        if not torch.allclose(cpp.float(), ref.float(), rtol=tol.rtol, atol=tol.atol):
            err = (cpp.float() - ref.float()).abs().max().item()
            raise ValueError(f"self-check: the C++ op {op.name} differs from its reference ({what}, max |diff| "
                             f"{err:.3g}, {dtype} on {device}); run the parity suite, or leave it out of --cpp_ops")
