"""v4_cross_entropy_loss against F.cross_entropy on full logits, its memory and work contract."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from parity.strategies import devices
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


def _both(device, dtype, h, w, t, normalizer, chunk):
    """The C++ op and the reference (F.cross_entropy a chunk at a time, the weight's gradient summed
    over the chunks in its dtype as the op does): losses, and the gradients of h and w."""
    out = []
    for impl in ("cpp", "reference"):
        hh = h.to(device=device, dtype=dtype, copy=True).requires_grad_()
        ww = w.to(device=device, dtype=dtype, copy=True).requires_grad_()
        loss = IMPLS[impl](hh, ww, t.to(device), normalizer, chunk)
        loss.backward()
        out.append((loss, hh.grad, ww.grad))
    return out


@pytest.mark.parametrize("device,dtype,V", [(d, t, V) for d in devices() for t in (torch.float32, torch.bfloat16)
                                            for V in (90, 96)])
def test_each_device_and_dtype_equals_the_reference(device, dtype, V):
    """On CUDA a chunk's loss and gradient come from one kernel (cross_entropy_loss.cu; a row of a
    multiple of 16 bytes read 16 bytes at a time, else an element at a time: V 96 and 90)."""
    gen = torch.Generator().manual_seed(4)
    h, w = torch.randn(50, 16, generator=gen), torch.randn(V, 16, generator=gen) * 0.3
    t = torch.randint(0, V, (50,), generator=gen)
    t[::7] = -100
    (loss, gh, gw), (ref, ref_h, ref_w) = _both(device, dtype, h, w, t, 13.0, 8)
    assert_close(loss, ref, "loss")
    assert_close(gh, ref_h, "grad hidden")
    assert_close(gw, ref_w, "grad weight")


@pytest.mark.parametrize("device,dtype", [(d, t) for d in devices() for t in (torch.float32, torch.bfloat16)])
def test_non_finite_logits_are_nan_where_cross_entropy_is(device, dtype):
    """log_softmax is NaN on a whole row holding a NaN or an infinity, and its backward carries that
    NaN into the gradients even of an ignored row: the op's NaN where the reference's (F.cross_entropy
    a chunk at a time) is, the finite values equal."""
    gen = torch.Generator().manual_seed(5)
    h, w = torch.randn(20, 16, generator=gen), torch.randn(96, 16, generator=gen) * 0.3
    t = torch.randint(0, 96, (20,), generator=gen)
    h[2, 3] = float("inf")  # a valid row: the loss is NaN
    for targets in (t, torch.where(torch.arange(20) == 2, -100, t)):  # then that row ignored
        (loss, gh, gw), (ref, ref_h, ref_w) = _both(device, dtype, h, w, targets, 7.0, 8)
        for name, a, b in (("loss", loss, ref), ("grad hidden", gh, ref_h), ("grad weight", gw, ref_w)):
            assert torch.equal(a.isnan(), b.isnan()), f"{name}: NaN at other places than the reference's"
            assert_close(a.nan_to_num(0.0), b.nan_to_num(0.0), name)
    h[2, 3], h[4] = 0.0, -float("inf")  # a row of -inf and +inf logits
    (loss, gh, gw), (ref, ref_h, ref_w) = _both(device, dtype, h, w, torch.where(torch.arange(20) == 4, -100, t), 7.0, 8)
    assert torch.equal(gh.isnan(), ref_h.isnan()) and torch.equal(gw.isnan(), ref_w.isnan())
    assert_close(loss, ref, "loss")
    # A row with exactly one +inf logit (its product overflows) and the rest finite: NaN too,
    # though a running max and sum alone would give -inf and a finite loss (a CUDA mutant did).
    h[4], w[:, 3] = 0.0, w[:, 3].clamp(-1.0, 1.0)
    h[6, 3], w[5, 3], t[6] = 3e38, 10.0, 0
    (loss, gh, gw), (ref, ref_h, ref_w) = _both(device, dtype, h, w, t, 7.0, 8)
    assert ref.isnan(), "(the case: one +inf logit in a valid row)"
    for name, a, b in (("loss", loss, ref), ("grad hidden", gh, ref_h), ("grad weight", gw, ref_w)):
        assert torch.equal(a.isnan(), b.isnan()), f"{name}: NaN at other places than the reference's (one +inf logit)"
