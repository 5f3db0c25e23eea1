"""v4_clip_grad_norm against torch.nn.utils.clip_grad_norm_."""

import pytest
import torch

from v4train.testing.compare import assert_close
from v4train.ops import OPS

OP = OPS["v4_clip_grad_norm"]


@pytest.mark.parametrize("impl", ["reference", "cpp"])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_matches_torch_clip_grad_norm(impl, max_norm):
    fn = OP.reference if impl == "reference" else OP.cpp()
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(5, 4), (9,), (2, 3, 4)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    grads = [p.grad.clone() for p in params]
    expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = fn(grads, max_norm)
    assert_close(norm, expected_norm, "norm")
    for i, (g, p) in enumerate(zip(grads, params)):
        assert_close(g, p.grad, f"grad {i}")


def test_zero_max_norm_measures_without_clipping():
    grads = [torch.full((4,), 3.0)]
    assert_close(OP.cpp()(grads, 0.0), torch.tensor(6.0), "norm")
    assert torch.equal(grads[0], torch.full((4,), 3.0))
