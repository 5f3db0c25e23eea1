"""Where rounding at a router near-tie sends a token of a layer op's MoE to another expert in the
C++ ops than in the references, the layer is judged against the reference routed as the C++ ops
routed (v4train.ops.ties): the correct layer passes there, a wrong one still fails."""

import pytest
import torch

from v4train.ops import OPS, REFERENCE
from v4train.ops.check import check_parity
from v4train.ops.samples import RandomDraw, Sample

NAME = "v4_qwen3_5_layer_forward"
OP = OPS[NAME]


def _wrong(*args, **kwargs):
    out = OP.cpp()(*args, **kwargs)
    return (out[0] * 1.3,) + tuple(out[1:])


def _flips(sample) -> bool:
    args, kwargs = sample.build({k: v.detach() for k, v in sample.leaves.items()})
    with torch.no_grad():
        out = OP.cpp()(*args, **kwargs)[0]
    return sample.reroute(args, kwargs, out) is not None


def _moe_samples():
    """bf16 MoE samples of the op's own strategy: (those whose routing the C++ ops' rounding
    changes, those it does not). About one in ten changes on this CPU."""
    samples = [OP.samples(RandomDraw(i), torch.bfloat16, "cpu") for i in range(60)]
    flipped = [(s, _flips(s)) for s in samples if s.reroute is not None]
    return [s for s, f in flipped if f], [s for s, f in flipped if not f]


FLIPS, ALIKE = _moe_samples()


def test_a_routing_flip_is_judged_with_the_cpp_ops_routing():
    assert FLIPS, "no sample of 60 routes otherwise: the case this mechanism exists for is not exercised"
    sample = FLIPS[0]
    check_parity(OP, OP.cpp(), REFERENCE[NAME], sample, 0)
    # Judged against the references' own routing instead, the correct layer fails there.
    plain = Sample(sample.leaves, sample.build, sample.note)
    with pytest.raises(AssertionError):
        check_parity(OP, OP.cpp(), REFERENCE[NAME], plain, 0)
    with pytest.raises(AssertionError):
        check_parity(OP, _wrong, REFERENCE[NAME], sample, 0)


def test_without_a_flip_a_wrong_layer_fails():
    sample = ALIKE[0]
    check_parity(OP, OP.cpp(), REFERENCE[NAME], sample, 0)
    with pytest.raises(AssertionError):
        check_parity(OP, _wrong, REFERENCE[NAME], sample, 0)


@pytest.mark.parametrize("name", ["v4_glm5_layer_forward", "v4_qwen3_5_layer_forward"])
def test_the_reference_takes_the_routing_it_is_given(name):
    """ties._table hands each MoE call of a layer's reference the routing given (GLM-5's layer
    passes its own `routing` argument positionally, Qwen3.5's not at all)."""
    from v4train.ops import ties

    op = OPS[name]
    sample = next(s for s in (op.samples(RandomDraw(i), torch.float32, "cpu") for i in range(40)) if s.reroute)
    args, kwargs = sample.build({k: v.detach() for k, v in sample.leaves.items()})
    natural = []
    with torch.no_grad():
        op.reference(*args, **kwargs, ops=ties._table(REFERENCE, None, natural))
    experts = natural[0].max().item() + 1
    given = [(r + 1) % max(experts, 2) for r in natural]
    seen = []
    with torch.no_grad():
        op.reference(*args, **kwargs, ops=ties._table(REFERENCE, given, seen))
    assert [s.sort(-1).values.tolist() for s in seen] == [g.sort(-1).values.tolist() for g in given]
