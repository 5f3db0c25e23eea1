"""Hypothesis strategies shared by every parity test, and the suite's hypothesis profiles.

Profiles: `ci` (the default) is deterministic (derandomize, no example database) with 60
examples per test; `wide` draws fresh random examples, 1000 per test, for kernel work. Pick one
with V4TRAIN_HYPOTHESIS_PROFILE=wide (Bazel passes the variable through to tests).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

_COMMON = dict(deadline=None, print_blob=True, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=60, derandomize=True, **_COMMON)
settings.register_profile("wide", max_examples=1000, derandomize=False, **_COMMON)
PROFILE = os.environ.get("V4TRAIN_HYPOTHESIS_PROFILE") or "ci"
if PROFILE not in ("ci", "wide"):
    raise ValueError(f"V4TRAIN_HYPOTHESIS_PROFILE={PROFILE!r}: expected 'ci' or 'wide'")
settings.load_profile(PROFILE)

# Sizes that break kernels: 1, odd, one off a power of two, non-multiples of 8/16/64.
AWKWARD_SIZES = (1, 2, 3, 5, 7, 15, 17, 31, 33, 63, 65, 100, 127, 129, 255, 257)


def devices() -> list[str]:
    """The devices parity runs on: the CPU, and CUDA where there is one."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def sizes(max_size: int) -> st.SearchStrategy[int]:
    """A dimension size in [1, max_size], awkward sizes weighted up."""
    return st.one_of(st.sampled_from([s for s in AWKWARD_SIZES if s <= max_size]), st.integers(1, max_size))


def shapes(min_dims: int, max_dims: int, max_size: int) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(sizes(max_size), min_size=min_dims, max_size=max_dims).map(tuple)


LAYOUTS = ("contiguous", "transposed", "strided")


def layouts() -> st.SearchStrategy[str]:
    """How a tensor argument is laid out: contiguous, a transposed view, or a strided slice."""
    return st.sampled_from(LAYOUTS)


def make_leaf(shape: tuple[int, ...], layout: str, dtype: torch.dtype, device: str, seed: int,
              scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """The contiguous leaf behind an argument of `shape` in `layout` (see `view_as_layout`).

    Values are shift + scale * N(0, 1) from a generator seeded by `seed`.
    """
    storage_shape = {
        "contiguous": shape,
        # Transposing the last two dims of a [.., b, a] leaf gives a [.., a, b] view.
        "transposed": shape[:-2] + shape[-2:][::-1] if len(shape) >= 2 else shape,
        # Every other element of the last dim.
        "strided": shape[:-1] + (2 * shape[-1],) if shape else shape,
    }[layout]
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(storage_shape, generator=gen, dtype=torch.float32) * scale + shift
    return values.to(dtype=dtype, device=device)


def view_as_layout(leaf: torch.Tensor, layout: str) -> torch.Tensor:
    """The op argument: a (differentiable) view of `leaf`, non-contiguous unless `contiguous`."""
    if layout == "transposed" and leaf.dim() >= 2:
        return leaf.transpose(-1, -2)
    if layout == "strided" and leaf.dim() >= 1:
        return leaf[..., ::2]
    return leaf


class Sample:
    """One drawn input of an op.

    leaves: the tensors gradients are taken for (every floating input); the parity test
      compares the gradient of each.
    build: leaves -> (args, kwargs) for the op, making the views and adding the scalars.
    """

    def __init__(self, leaves: dict[str, torch.Tensor],
                 build: Callable[[dict[str, torch.Tensor]], tuple[tuple, dict]], note: str = ""):
        self.leaves, self.build, self.note = leaves, build, note

    def __repr__(self) -> str:
        shapes_ = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.leaves.items())
        return f"Sample({shapes_}; {self.note})"


def seeds() -> st.SearchStrategy[int]:
    return st.integers(0, 2**31 - 1)
