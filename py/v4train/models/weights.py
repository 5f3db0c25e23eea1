"""Weight tables: what each family's checkpoint holds, with shapes, init and dtype policy."""

from __future__ import annotations

import dataclasses
import torch


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One tensor of a layer (or of the model), by its transformers name.

    init: "normal" (std NORMAL_STD), "ones", "zeros", or "a_log" (log of U(A_LOG_RANGE), DeltaNet decay).
    fp32: kept in float32 whatever the model's dtype.
    experts: for fused expert tensors [E, ...], the per-expert projection names stored on disk
      (`mlp.experts.{e}.<name>.weight`), concatenated along dim 1 in this order.
    """

    name: str
    shape: tuple[int, ...]
    init: str = "normal"
    fp32: bool = False
    experts: tuple[str, ...] = ()


NORMAL_STD = 0.02  # a "normal" init's
A_LOG_RANGE = (0.01, 16.0)  # an "a_log" init is the log of a uniform draw from this range


def init_tensor(spec: WeightSpec, dtype: torch.dtype, device, generator: torch.Generator) -> torch.Tensor:
    """A freshly initialised tensor for `spec` (drawn in fp32 on the CPU, so any device gets the same values)."""
    if spec.init == "ones":
        t = torch.ones(spec.shape)
    elif spec.init == "zeros":
        t = torch.zeros(spec.shape)
    elif spec.init == "a_log":
        t = torch.empty(spec.shape).uniform_(*A_LOG_RANGE, generator=generator).log()
    elif spec.init == "normal":
        t = torch.empty(spec.shape).normal_(0.0, NORMAL_STD, generator=generator)
    else:
        raise ValueError(f"{spec.name}: unknown init {spec.init!r}")
    return t.to(device=device, dtype=torch.float32 if spec.fp32 else dtype)
