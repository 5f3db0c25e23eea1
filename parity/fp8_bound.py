"""Elementwise error bounds for the C++ ops' FP8 path (a) on CUDA (issue 16), against the float64
truth. Path (a) is not exact against dequantise-then-linear: it rounds the activation to e4m3. Its
tolerance comes from that rounding's error bound, derived here, never from what a kernel gives.

Path (a) of y = x W^T (cc/common/fp8.cu; x bf16 [M, K], W the FP8 weight q_w times its fp32 128 x 128
scales s_w, K and N whole blocks). Per row m and block b of 128 columns, s = max(fl(amax / 448),
FLT_MIN) (1 for a zero block) and q = e4m3(fl(x / s)), nearest, saturating at 448. Then cuBLAS's
blockwise FP8 GEMM: per block, acc_b = the tensor cores' sum of the 128 exact products q q_w (two
e4m3 multiply exactly in fp32), y' = fl32(sum_b s_a s_w acc_b), y = bf16(y').

1. The activation, elementwise, in real arithmetic, x_hat = s q:
       |x_hat - x| <= UQ |x| + 2^-10 s,  UQ = 2^-4 + 2^-23.
   fl(x / s) is within 2^-24 of x / s relatively. e4m3 has 3 fraction bits: a normal value
   (|t| >= 2^-6) rounds within 2^-4 |t|; below 2^-6 the subnormals are 2^-9 apart, within 2^-10.
   Saturation: |fl(x / s)| <= amax / fl(amax / 448) <= 448 (1 + 2^-23), so 448 is within 2^-23.
2. The GEMM: |y' - x_hat W^T| <= G (|x_hat| |W|^T), elementwise, with
       G = g(127, 2^-13) + (1 + g(127, 2^-13)) g(K/128 + 1, 2^-24),  g(n, u) = n u / (1 - n u).
   The tensor cores' FP8 accumulation keeps about 14 bits (DeepSeek-V3 report, section 3.3.2: on
   Hopper "limited to retaining around 14 bits"), taken as a relative error of at most 2^-13 per
   addition; the block scales make cuBLAS promote each 128-column block's sum to fp32, so at most
   127 such additions chain (recursive summation: g(n-1, u) times the sum of magnitudes). Then fp32
   scaling and K/128 fp32 additions. This is the one modelled assumption; the rest is IEEE.
3. |x_hat| <= (1 + UQ) |x| + 2^-10 s, and output rounding: |y - y'| <= 2^-8 |y'|.
So, with A = |x| |W|^T, B = S |W|^T (S: each element's block scale), y* = x W^T in float64:
       E = UQ A + 2^-10 B + G ((1 + UQ) A + 2^-10 B),   |y - y*| <= E + 2^-8 (|y*| + E).
(The brief's K 2^-23 |x||W| fp32 term is inside G.) An input that is itself computed (an MLP's
down_proj takes silu(gate) * up in bf16) enters as a value within err of its truth: the bound is
then taken at the largest magnitude it can have, |truth| + err, plus err |W|^T (`Bounded`).

Path (b) products and the bf16 elementwise ops of the MLP bounded alike: a bf16 matmul with the
weight dequantised to bf16 (|W_b - W| <= UW |W|, UW = 2^-8 + 2^-23: an fp32 product, then bf16)
accumulates in fp32 (torch's bf16 reduced-precision reductions switched off where this is used:
`fp32_reductions`), so |fl(a W_b) - a* W| <= err_a |W_b| + UW |a*| |W| + g(K, 2^-24) |a| |W_b|,
then rounding; silu is 1.1-Lipschitz (its
derivative lies in [-0.0998, 1.0998]), its derivative 0.5-Lipschitz; a product of two bf16 values
is exact in fp32; each stored bf16 result adds 2^-8 of its magnitude.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from v4train.reference.lora import FP8_MAX, dequantize_fp8, quantize_fp8

BLOCK = 128
UQ = 2.0**-4 + 2.0**-23  # e4m3 rounding of a normal value, after fl(x / s)
SUB = 2.0**-10  # e4m3's subnormals: half their spacing, in units of the block scale
U8 = 2.0**-8  # bf16's unit roundoff
U24 = 2.0**-24  # fp32's
UW = U8 + 2.0**-23  # a weight dequantised to bf16: fp32 product, then bf16
FLT_MIN = torch.finfo(torch.float32).tiny
SILU_LIPSCHITZ = 1.1
SILU_PRIME_LIPSCHITZ = 0.5
FP32_FUNC = 2.0**-20  # fp32 evaluation of silu and its derivative (a few ulps), relative


def gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def gemm_factor(k: int) -> float:
    """G of the docstring's step 2 for an inner dimension k."""
    tc = gamma(BLOCK - 1, 2.0**-13)
    return tc + (1 + tc) * gamma(k // BLOCK + 1, U24)


def block_scales(x: torch.Tensor) -> torch.Tensor:
    """Path (a)'s activation scale of every element of x [M, K] (its 1 x 128 block's), float64."""
    m, k = x.shape
    amax = x.double().abs().view(m, k // BLOCK, BLOCK).amax(-1)
    s = torch.where(amax > 0, (amax / FP8_MAX * (1 + 2.0**-23)).clamp(min=FLT_MIN), torch.ones_like(amax))
    return s.repeat_interleave(BLOCK, -1)


def blocks_of_sizes(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 weight [..., n, k] (whole 128 x 128 blocks) and its scales, quantised as the checkpoints
    are, each block N(0, 0.05^2) times its own power of two, 1/8 to 8: test data on which a scale of
    the wrong block is far off (N(0, 1) blocks' scales differ by a few percent)."""
    *lead, n, k = shape
    w = torch.randn(*shape, generator=gen) * 0.05
    w *= (2.0 ** torch.randint(-3, 4, (*lead, n // BLOCK, k // BLOCK), generator=gen)).repeat_interleave(
        BLOCK, -2).repeat_interleave(BLOCK, -1)
    return quantize_fp8(w)


@dataclasses.dataclass
class Bounded:
    """A tensor an op computes: its exact value (float64) and a bound on |computed - exact|."""

    value: torch.Tensor
    err: torch.Tensor

    @staticmethod
    def exact(x: torch.Tensor) -> "Bounded":
        return Bounded(x.double(), torch.zeros_like(x, dtype=torch.float64))

    @property
    def mag(self) -> torch.Tensor:
        """A bound on the computed tensor's magnitude."""
        return self.value.abs() + self.err


def _stored_bf16(value: torch.Tensor, pre_err: torch.Tensor) -> Bounded:
    """A result within pre_err of value, rounded to bf16."""
    return Bounded(value, pre_err + U8 * (value.abs() + pre_err))


def fp8_linear(x: Bounded, q: torch.Tensor, scale: torch.Tensor) -> Bounded:
    """x W^T through path (a) (the docstring's bound), W = q times its 128 x 128 scales."""
    w = dequantize_fp8(q, scale, torch.float64)
    wa = w.abs()
    a = x.mag @ wa.T
    b = block_scales(x.mag) @ wa.T
    e = UQ * a + SUB * b + gemm_factor(q.shape[1]) * ((1 + UQ) * a + SUB * b)
    return _stored_bf16(x.value @ w.T, x.err @ wa.T + e)


def bf16_matmul(a: Bounded, w: torch.Tensor) -> Bounded:
    """a @ w (w exact, float64) through a bf16 GEMM with fp32 accumulation of w dequantised to bf16
    (fp32 product, then bf16: within UW |w|): path (b)."""
    wa = w.abs()
    wb = (1 + UW) * wa  # |w rounded to bf16|
    pre = a.err @ wb + UW * (a.value.abs() @ wa) + gamma(w.shape[0], U24) * (a.mag @ wb)
    return _stored_bf16(a.value @ w, pre)


def silu(g: Bounded) -> Bounded:
    value = torch.nn.functional.silu(g.value)
    pre = SILU_LIPSCHITZ * g.err
    return _stored_bf16(value, pre + FP32_FUNC * (value.abs() + pre))


def silu_backward(grad: Bounded, g: Bounded) -> Bounded:
    """grad * silu'(g), one fp32 evaluation rounded to bf16 (ATen's silu_backward)."""
    sig = torch.sigmoid(g.value)
    prime = sig * (1 + g.value * (1 - sig))
    pre = grad.err * SILU_LIPSCHITZ + grad.value.abs() * SILU_PRIME_LIPSCHITZ * g.err
    return _stored_bf16(grad.value * prime, pre + FP32_FUNC * grad.mag * SILU_LIPSCHITZ)


def mul(a: Bounded, b: Bounded) -> Bounded:
    return _stored_bf16(a.value * b.value, a.err * b.mag + a.value.abs() * b.err)


def add(a: Bounded, b: Bounded) -> Bounded:
    return _stored_bf16(a.value + b.value, a.err + b.err + U24 * (a.mag + b.mag))


@contextlib.contextmanager
def fp32_reductions():
    """cuBLAS's bf16 GEMMs with fp32 reductions only, as `bf16_matmul` models them: torch lets them
    round split-K partial sums to bf16 by default (allow_bf16_reduced_precision_reduction)."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


def assert_within(actual: torch.Tensor, bound: Bounded, name: str) -> float:
    """Fails unless |actual - truth| <= err elementwise; returns the largest |actual - truth| / err."""
    err = (actual.detach().double() - bound.value).abs()
    ratio = err / bound.err
    bad = ~(err <= bound.err)
    if bad.any():
        worst = int(torch.where(bad, ratio.nan_to_num(nan=float("inf")), torch.zeros_like(ratio)).argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {err.numel()} elements outside its bound; worst at {idx}: "
            f"actual={actual.reshape(-1)[worst].item():.9g} truth={bound.value.reshape(-1)[worst].item():.9g} "
            f"|error|={err.reshape(-1)[worst].item():.3g} bound={bound.err.reshape(-1)[worst].item():.3g}")
    return float(ratio.max())
