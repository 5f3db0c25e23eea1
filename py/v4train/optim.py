"""AdamW over a list of named tensors and its LR schedule; the step is the run's v4_adam_step."""

from __future__ import annotations

import math

import torch

from v4train.distributed import assign, copies, load_sharded, local, whole
from v4train.ops import OpTable


def lr_at(step: int, base_lr: float, min_lr: float, warmup: int, total: int, schedule: str) -> float:
    """The learning rate of step (1-based) of a run of `total` steps: a linear warmup reaching
    base_lr at step `warmup` (base_lr * step / warmup), then `schedule` (cosine, linear or constant)
    from base_lr towards min_lr, as Hugging Face's get_cosine_schedule_with_warmup /
    get_linear_schedule_with_warmup decay: progress (step - 1 - warmup) / (total - warmup), so
    the last step still trains (at min_lr + (base_lr - min_lr) * (1 + cos(pi (total - 1 - warmup) /
    (total - warmup))) / 2, above min_lr) and a run of one step trains at base_lr. (Transformers'
    warmup starts at 0, so its first step trains nothing; here the first step trains at
    base_lr / warmup.)"""
    if warmup and step <= warmup:
        return base_lr * step / warmup
    if schedule == "constant" or total <= warmup:
        return base_lr
    progress = min(1.0, (step - 1 - warmup) / (total - warmup))
    if schedule == "linear":
        return base_lr - (base_lr - min_lr) * progress
    return min_lr + (base_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


class AdamW:
    """AdamW with fp32 moments, and fp32 master weights for parameters stored in lower precision
    (a bf16 parameter cannot hold an update below 2**-8 of itself: lr x update is often that
    small, and would be lost every step).

    A parameter sharded by FSDP2 (a DTensor) is updated on this rank's shard: its moments and master
    are shards too, and state_tensors / load_state move them whole (every rank calls them)."""

    def __init__(self, named: dict[str, torch.Tensor], ops: OpTable, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0):
        self.names = list(named)
        self.params = [named[n] for n in self.names]  # where the gradients arrive
        self.shards = [local(p) for p in self.params]  # what the step updates
        self.ops = ops
        self.exp_avgs = [torch.zeros_like(p, dtype=torch.float32) for p in self.shards]
        self.exp_avg_sqs = [torch.zeros_like(p, dtype=torch.float32) for p in self.shards]
        self.masters = {i: p.detach().float().clone() for i, p in enumerate(self.shards) if p.dtype != torch.float32}
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.step_count = 0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def grads(self) -> list[torch.Tensor]:
        """The gradients that exist (a weight no loss reached this step has none, and is not updated)."""
        return [local(p.grad) for p in self.params if p.grad is not None]

    def grad_copies(self) -> list[int]:
        """Per gradient of grads(): how many ranks hold the same one (distributed.copies)."""
        return [copies(p) for p in self.params if p.grad is not None]

    def nonfinite_grads(self) -> list[str]:
        """The parameters whose gradient holds NaN or inf, in model order: the diagnosis of a step
        whose gradient norm is not finite (so not an op: it never runs in a healthy step)."""
        return [n for n, p in zip(self.names, self.params)
                if p.grad is not None and not bool(torch.isfinite(local(p.grad)).all())]

    def step(self, lr: float) -> None:
        self.step_count += 1
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        # One call for the fp32 parameters, one for those with masters (the op takes all or none).
        for group in ([i for i in live if i not in self.masters], [i for i in live if i in self.masters]):
            if group:
                pick = lambda xs: [xs[i] for i in group]  # noqa: E731
                self.ops.v4_adam_step(pick(self.shards), [local(self.params[i].grad) for i in group], pick(self.exp_avgs),
                                      pick(self.exp_avg_sqs), self.step_count, lr, *self.betas, self.eps,
                                      self.weight_decay, [self.masters[i] for i in group] if group[0] in self.masters else [])

    def _state(self, view) -> dict[str, torch.Tensor]:
        """The moments and masters by name, each as view(its parameter, this rank's shard) gives it."""
        out = {}
        for i, (n, p, m, v) in enumerate(zip(self.names, self.params, self.exp_avgs, self.exp_avg_sqs)):
            out[n + ".exp_avg"], out[n + ".exp_avg_sq"] = view(p, m), view(p, v)
            if i in self.masters:
                out[n + ".master"] = view(p, self.masters[i])
        return out

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The moments and masters by name, whole (gathered where sharded)."""
        return self._state(whole)

    def sharded_state(self) -> dict[str, torch.Tensor]:
        """The moments and masters by name, this rank's shards (what each rank saves of a run of
        several processes, and loads into in place)."""
        return self._state(lambda p, shard_: shard_)

    def load_sharded(self, folder: str, rank: int, step_count: int) -> None:
        """Rank `rank`'s shards as save_sharded wrote them under `folder` (a run of the same layout),
        each checked as load_state checks whole tensors (ValueError naming them)."""
        state = self.sharded_state()
        load_sharded(state, folder, rank)
        for key, t in state.items():
            _check_value(key, t)
        self.step_count = step_count

    def load_state(self, tensors: dict[str, torch.Tensor], step_count: int) -> None:
        missing = [n for n in self.names if n + ".exp_avg" not in tensors]
        if missing:
            raise ValueError(f"optimizer state lacks {missing[:3]} (was the checkpoint made with other trainable weights?)")
        if not isinstance(step_count, int) or isinstance(step_count, bool) or step_count < 0:
            raise ValueError(f"optimizer_steps must be an integer >= 0, got {step_count!r}")
        for i, (n, p) in enumerate(zip(self.names, self.params)):
            for field in ("exp_avg", "exp_avg_sq") + ((".master",) if i in self.masters else ()):
                key = n + (field if field.startswith(".") else "." + field)
                t = tensors.get(key)
                if t is None:
                    continue  # a master weight absent: a checkpoint of fp32 weights (see below)
                if t.shape != p.shape or not t.is_floating_point():
                    raise ValueError(f"{key}: {t.dtype} {tuple(t.shape)}, expected a floating tensor of {tuple(p.shape)}")
                _check_value(key, t)
        for i, (n, p, m, v) in enumerate(zip(self.names, self.params, self.exp_avgs, self.exp_avg_sqs)):
            assign(m, tensors[n + ".exp_avg"], like=p)
            assign(v, tensors[n + ".exp_avg_sq"], like=p)
            if i in self.masters:  # a checkpoint of fp32 weights has none: start from the parameter
                if n + ".master" in tensors:
                    assign(self.masters[i], tensors[n + ".master"], like=p)
                else:
                    with torch.no_grad():
                        self.masters[i].copy_(self.shards[i])
        self.step_count = step_count


def _check_value(key: str, t: torch.Tensor) -> None:
    """A moment or master read from a checkpoint: finite, and a second moment >= 0 (ValueError)."""
    if not torch.isfinite(t).all():
        raise ValueError(f"{key}: holds NaN or infinite values")
    if key.endswith(".exp_avg_sq") and (t < 0).any():
        raise ValueError(f"{key}: holds negative values (a second moment is >= 0)")
