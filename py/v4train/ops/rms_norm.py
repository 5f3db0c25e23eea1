import torch

from v4train.ops.registry import OpInfo, dispatch
from v4train.reference.rms_norm import v4_rms_norm as reference

def _example(dtype, device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=gen).to(device=device, dtype=dtype)
    return x, (1 + 0.1 * torch.randn(64, generator=gen)).to(device=device, dtype=dtype), 1e-6, False


OP = OpInfo(name="v4_rms_norm", reference=reference, dtypes=(torch.float32, torch.bfloat16), example=_example)


def v4_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim (see v4train.reference.rms_norm)."""
    return dispatch(OP)(x, weight, eps, zero_centered)
