"""v4_adam_step beyond the generic parity: against torch.optim.AdamW itself, and its errors."""

import pytest
import torch

from parity.compare import assert_close
from v4train.ops import OPS

OP = OPS["v4_adam_step"]


@pytest.mark.parametrize("impl", ["reference", "cpp"])
def test_matches_torch_adamw_over_several_steps(impl):
    fn = OP.reference if impl == "reference" else OP.cpp()
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in [(7, 3), (11,)]]
    theirs = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(theirs, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(1, 6):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        for t, g in zip(theirs, grads):
            t.grad = g.clone()
        opt.step()
        fn(params, grads, m, v, step, 3e-3, 0.9, 0.95, 1e-8, 0.1)
    for i, (ours, t) in enumerate(zip(params, theirs)):
        assert_close(ours, t.detach(), f"param {i} after 5 steps")


@pytest.mark.parametrize("call,message", [
    (lambda f, p, g, m, v: f(p, g[:1], m, v, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0), "must be lists of one length, got 2, 1"),
    (lambda f, p, g, m, v: f(p, g, [x.double() for x in m], v, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0),
     "exp_avgs[0] and exp_avg_sqs[0] must be float32"),
    (lambda f, p, g, m, v: f(p, g, m, v, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0), "step must be >= 1, got 0"),
    (lambda f, p, g, m, v: f(p, g, m, v, 1, 1e-3, 1.0, 0.999, 1e-8, 0.0), "betas must lie in [0, 1)"),
    (lambda f, p, g, m, v: f(p, [torch.zeros(3), g[1]], m, v, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0),
     "grads[0] has shape [3] but params[0] has shape [2, 2]"),
])
def test_bad_arguments_name_what_is_wrong(call, message):
    p = [torch.zeros(2, 2), torch.zeros(5)]
    g, m, v = [torch.zeros_like(x) for x in p], [torch.zeros_like(x) for x in p], [torch.zeros_like(x) for x in p]
    with pytest.raises(ValueError, match="^v4_adam_step: ") as info:
        call(OP.cpp(), p, g, m, v)
    assert message in str(info.value)
