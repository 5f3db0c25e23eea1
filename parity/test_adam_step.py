"""v4_adam_step beyond the generic parity: against torch.optim.AdamW itself (fp32 parameters, and
bf16 parameters with fp32 master weights), strided tensors, and proof that the parity check and
the self-check catch wrong AdamW updates whose error is far below a bf16 parameter's tolerance."""

import math

import pytest
import torch

from v4train.op import Op, OpTable
from v4train.ops import REFERENCE
from v4train.testing.cases import CASES
from v4train.testing.check import check_parity, self_check
from v4train.testing.compare import assert_close
from v4train.testing.samples import RandomDraw

OP = CASES["v4_adam_step"]
IMPLS = {"reference": OP.reference, "cpp": OP.cpp()}


def _torch_adamw(params, steps, lr=3e-3, betas=(0.9, 0.95), wd=0.1, seed=0):
    """torch.optim.AdamW on fp32 copies of params; yields each step's gradients and leaves the
    fp32 results in the returned list."""
    gen = torch.Generator().manual_seed(seed)
    theirs = [p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(theirs, lr=lr, betas=betas, eps=1e-8, weight_decay=wd)
    grads = []
    for _ in range(steps):
        g = [torch.randn(p.shape, generator=gen) for p in params]
        for t, gi in zip(theirs, g):
            t.grad = gi.clone()
        opt.step()
        grads.append(g)
    return theirs, grads


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_torch_adamw_over_several_steps(impl):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in [(7, 3), (11,)]]
    theirs, grads = _torch_adamw(params, 5)
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for step, g in enumerate(grads, start=1):
        IMPLS[impl](params, g, m, v, step, 3e-3, 0.9, 0.95, 1e-8, 0.1)
    for i, (ours, t) in enumerate(zip(params, theirs)):
        assert_close(ours, t.detach(), f"param {i} after 5 steps")


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_params_with_fp32_masters_follow_torch_adamw_in_fp32(impl):
    """The masters follow torch's fp32 AdamW to fp32 tolerance over 20 steps, and each bf16
    parameter is its master rounded; without masters, updates below a bf16 ulp are lost."""
    gen = torch.Generator().manual_seed(1)
    start = [torch.randn(s, generator=gen) * 0.02 for s in [(64, 16), (33,)]]  # weights of LLM scale
    params = [p.bfloat16() for p in start]
    masters = [p.float() for p in params]
    theirs, grads = _torch_adamw(masters, 20, lr=1e-5, wd=0.1)
    m, v = [torch.zeros_like(p) for p in masters], [torch.zeros_like(p) for p in masters]
    bare = [p.clone() for p in params]
    bm, bv = [torch.zeros_like(p) for p in masters], [torch.zeros_like(p) for p in masters]
    for step, g in enumerate(grads, start=1):
        IMPLS[impl](params, [x.bfloat16() for x in g], m, v, step, 1e-5, 0.9, 0.95, 1e-8, 0.1, masters)
        IMPLS[impl](bare, [x.bfloat16() for x in g], bm, bv, step, 1e-5, 0.9, 0.95, 1e-8, 0.1)
    for i, (p, master, t) in enumerate(zip(params, masters, theirs)):
        assert_close(master, t.detach(), f"master {i} after 20 steps")
        assert torch.equal(p, master.bfloat16()), f"param {i} is its master rounded to bf16"
    lost = sum(int((b == p0.bfloat16()).sum()) for b, p0 in zip(bare, masters))
    assert lost > 0.5 * sum(p.numel() for p in params), "without masters most bf16 weights never move at lr 1e-5"


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_tensors_are_updated_as_contiguous_ones(impl):
    gen = torch.Generator().manual_seed(2)
    dense = [torch.randn(6, 4, generator=gen) for _ in range(4)]  # param, grad, m, v
    dense[3] = dense[3].square()
    strided = [torch.zeros(4, 6).t().copy_(t) for t in dense]  # same values, transposed storage
    IMPLS[impl]([dense[0]], [dense[1]], [dense[2]], [dense[3]], 3, 1e-2, 0.9, 0.999, 1e-8, 0.1)
    IMPLS[impl]([strided[0]], [strided[1]], [strided[2]], [strided[3]], 3, 1e-2, 0.9, 0.999, 1e-8, 0.1)
    for name, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq"), strided, dense):
        assert_close(a, b, name)


# Wrong AdamW updates that differ from the right one by far less than a bf16 parameter's
# tolerance (lr x wd x p, eps against sqrt(v)): the parity check must still catch each.
def _wrong(change):
    @torch.no_grad()
    def adam(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay, master_params=()):
        bc1, bc2 = 1 - beta1**step, 1 - beta2**step
        targets = list(master_params) or params
        for p, g, m, v in zip(targets, grads, exp_avgs, exp_avg_sqs):
            gf = g.to(torch.promote_types(p.dtype, torch.float32))
            m.mul_(beta1).add_(gf, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(gf, gf, value=1 - beta2)
            pf = p.to(gf.dtype)
            if change != "no weight decay":
                pf.mul_(1 - lr * weight_decay)
            denom = (v + eps).sqrt() / math.sqrt(bc2) if change == "eps inside the sqrt" else v.sqrt() / math.sqrt(bc2) + eps
            pf.addcdiv_(m, denom, value=-lr / (1 if change == "no bias correction" else bc1))
            if pf is not p:
                p.copy_(pf)
        for p, master in zip(params, master_params):
            p.copy_(master)
    return adam


MUTANTS = ["no weight decay", "eps inside the sqrt", "no bias correction"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("change", MUTANTS)
def test_parity_catches_a_wrong_update(change, dtype):
    caught = 0
    for i in range(20):
        try:
            check_parity(OP, _wrong(change), REFERENCE["v4_adam_step"], OP.samples(RandomDraw(i), dtype, "cpu"), i)
        except AssertionError:
            caught += 1
    assert caught > 0, f"20 parity samples let an AdamW with {change} through"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("change", MUTANTS)
def test_self_check_catches_a_wrong_update(change, dtype, monkeypatch):
    real = Op.cpp
    monkeypatch.setattr(Op, "cpp", lambda op: _wrong(change) if op.name == "v4_adam_step" else real(op))
    table = OpTable(CASES, ["v4_adam_step"])
    with pytest.raises(ValueError, match="self-check: the C\\+\\+ op v4_adam_step differs from its reference"):
        self_check(table, REFERENCE, dtype, "cpu")


def test_the_right_update_passes_the_same_checks():
    for dtype in (torch.float32, torch.bfloat16):
        for i in range(20):
            check_parity(OP, _wrong("none"), REFERENCE["v4_adam_step"], OP.samples(RandomDraw(i), dtype, "cpu"), i)
