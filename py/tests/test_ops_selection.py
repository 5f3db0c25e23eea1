"""--cpp_ops resolves once into an OpTable: each op on its C++ entry or its reference, the choice
held by the run (no global state), composite ops' building blocks following the same table."""

import pytest
import torch

import v4_rms_norm
from golden_cases import golden
from v4train import hf_checkpoint, ops
from v4train.model import Packed
from v4train.op import Op, parse_cpp_ops


def test_reference_table_is_every_reference():
    assert ops.REFERENCE.cpp == frozenset()
    assert ops.REFERENCE.v4_rms_norm is ops.OPS["v4_rms_norm"].reference


@pytest.mark.parametrize("spec", ["all", "v4_rms_norm", "rms_norm", " rms_norm , "])
def test_selecting_an_op_routes_it_to_cpp(spec):
    table = ops.resolve(spec)
    assert "v4_rms_norm" in table.cpp
    assert table.v4_rms_norm is v4_rms_norm.v4_rms_norm
    x = torch.randn(2, 4, requires_grad=True)
    assert table.v4_rms_norm(x, torch.ones(4), 1e-6).grad_fn.name() == "torch::autograd::CppNode<v4::RmsNorm>"
    assert ops.REFERENCE.v4_rms_norm is ops.OPS["v4_rms_norm"].reference, "other tables are untouched"


def test_none_is_the_reference():
    assert ops.resolve("none").cpp == frozenset()


def test_unknown_op_names_the_flag_and_the_choices():
    with pytest.raises(ValueError, match=r"--cpp_ops: unknown op\(s\) v4_nope; expected 'all', 'none' or a comma list of v4_adam_step, "):
        ops.resolve("rms_norm,nope")


def test_ops_without_cpp_are_refused_by_name_and_skipped_by_all():
    """Every op has C++ today; an op added with its reference only (has_cpp=False) is refused by
    name and left out of 'all'."""
    known = {**ops.OPS, "v4_toy": Op("v4_toy", lambda x: x, has_cpp=False)}
    with pytest.raises(ValueError, match=r"--cpp_ops: v4_toy has no C\+\+ implementation yet"):
        parse_cpp_ops("rms_norm,toy", known)
    assert parse_cpp_ops("all", known) == set(ops.OPS)
    assert ops.resolve("all").cpp == {n for n, op in ops.OPS.items() if op.has_cpp}


@pytest.mark.parametrize("case,norms", [("glm5", 4 * 4 + 1), ("qwen3_5_moe", 4 * 2 + 2 + 1)])
def test_every_norm_of_a_forward_follows_the_table(case, norms, monkeypatch):
    """The layer references call their building blocks through the run's table: with rms_norm in
    C++, every RMSNorm of the forward (decoder, latent and q/k norms, final) runs the C++ op."""
    calls = {"cpp": 0, "reference": 0}
    cpp, ref = v4_rms_norm.v4_rms_norm, ops.OPS["v4_rms_norm"].reference
    model, _ = hf_checkpoint.load(golden(case)[0])
    for name, fn, spec in (("cpp", cpp, "rms_norm"), ("reference", ref, "none")):
        table = ops.resolve(spec)
        counted = lambda *a, _fn=fn, _name=name, **k: calls.__setitem__(_name, calls[_name] + 1) or _fn(*a, **k)  # noqa: E731
        monkeypatch.setattr(table, "v4_rms_norm", counted)
        model.use_ops(table)
        with torch.no_grad():
            model.logits(Packed.from_documents([[1, 2, 3, 4, 5]]))
    assert calls == {"cpp": norms, "reference": norms}, calls


def test_an_op_registered_half_way_is_named_with_the_list_it_is_missing_from(monkeypatch):
    """What a kernel developer sees when one step of "Adding an op" is missing (a QA pass found bare
    KeyErrors and AttributeErrors)."""
    import sys
    import types

    from v4train.op import CppOpUnavailable, Op
    from v4train.ops import OPS

    with pytest.raises(KeyError, match=r"v4_nope: no Op record in OPS .*add Op\(\"v4_nope\""):
        OPS["v4_nope"]
    monkeypatch.setitem(sys.modules, "v4_nope", types.ModuleType("v4_nope"))  # built, its binding misnamed
    with pytest.raises(CppOpUnavailable, match=r"the C\+\+ module v4_nope defines no function v4_nope"):
        Op("v4_nope", lambda x: x).cpp()


@pytest.mark.parametrize("spec", ["", " ", ","])
def test_an_empty_cpp_ops_is_refused_not_read_as_none(spec):
    with pytest.raises(ValueError, match="--cpp_ops is empty; expected 'all', 'none' or a comma list"):
        parse_cpp_ops(spec, ops.OPS)
    assert parse_cpp_ops("none", ops.OPS) == set()
