"""Registry-driven tests of every op: parity of the C++ entry with the pure reference (forward and
every gradient, or every tensor an in-place op updates) on hypothesis-drawn samples, per op,
dtype and device; and every error case the op declares. `--op=v4_<op>` keeps one op."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parity.strategies import HypothesisDraw, devices, seeds
from v4train.ops import REFERENCE
from v4train.testing.cases import CASES
from v4train.testing.check import check_parity

CPP_OPS = {name: op for name, op in CASES.items() if op.has_cpp}
PARAMS = [(name, dtype, device) for name, op in CPP_OPS.items() for dtype in op.dtypes for device in devices()]
ERRORS = [(name, case) for name, op in CPP_OPS.items() for case in op.errors]


def test_every_cpp_op_has_samples_and_error_cases():
    assert [n for n, op in CPP_OPS.items() if op.samples is None] == []
    assert [n for n, op in CPP_OPS.items() if not op.errors] == []


@pytest.mark.parametrize("name,dtype,device", PARAMS, ids=[f"{n}-{str(d).removeprefix('torch.')}-{v}" for n, d, v in PARAMS])
@given(data=st.data())
def test_parity(name, dtype, device, data):
    op = CASES[name]
    sample = op.samples(HypothesisDraw(data), dtype, device)
    check_parity(op, op.cpp(), REFERENCE[name], sample, data.draw(seeds(), label="grad seed"))


@pytest.mark.parametrize("name,case", ERRORS, ids=[f"{n}-{c.what}" for n, c in ERRORS])
def test_bad_arguments_name_the_op_and_what_is_wrong(name, case):
    with pytest.raises(case.exc) as info:
        CASES[name].cpp()(*case.args())
    message = str(info.value)
    assert message.startswith(f"{name}: "), message
    assert case.message in message, message
    assert "Exception raised from" not in message, "a C++ backtrace reached the user"
