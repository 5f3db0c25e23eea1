"""The one tolerance table per dtype, shared by the parity suite and the trainer's self-check.

An element passes when |actual - expected| <= atol + rtol * |expected| (torch.testing's rule and
default tolerances). Never loosen an entry to get a test green: a mismatch is a bug to find.
"""

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(rtol=1.3e-6, atol=1e-5),
    torch.bfloat16: Tolerance(rtol=1.6e-2, atol=1e-5),
    torch.float16: Tolerance(rtol=1e-3, atol=1e-5),
    torch.float64: Tolerance(rtol=1e-7, atol=1e-7),
}
