"""The at::Tensor bridge: the same tensor object, autograd history, optional tensors, errors."""

import pytest
import torch

import v4_bridge_test as bridge
from v4train.ops import OPS


def test_python_gets_back_the_very_same_tensor_object():
    x = torch.randn(3, requires_grad=True)
    assert bridge.identity(x) is x
    p = torch.nn.Parameter(torch.randn(2))
    assert bridge.identity(p) is p


def test_op_output_keeps_autograd_history_to_the_inputs():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    y = OPS["v4_rms_norm"].cpp()(x, w, 1e-6, False)
    assert y.grad_fn is not None and y.requires_grad
    (y * torch.arange(8.0)).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert w.grad is not None and w.grad.abs().sum() > 0


def test_graph_continues_through_cpp_into_python_ops():
    a = torch.randn(5, requires_grad=True)
    out = bridge.maybe_add(a * 2, a)  # python op -> C++ op -> backward through both
    out.sum().backward()
    assert torch.equal(a.grad, torch.full((5,), 3.0))


def test_optional_tensor_argument_and_undefined_result():
    x = torch.ones(3)
    assert torch.equal(bridge.maybe_add(x, torch.ones(3)), torch.full((3,), 2.0))
    assert bridge.maybe_add(x) is x
    assert bridge.maybe_add(x, None) is x
    assert bridge.undefined() is None


def test_non_tensor_argument_is_a_type_error_listing_the_signature():
    with pytest.raises(TypeError, match=r"identity\(arg: torch.Tensor, /\) -> torch.Tensor"):
        bridge.identity([1.0, 2.0])
    with pytest.raises(TypeError):
        bridge.identity(None)


@pytest.mark.parametrize(
    "call,exc,message",
    [
        (lambda: bridge.check_value(torch.zeros(3)), ValueError, "check_value: t must have 2 dimension(s), got shape [3]"),
        (bridge.torch_check, RuntimeError, "torch_check: plain TORCH_CHECK failed"),
        (bridge.index_error, IndexError, "index_error: out of range"),
        (bridge.std_error, RuntimeError, "std_error: a std::runtime_error"),
    ],
)
def test_cpp_errors_reach_python_with_their_message_and_no_backtrace(call, exc, message):
    with pytest.raises(exc) as info:
        call()
    assert str(info.value) == message
