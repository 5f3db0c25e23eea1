"""v4_cross_entropy_loss against F.cross_entropy on full logits, its memory and work contract."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

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


class _Made(TorchDispatchMode):
    """Weak references to every tensor the ops under it make, and their count of matrix products."""

    def __init__(self):
        super().__init__()
        self.made, self.products = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.products += func._overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
        self.made += [weakref.ref(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out

    def largest_alive(self) -> int:
        gc.collect()
        return max([t.numel() for t in (r() for r in self.made) if t is not None], default=0)


def _forward_backward(impl, T, V, H, chunk, grad=True):
    h = torch.randn(T, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    with torch.set_grad_enabled(grad), _Made() as forward:
        loss = IMPLS[impl](h, w, torch.randint(0, V, (T,)), 1.0, chunk)
    alive = forward.largest_alive()  # what the forward pass left for the backward
    with _Made() as backward:
        if grad:
            loss.backward()
    return alive, forward.products, backward.products


def test_keeps_no_logits_and_forms_the_gradients_in_three_products_a_chunk():
    T, V, H, chunk = 64, 1000, 8, 16
    alive, forward, backward = _forward_backward("cpp", T, V, H, chunk)
    assert alive == V * H, "nothing larger than the weight's gradient (no [chunk, V] logits) outlives the forward pass"
    assert (forward, backward) == (3 * T // chunk, 0), "logits, hidden's and the weight's gradients, in the forward"
    without_autograd = _forward_backward("cpp", T, V, H, chunk, grad=False)
    assert without_autograd[:2] == (1, T // chunk), "without autograd: the loss alone, one product a chunk"
    assert _forward_backward("reference", T, V, H, chunk)[0] >= chunk * V, "(the reference keeps each chunk's logits)"


@pytest.mark.parametrize("impl", IMPLS)
def test_the_incoming_gradient_scales_both_gradients(impl):
    gen = torch.Generator().manual_seed(2)
    h, w = torch.randn(30, 16, generator=gen), torch.randn(40, 16, generator=gen) * 0.3
    t = torch.randint(0, 40, (30,), generator=gen)
    grads = []
    for scale in (1.0, -2.5):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        (IMPLS[impl](hh, ww, t, 7.0, 8) * scale).backward()
        grads.append((hh.grad, ww.grad))
    assert_close(grads[1][0], -2.5 * grads[0][0], "grad hidden")
    assert_close(grads[1][1], -2.5 * grads[0][1], "grad weight")


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
