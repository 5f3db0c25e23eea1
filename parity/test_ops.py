"""Generic parity over the op registry: for every op, dtype and device, C++ == reference on
hypothesis-drawn samples, forward and every gradient."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parity.harness import check_parity
from parity.samples import SAMPLES
from parity.strategies import devices, seeds
from v4train.ops import OPS

CPP_OPS = {name: op for name, op in OPS.items() if op.has_cpp}
CASES = [(name, dtype, device) for name, op in CPP_OPS.items() for dtype in op.dtypes for device in devices()]


def test_every_cpp_op_has_samples():
    assert sorted(SAMPLES) == sorted(CPP_OPS)


@pytest.mark.parametrize("name,dtype,device", CASES, ids=[f"{n}-{str(d).removeprefix('torch.')}-{v}" for n, d, v in CASES])
@given(data=st.data())
def test_parity(name, dtype, device, data):
    op = OPS[name]
    sample = data.draw(SAMPLES[name](dtype, device), label="sample")
    check_parity(op, sample, data.draw(seeds(), label="grad seed"))
