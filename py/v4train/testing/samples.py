"""The building blocks of every op's parity samples.

An op's `samples(draw, dtype, device)` returns a `Sample` and makes every choice through `draw`,
so that one definition serves two drivers: the parity suite draws through hypothesis (which
shrinks a failure to a small example; parity/strategies.py), the trainer's self-check through a
seeded `RandomDraw` (no hypothesis at run time).
"""

from __future__ import annotations

import random
from typing import Callable, Protocol, Sequence, TypeVar

import torch

from v4train.reference.lora import adapter_names, quantize_fp8, scale_name
T = TypeVar("T")

# Sizes that break kernels: 1, odd, one off a power of two, non-multiples of 8/16/64.
AWKWARD_SIZES = (1, 2, 3, 5, 7, 15, 17, 31, 33, 63, 65, 100, 127, 129, 255, 257)

# How a tensor argument is laid out: contiguous, a transposed view, every other element, or one
# column repeated with stride 0 (an expanded view: read-only, an in-place op must refuse it).
LAYOUTS = ("contiguous", "transposed", "strided", "expanded")
WRITABLE_LAYOUTS = LAYOUTS[:3]


class Draw(Protocol):
    def integers(self, lo: int, hi: int) -> int: ...  # in [lo, hi]

    def sampled_from(self, options: Sequence[T]) -> T: ...

    def booleans(self) -> bool: ...


