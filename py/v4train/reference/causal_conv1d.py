"""Gated DeltaNet's short convolution over packed documents."""

import torch
import torch.nn.functional as F

from v4train.reference.attention import documents


def v4_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """silu(depthwise causal conv1d) per document (transformers' Qwen3_5MoeGatedDeltaNet:
    `F.silu(self.conv1d(x)[..., :L])` with conv1d = Conv1d(C, C, K, groups=C, padding=K-1,
    bias=False)); each document starts from a zero state.

    x [T, C], weight [C, 1, K], cu_seqlens int64 [N + 1]. Computed in promote_types(x.dtype,
    float32), returned in x's dtype.
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(compute)
    outs = [F.conv1d(x[s:e].to(compute).T[None], w, padding=w.shape[-1] - 1, groups=w.shape[0])[0, :, :e - s].T
            for s, e in documents(cu_seqlens) if e > s]
    y = torch.cat(outs) if outs else x.to(compute) * w[:, 0, -1]  # no tokens: [0, C], still a function of x and w
    return F.silu(y).to(x.dtype)
