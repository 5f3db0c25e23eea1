"""--cpp_ops selection: each op switches between its C++ entry and its reference."""

import pytest
import torch

import v4_rms_norm
from v4train import ops
from v4train.ops.registry import dispatch

OP = ops.OPS["v4_rms_norm"]


@pytest.fixture(autouse=True)
def _reset():
    yield
    ops.select_cpp_ops("none")


def test_default_is_the_reference():
    assert dispatch(OP) is OP.reference


@pytest.mark.parametrize("spec", ["all", "v4_rms_norm", "rms_norm", " rms_norm , "])
def test_selecting_an_op_routes_it_to_cpp(spec):
    assert "v4_rms_norm" in ops.select_cpp_ops(spec)
    assert dispatch(OP) is v4_rms_norm.v4_rms_norm
    x = torch.randn(2, 4, requires_grad=True)
    assert ops.v4_rms_norm(x, torch.ones(4), 1e-6).grad_fn.name() == "torch::autograd::CppNode<v4::RmsNorm>"


def test_none_goes_back_to_the_reference():
    ops.select_cpp_ops("all")
    assert ops.select_cpp_ops("none") == set()
    assert dispatch(OP) is OP.reference


def test_unknown_op_names_the_flag_and_the_choices():
    with pytest.raises(ValueError, match=r"--cpp_ops: unknown op\(s\) v4_nope; expected 'all', 'none' or a comma list of v4_adam_step, "):
        ops.select_cpp_ops("rms_norm,nope")


def test_ops_without_cpp_are_refused_by_name_and_skipped_by_all():
    with pytest.raises(ValueError, match=r"--cpp_ops: v4_glm5_layer_forward has no C\+\+ implementation yet"):
        ops.select_cpp_ops("glm5_layer_forward")
    assert ops.select_cpp_ops("all") == {"v4_rms_norm", "v4_adam_step", "v4_clip_grad_norm", "v4_cross_entropy_loss",
                                         "v4_embedding"}
