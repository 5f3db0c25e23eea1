"""v4_rms_norm: RMSNorm over the last dim in fp32 (plain: GLM-5; zero-centred: Qwen3.5)."""

import torch

from v4train.ops import OPS
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import Sample, layout, make_leaf, seed, shape, size, view_as_layout
from v4train.reference.rms_norm import v4_rms_norm


def samples(draw, dtype: torch.dtype, device) -> Sample:
    lead = shape(draw, 0, 3, 9)
    # Half the rows a multiple of 8 wide, which the CUDA kernels take (rms_norm.cu; 2056: past one
    # 16-byte pack a thread, a partial second); the rest awkward widths, ATen's.
    hidden = draw.sampled_from([8 * size(draw, 37), 2056]) if draw.booleans() else size(draw, 300)
    x_layout = layout(draw)
    # Weights are kept in fp32 under mixed precision as often as in the activation dtype.
    w_dtype = draw.sampled_from([dtype, torch.float32])
    zero_centered = draw.booleans()
    eps = draw.sampled_from([1e-6, 1e-5])
    s = seed(draw)
    x = make_leaf(lead + (hidden,), x_layout, dtype, device, s, scale=draw.sampled_from([1.0, 30.0]))
    w = make_leaf((hidden,), "contiguous", w_dtype, device, s + 1, scale=0.5, shift=0.0 if zero_centered else 1.0)

    def build(leaves):
        return (view_as_layout(leaves["x"], x_layout), leaves["weight"], eps, zero_centered), {}

    return Sample(leaves={"x": x, "weight": w}, build=build,
                  note=f"x layout {x_layout}, eps {eps}, zero_centered {zero_centered}")


def _bench(device, dtype):
    x = torch.randn(4096, 6144, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(6144, device=device, dtype=dtype, requires_grad=True)
    return "x [4096, 6144], weight [6144]", (x, w, 1e-6, False)


_X, _W = (lambda: torch.zeros(2, 8)), (lambda: torch.ones(8))
CASE = OpCase(
    OPS["v4_rms_norm"], samples=samples, benchmarks=(_bench,),
    errors=(
        ErrorCase("integer x", lambda: (torch.zeros(2, 8, dtype=torch.int64), _W(), 1e-6, False),
                  "x must be float32, bfloat16, float16 or float64, got Long"),
        ErrorCase("integer weight", lambda: (_X(), torch.ones(8, dtype=torch.int32), 1e-6, False),
                  "weight must be float32, bfloat16, float16 or float64"),
        ErrorCase("2-D weight", lambda: (_X(), torch.ones(2, 8), 1e-6, False), "weight must have 1 dimension(s), got shape [2, 8]"),
        ErrorCase("weight of the wrong size", lambda: (_X(), torch.ones(7), 1e-6, False),
                  "weight.size(0) must be x.size(-1) = 8, got shape [7]"),
        ErrorCase("scalar x", lambda: (torch.zeros(()), torch.ones(1), 1e-6, False), "x must have at least 1 dimension(s)"),
        ErrorCase("eps 0", lambda: (_X(), _W(), 0.0, False), "eps must be a finite number > 0, got 0"),
        ErrorCase("eps NaN", lambda: (_X(), _W(), float("nan"), False), "eps must be a finite number > 0"),
    ),
)
