"""v4_embedding: rows of the weight, gradients summed per id, clear errors for bad ids."""

import pytest
import torch

from parity.compare import assert_close
from v4train.ops import OPS

OP = OPS["v4_embedding"]


def test_rows_and_summed_gradients():
    w = torch.randn(5, 3, requires_grad=True)
    ids = torch.tensor([[4, 0, 4], [1, 4, 2]])
    out = OP.cpp()(ids, w)
    assert torch.equal(out, w.detach()[ids])
    out.sum().backward()
    assert torch.equal(w.grad, torch.tensor([1.0, 1, 1, 0, 3])[:, None].expand(5, 3))


@pytest.mark.parametrize("ids,message", [
    (torch.tensor([0, 5]), "input_ids must lie in [0, 5), got [0, 5]"),
    (torch.tensor([-1, 2]), "input_ids must lie in [0, 5), got [-1, 2]"),
    (torch.tensor([0, 1], dtype=torch.int32), "input_ids must be int64"),
])
def test_bad_ids_raise_value_error(ids, message):
    with pytest.raises(ValueError, match="^v4_embedding: ") as info:
        OP.cpp()(ids, torch.zeros(5, 3))
    assert message in str(info.value)


def test_empty_ids():
    assert_close(OP.cpp()(torch.zeros(0, dtype=torch.int64), torch.ones(5, 3)), torch.zeros(0, 3), "empty")
