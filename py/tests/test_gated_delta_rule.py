"""The chunked gated delta rule against the token-by-token recurrence (its ground truth)."""

import pytest
import torch

from v4train.testing.compare import assert_close
from v4train.reference import gated_delta_rule


def _inputs(L, hk, hv, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    g = -torch.rand(1, L, hv, generator=gen) * 2  # log decay <= 0
    return r(1, L, hk, dk), r(1, L, hk, dk), r(1, L, hv, dv), g, torch.rand(1, L, hv, generator=gen)


@pytest.mark.parametrize("L", [1, 3, 63, 64, 65, 130])
@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 4)])
def test_chunked_equals_recurrent(L, hk, hv):
    args = _inputs(L, hk, hv, 16, 8, seed=L * 10 + hv)
    o_rec, s_rec = gated_delta_rule.recurrent(*args)
    o_chk, s_chk = gated_delta_rule.chunked(*args)
    assert_close(o_chk, o_rec, f"output L={L}")
    assert_close(s_chk, s_rec, f"final state L={L}")


def test_initial_state_continues_a_sequence():
    q, k, v, g, b = _inputs(100, 2, 4, 16, 8, seed=7)
    whole, _ = gated_delta_rule.chunked(q, k, v, g, b)
    first, state = gated_delta_rule.chunked(q[:, :40], k[:, :40], v[:, :40], g[:, :40], b[:, :40])
    second, _ = gated_delta_rule.chunked(q[:, 40:], k[:, 40:], v[:, 40:], g[:, 40:], b[:, 40:], initial_state=state)
    assert_close(torch.cat([first, second], dim=1), whole, "split at 40")


def test_gradients_of_both_forms_agree():
    args = [t.requires_grad_() for t in _inputs(70, 2, 4, 16, 8, seed=1)]
    o, _ = gated_delta_rule.recurrent(*args)
    grads_rec = torch.autograd.grad(o.square().sum(), args)
    o, _ = gated_delta_rule.chunked(*args)
    grads_chk = torch.autograd.grad(o.square().sum(), args)
    for name, a, b in zip("qkvgb", grads_chk, grads_rec):
        assert_close(a, b, f"grad {name}")
