"""The optimizer step, applied in place to lists of tensors."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def v4_adam_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], step: int, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, master_params: list[torch.Tensor] = ()) -> None:
    """AdamW (torch.optim.AdamW's update, decoupled weight decay), in place.

    For each parameter p with gradient g and fp32 moments m, v, at step t >= 1:
        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        p = p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    computed in fp32 (float64 for float64 tensors: the parity suite's exact answer). With
    master_params (fp32 copies of low-precision params), p is the master and the param receives
    its value rounded to the param's dtype; without, p is the param and the result is rounded
    to its dtype.
    """
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    targets = list(master_params) or params
    for p, g, m, v in zip(targets, grads, exp_avgs, exp_avg_sqs):
        compute = torch.promote_types(p.dtype, torch.float32)
        gf = g.to(compute)
        m.mul_(beta1).add_(gf, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(gf, gf, value=1 - beta2)
        pf = p.to(compute)
        pf.mul_(1 - lr * weight_decay)
        pf.addcdiv_(m, v.sqrt().div_(math.sqrt(bc2)).add_(eps), value=-lr / bc1)
        if pf is not p:
            p.copy_(pf)
    for p, master in zip(params, master_params):
        p.copy_(master)
