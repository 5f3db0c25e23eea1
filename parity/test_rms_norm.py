"""v4_rms_norm beyond the generic parity: hand-computed values, dtypes, edge cases."""

import math

import pytest
import torch

from v4train.testing.compare import assert_close
from parity.strategies import devices
from v4train.ops import OPS, REFERENCE
from v4train.testing.cases import CASES
from v4train.testing.check import check_parity
from v4train.testing.samples import Sample

OP = OPS["v4_rms_norm"]
IMPLS = {"reference": OP.reference, "cpp": OP.cpp()}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("device", devices())
def test_hand_computed_values(impl, device):
    # Row [3, 4]: mean of squares 12.5. Row [1, -1]: 1.
    x = torch.tensor([[3.0, 4.0], [1.0, -1.0]], device=device)
    w = torch.tensor([2.0, 0.5], device=device)
    eps = 1e-6
    r0, r1 = 1 / math.sqrt(12.5 + eps), 1 / math.sqrt(1 + eps)
    plain = torch.tensor([[3 * r0 * 2, 4 * r0 * 0.5], [r1 * 2, -r1 * 0.5]], device=device)
    centred = torch.tensor([[3 * r0 * 3, 4 * r0 * 1.5], [r1 * 3, -r1 * 1.5]], device=device)
    assert_close(IMPLS[impl](x, w, eps, False), plain, "plain")
    assert_close(IMPLS[impl](x, w, eps, True), centred, "zero_centered")


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_against_float64_autograd(impl):
    # Independent of both implementations: autograd of the formula in float64.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 37, generator=gen)
    w = torch.randn(37, generator=gen)
    g = torch.randn(5, 37, generator=gen)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    (x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-5) * (1 + w64)).backward(g.double())
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    IMPLS[impl](xs, ws, 1e-5, True).backward(g)
    assert_close(xs.grad, x64.grad.float(), "grad x")
    assert_close(ws.grad, w64.grad.float(), "grad weight")


@pytest.mark.parametrize("impl", IMPLS)
def test_mixed_precision_dtypes(impl):
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(16, dtype=torch.float32, requires_grad=True)
    y = IMPLS[impl](x, w, 1e-6, False)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


def test_zero_centered_is_plain_with_weight_plus_one():
    x = torch.randn(3, 8)
    w = torch.randn(8)
    cpp = IMPLS["cpp"]
    assert torch.equal(cpp(x, w, 1e-6, True), cpp(x, w + 1, 1e-6, False))


def test_no_rows():
    x = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    y = IMPLS["cpp"](x, w, 1e-6, False)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros(8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mismatch():
    with pytest.raises(ValueError, match="weight is on cpu but x is on cuda"):
        IMPLS["cpp"](torch.zeros(2, 8, device="cuda"), torch.ones(8), 1e-6, False)


@pytest.mark.parametrize("device,dtype,H", [(d, t, H) for d in devices() for t in (torch.float32, torch.bfloat16)
                                            for H in (8, 2056, 6144)])
@pytest.mark.parametrize("zero_centered", (False, True))
def test_widths_the_cuda_kernels_take(device, dtype, H, zero_centered):
    """On CUDA, rows a multiple of 8 wide run the kernels of rms_norm.cu (a block a row; 2056 is one
    16-byte pack a thread and part of a second, 6144 GLM-5's width): x a [2, 19, H] view of a wider
    tensor, the weight in float32; judged as the drawn samples are (check_parity)."""
    gen = torch.Generator().manual_seed(H)
    leaves = {"x": (torch.randn(2, 19, H + 8, generator=gen) * 3).to(device=device, dtype=dtype),
              "weight": (torch.randn(H, generator=gen) * 0.5).to(device)}
    sample = Sample(leaves, lambda lv: ((lv["x"][..., 4:H + 4], lv["weight"], 1e-6, zero_centered), {}))
    check_parity(CASES["v4_rms_norm"], IMPLS["cpp"], REFERENCE["v4_rms_norm"], sample, seed=H)
