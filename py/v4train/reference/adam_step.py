"""The optimizer step, applied in place to lists of tensors."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def v4_adam_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], step: int, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float) -> None:
    """AdamW (torch.optim.AdamW's update, decoupled weight decay), in place.

    For each parameter p with gradient g and fp32 moments m, v, at step t >= 1:
        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        p = p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    computed in fp32 and written back in p's dtype.
    """
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        gf = g.float()
        m.mul_(beta1).add_(gf, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(gf, gf, value=1 - beta2)
        pf = p.float() if p.dtype != torch.float32 else p
        pf.mul_(1 - lr * weight_decay)
        pf.addcdiv_(m, v.sqrt().div_(math.sqrt(bc2)).add_(eps), value=-lr / bc1)
        if pf is not p:
            p.copy_(pf)
