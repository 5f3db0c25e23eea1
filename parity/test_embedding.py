"""v4_embedding: rows of the weight, gradients summed per id, an empty batch (bad ids: the error cases of its test case)."""

import pytest
import torch

from v4train.testing.compare import assert_close
from v4train.ops import OPS

OP = OPS["v4_embedding"]


def test_rows_and_summed_gradients():
    w = torch.randn(5, 3, requires_grad=True)
    ids = torch.tensor([[4, 0, 4], [1, 4, 2]])
    out = OP.cpp()(ids, w)
    assert torch.equal(out, w.detach()[ids])
    out.sum().backward()
    assert torch.equal(w.grad, torch.tensor([1.0, 1, 1, 0, 3])[:, None].expand(5, 3))


def test_empty_ids():
    assert_close(OP.cpp()(torch.zeros(0, dtype=torch.int64), torch.ones(5, 3)), torch.zeros(0, 3), "empty")
