"""AdamW over a list of named tensors and its LR schedule; the step is the run's v4_adam_step."""

from __future__ import annotations

import math

import torch

from v4train.ops import OpTable


def lr_at(step: int, base_lr: float, min_lr: float, warmup: int, total: int, schedule: str) -> float:
    """The learning rate of step (1-based): linear warmup from base_lr / warmup to base_lr over
    `warmup` steps, then `schedule` (cosine, linear or constant) down to min_lr at `total`."""
    if warmup and step <= warmup:
        return base_lr * step / warmup
    if schedule == "constant" or total <= warmup:
        return base_lr
    progress = min(1.0, (step - warmup) / (total - warmup))
    if schedule == "linear":
        return base_lr - (base_lr - min_lr) * progress
    return min_lr + (base_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


class AdamW:
    """AdamW with fp32 moments, and fp32 master weights for parameters stored in lower precision
    (a bf16 parameter cannot hold an update below 2**-8 of itself: lr x update is often that
    small, and would be lost every step)."""

    def __init__(self, named: dict[str, torch.Tensor], ops: OpTable, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0):
        self.names = list(named)
        self.params = [named[n] for n in self.names]
        self.ops = ops
        self.exp_avgs = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.exp_avg_sqs = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.masters = {i: p.detach().float().clone() for i, p in enumerate(self.params) if p.dtype != torch.float32}
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.step_count = 0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def grads(self) -> list[torch.Tensor]:
        """The gradients that exist (a weight no loss reached this step has none, and is not updated)."""
        return [p.grad for p in self.params if p.grad is not None]

    def nonfinite_grads(self) -> list[str]:
        """The parameters whose gradient holds NaN or inf, in model order: the diagnosis of a step
        whose gradient norm is not finite (so not an op: it never runs in a healthy step)."""
        return [n for n, p in zip(self.names, self.params)
                if p.grad is not None and not bool(torch.isfinite(p.grad).all())]

    def step(self, lr: float) -> None:
        self.step_count += 1
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        # One call for the fp32 parameters, one for those with masters (the op takes all or none).
        for group in ([i for i in live if i not in self.masters], [i for i in live if i in self.masters]):
            if group:
                pick = lambda xs: [xs[i] for i in group]  # noqa: E731
                self.ops.v4_adam_step(pick(self.params), [self.params[i].grad for i in group], pick(self.exp_avgs),
                                      pick(self.exp_avg_sqs), self.step_count, lr, *self.betas, self.eps,
                                      self.weight_decay, [self.masters[i] for i in group] if group[0] in self.masters else [])

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, (n, m, v) in enumerate(zip(self.names, self.exp_avgs, self.exp_avg_sqs)):
            out[n + ".exp_avg"], out[n + ".exp_avg_sq"] = m, v
            if i in self.masters:
                out[n + ".master"] = self.masters[i]
        return out

    def load_state(self, tensors: dict[str, torch.Tensor], step_count: int) -> None:
        missing = [n for n in self.names if n + ".exp_avg" not in tensors]
        if missing:
            raise ValueError(f"optimizer state lacks {missing[:3]} (was the checkpoint made with other trainable weights?)")
        with torch.no_grad():
            for i, (n, m, v) in enumerate(zip(self.names, self.exp_avgs, self.exp_avg_sqs)):
                m.copy_(tensors[n + ".exp_avg"])
                v.copy_(tensors[n + ".exp_avg_sq"])
                if i in self.masters:  # a checkpoint of fp32 weights has none: start from the parameter
                    self.masters[i].copy_(tensors.get(n + ".master", self.params[i]))
        self.step_count = step_count
