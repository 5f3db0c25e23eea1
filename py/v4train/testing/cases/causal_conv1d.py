"""v4_causal_conv1d: Gated DeltaNet's depthwise causal conv + SiLU over packed documents."""

import torch

from v4train.testing.cases.mla_dsa_attention import packed
from v4train.ops import OPS
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import Sample, layout, make_leaf, seed, size, view_as_layout
from v4train.reference.causal_conv1d import v4_causal_conv1d


def kernel_documents(draw, kernel: int) -> list[int]:
    """Document lengths around the kernel size (shorter than its reach, equal, longer), and empty ones."""
    return [draw.sampled_from([0, 1, kernel - 1, kernel, kernel + 1, size(draw, 70)]) for _ in range(draw.integers(1, 4))]


def samples(draw, dtype: torch.dtype, device) -> Sample:
    kernel = draw.integers(1, 4)
    lengths = kernel_documents(draw, kernel)
    channels, x_layout, s = size(draw, 40), layout(draw), seed(draw)
    T = sum(lengths)
    _, cu = packed(lengths, device)
    leaves = {"x": make_leaf((T, channels), x_layout, dtype, device, s),
              "weight": make_leaf((channels, 1, kernel), "contiguous", dtype, device, s + 1, scale=0.5)}

    def build(lv):
        return (view_as_layout(lv["x"], x_layout), lv["weight"], cu.to(device)), {}

    return Sample(leaves, build, note=f"documents {lengths}, kernel {kernel}, x layout {x_layout}")


def _bench(device, dtype, tokens=4096):
    """Qwen3.5-MoE's conv over q, k, v (16 key heads x 128 x 2 + 32 value heads x 128), kernel 4."""
    x = torch.randn(tokens, 8192, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(8192, 1, 4, device=device, dtype=dtype, requires_grad=True)
    return f"x [{tokens}, 8192], kernel 4", (x, w, torch.tensor([0, tokens], device=device))


def _call(x=lambda: torch.zeros(5, 8), w=lambda: torch.ones(8, 1, 4), cu=lambda: torch.tensor([0, 5])):
    return lambda: (x(), w(), cu())


CASE = OpCase(
    OPS["v4_causal_conv1d"], samples=samples, benchmarks=(_bench,),
    errors=(
        ErrorCase("integer x", _call(x=lambda: torch.zeros(5, 8, dtype=torch.int64)), "x must be"),
        ErrorCase("weight of the wrong shape", _call(w=lambda: torch.ones(8, 4)),
                  "weight has shape [8, 4], expected [C=8, 1, kernel size]"),
        ErrorCase("cu_seqlens not ending at T", _call(cu=lambda: torch.tensor([0, 4])), "cu_seqlens must end at T=5, got [0, 4]"),
    ),
)
