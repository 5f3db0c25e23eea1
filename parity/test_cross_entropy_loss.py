"""v4_cross_entropy_loss against F.cross_entropy on full logits, its memory contract."""

import pytest
import torch
import torch.nn.functional as F

from v4train.testing.compare import assert_close
from v4train.ops import OPS

OP = OPS["v4_cross_entropy_loss"]
IMPLS = {"reference": OP.reference, "cpp": OP.cpp()}


@pytest.mark.parametrize("impl", IMPLS)
def test_equals_cross_entropy_of_the_full_logits(impl):
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(50, 16, generator=gen), torch.randn(90, 16, generator=gen) * 0.3
    t = torch.randint(0, 90, (50,), generator=gen)
    t[::7] = -100
    ours_h, ours_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    ours = IMPLS[impl](ours_h, ours_w, t, 13.0, 8)
    ours.backward()
    ref_h, ref_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.cross_entropy(ref_h @ ref_w.T, t, ignore_index=-100, reduction="sum") / 13.0
    ref.backward()
    assert_close(ours, ref, "loss")
    assert_close(ours_h.grad, ref_h.grad, "grad hidden")
    assert_close(ours_w.grad, ref_w.grad, "grad weight")


def _largest_saved(impl, T, V):
    saved = []
    h = torch.randn(T, 8, requires_grad=True)
    w = torch.randn(V, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        IMPLS[impl](h, w, torch.randint(0, V, (T,)), 1.0, 16).backward()
    return max(saved)


def test_backward_keeps_no_logits():
    T, V = 64, 1000
    assert _largest_saved("cpp", T, V) == V * 8, "only hidden, weight and targets are kept"
    assert _largest_saved("reference", T, V) >= 16 * V, "(the reference keeps each chunk's logits)"


@pytest.mark.parametrize("impl", IMPLS)
def test_an_ignored_token_does_not_reach_the_loss_whatever_its_hidden_state(impl):
    gen = torch.Generator().manual_seed(1)
    h, w = torch.randn(20, 16, generator=gen), torch.randn(90, 16, generator=gen) * 0.3
    t = torch.randint(0, 90, (20,), generator=gen)
    t[3], t[7] = -100, -100
    h[3], h[7, 0] = float("nan"), float("inf")
    keep = t != -100
    expected = F.cross_entropy(h[keep] @ w.T, t[keep], reduction="sum") / 5.0
    assert_close(IMPLS[impl](h, w, t, 5.0, 8), expected, "loss with non-finite ignored tokens")