class RandomDraw:
    """A Draw from a seeded random.Random (the self-check's)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def integers(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def sampled_from(self, options):
        return options[self.rng.randrange(len(options))]

    def booleans(self) -> bool:
        return self.rng.random() < 0.5


def size(draw: Draw, max_size: int) -> int:
    """A dimension size in [1, max_size], awkward sizes weighted up."""
    awkward = [s for s in AWKWARD_SIZES if s <= max_size]
    return draw.sampled_from(awkward) if draw.booleans() else draw.integers(1, max_size)


def width(draw: Draw, max_size: int, dtype: torch.dtype) -> int:
    """A width that gradients sum over, for a layer op's samples: from 1 in float64 (where the
    suite checks the math), from 4 in lower precision, where a sum of one to three rounded terms
    can cancel to anything and no comparison can judge it."""
    return size(draw, max_size) if dtype == torch.float64 else 3 + size(draw, max_size - 3)


def kernel_width(draw: Draw, max_size: int, dtype: torch.dtype) -> int:
    """A width that is a multiple of 8 (up to max_size) half the time, which the MoE's CUDA kernels
    take (cc/common/experts.cu: the SwiGLU and the combine), else `width`."""
    return 8 * draw.integers(1, max_size // 8) if draw.booleans() else width(draw, max_size, dtype)


def shape(draw: Draw, min_dims: int, max_dims: int, max_size: int) -> tuple[int, ...]:
    return tuple(size(draw, max_size) for _ in range(draw.integers(min_dims, max_dims)))


def layout(draw: Draw, writable: bool = False) -> str:
    """A layout for an argument; `writable` for one an op updates in place."""
    return draw.sampled_from(WRITABLE_LAYOUTS if writable else LAYOUTS)


def lora_dropout(draw: Draw, checkpoint: bool, device) -> float:
    """A layer sample's LoRA dropout: drawn > 0 only where the layer checkpoints (the recomputation
    must replay the first pass's masks) and on the CPU, where a mask is the same in every dtype
    (the parity run seeds each implementation alike; CUDA's fused dropout draws per dtype)."""
    return draw.sampled_from([0.0, 0.25]) if checkpoint and torch.device(device).type == "cpu" else 0.0


def checkpoint_block(draw: Draw, checkpoint: bool, dropout: float, tokens: int) -> int:
    """A layer sample's LayerOptions.checkpoint_block: where the layer checkpoints, a few tokens,
    so that its MLP or MoE runs, recomputes and differentiates in several blocks, or 0 (one block
    at these sizes). Not with dropout, whose masks the blocks draw in another order than the
    reference's whole pass (the recomputation's replay of them: test_layers_cpp's gradcheck)."""
    return draw.integers(1, max(1, tokens - 1)) if checkpoint and dropout == 0 and draw.booleans() else 0


def seed(draw: Draw) -> int:
    return draw.integers(0, 2**31 - 1)


def make_leaf(shape_: tuple[int, ...], layout_: str, dtype: torch.dtype, device, seed_: int,
              scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """The contiguous leaf behind an argument of `shape_` in `layout_` (see `view_as_layout`).

    Values are shift + scale * N(0, 1) from a generator seeded by `seed_`.
    """
    storage_shape = {
        "contiguous": shape_,
        # Transposing the last two dims of a [.., b, a] leaf gives a [.., a, b] view.
        "transposed": shape_[:-2] + shape_[-2:][::-1] if len(shape_) >= 2 else shape_,
        # Every other element of the last dim.
        "strided": shape_[:-1] + (2 * shape_[-1],) if shape_ else shape_,
        "expanded": shape_,  # the view repeats its first column
    }[layout_]
    gen = torch.Generator().manual_seed(seed_)
    values = torch.randn(storage_shape, generator=gen, dtype=torch.float32) * scale + shift
    return values.to(dtype=dtype, device=device)


def view_as_layout(leaf: torch.Tensor, layout_: str) -> torch.Tensor:
    """The op argument: a (differentiable) view of `leaf`, non-contiguous unless `contiguous`."""
    if layout_ == "transposed" and leaf.dim() >= 2:
        return leaf.transpose(-1, -2)
    if layout_ == "strided" and leaf.dim() >= 1:
        return leaf[..., ::2]
    if layout_ == "expanded" and leaf.dim() >= 1:
        return leaf[..., :1].expand(leaf.shape)
    return leaf


class Sample:
    """One drawn input of an op.

    leaves: the tensors gradients are taken for (every floating input); parity compares the
      gradient of each, and for in-place ops the value each is left with.
    build: leaves -> (args, kwargs) for the op, making the views and adding the other arguments.
    reroute: (args, kwargs, the C++ op's first output, the seed its run started from) -> the
      reference routing a layer's MoE as the C++ ops did, where they routed each token as the
      references did or otherwise only at a near-tie, or None (v4train.testing.ties.rerouted).
    """

    def __init__(self, leaves: dict[str, torch.Tensor],
                 build: Callable[[dict[str, torch.Tensor]], tuple[tuple, dict]], note: str = "",
                 reroute: Callable[[tuple, dict, torch.Tensor, int], Callable | None] | None = None):
        self.leaves, self.build, self.note, self.reroute = leaves, build, note, reroute

    def __repr__(self) -> str:
        shapes_ = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.leaves.items())
        return f"Sample({shapes_}; {self.note})"


def weight_leaves(draw: Draw, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device, seed_: int,
                  scale: float = 0.3) -> tuple[dict[str, torch.Tensor], float]:
    """A layer's weights by name (N(0, scale^2)), and on a drawn subset of those ending in
    ".weight" or fused expert tensors, LoRA adapters of a drawn rank beside them (A and B both
    random, so the adapters change the output); a quarter of them quantised as FP8
    checkpoints store them (float8_e4m3fn with its 128 x 128-block weight_scale_inv beside it: a
    frozen base, which the ops dequantise). Returns (tensors, the LoRA scaling drawn)."""

    rank = draw.sampled_from([1, 2, 4])
    scaling = draw.sampled_from([0.5, 2.0])
    out = {}
    for i, (name, shape_) in enumerate(shapes.items()):
        out[name] = make_leaf(shape_, "contiguous", dtype, device, seed_ + 3 * i, scale=scale)
        if len(shape_) >= 2 and draw.booleans():
            *lead, n_out, n_in = shape_
            a, b = adapter_names(name)
            out[a] = make_leaf((*lead, rank, n_in), "contiguous", dtype, device, seed_ + 3 * i + 1, scale=scale)
            out[b] = make_leaf((*lead, n_out, rank), "contiguous", dtype, device, seed_ + 3 * i + 2, scale=scale)
        if len(shape_) >= 2 and (seed_ + i) % 4 == 3:  # by the seed: no draw, so the other draws stay as they were
            out[name], out[scale_name(name)] = quantize_fp8(out[name])
    return out, scaling


FP8_DTYPES = (torch.float8_e4m3fn,)


def takes_gradient(name: str, leaves: dict[str, torch.Tensor]) -> bool:
    """Whether parity differentiates the leaf `name`: every floating one but an FP8 weight and its
    scales, a frozen base (the ops refuse to differentiate one)."""
    t = leaves[name]
    if not t.is_floating_point() or t.dtype in FP8_DTYPES:
        return False
    base = name.removesuffix("_scale_inv")
    return not (base != name and base in leaves and leaves[base].dtype in FP8_DTYPES)
