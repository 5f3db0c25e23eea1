"""The layer ops' samples set aside a failed comparison only where the C++ ops and the references
route a token differently (v4train.ops.ties), and a wrong layer is still caught elsewhere."""

import pytest
import torch

from v4train.ops import OPS, REFERENCE
from v4train.ops.check import NearTie, check_parity
from v4train.ops.samples import RandomDraw

NAME = "v4_qwen3_5_layer_forward"
# bf16 MoE samples of the op's own strategy: seed 9 routes token 75 to another expert on the C++
# ops' rounding of the router input (a near-tie), seed 8 routes every token alike.
FLIP, ALIKE = 9, 8


def _sample(seed):
    sample = OPS[NAME].samples(RandomDraw(seed), torch.bfloat16, "cpu")
    assert sample.near_tie is not None, "an MoE sample"
    return sample


def _tie(sample):
    return sample.near_tie(*sample.build({k: v.detach() for k, v in sample.leaves.items()}))


def _wrong(*args, **kwargs):
    out = OPS[NAME].cpp()(*args, **kwargs)
    return (out[0] * 1.3,) + tuple(out[1:])


def test_a_routing_flip_is_found_and_the_sample_set_aside():
    assert "routes token 75 to experts [0] on the references' input and [3]" in _tie(_sample(FLIP))
    with pytest.raises(NearTie):
        check_parity(OPS[NAME], OPS[NAME].cpp(), REFERENCE[NAME], _sample(FLIP), FLIP)


def test_without_a_flip_a_wrong_layer_fails():
    sample = _sample(ALIKE)
    assert _tie(sample) == ""
    check_parity(OPS[NAME], OPS[NAME].cpp(), REFERENCE[NAME], sample, ALIKE)
    with pytest.raises(AssertionError) as info:
        check_parity(OPS[NAME], _wrong, REFERENCE[NAME], sample, ALIKE)
    assert not isinstance(info.value, NearTie)
