"""Gated DeltaNet's short convolution over packed documents."""

import torch
import torch.nn.functional as F

from v4train.reference.attention import documents


def v4_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """silu(depthwise causal conv1d) per document (transformers' Qwen3_5MoeGatedDeltaNet:
    `F.silu(self.conv1d(x)[..., :L])` with conv1d = Conv1d(C, C, K, groups=C, padding=K-1,
    bias=False)); each document starts from a zero state. Written tap by tap, so that the taps
    reaching before a document are absent rather than zero times the weight (the convolution
    kernels disagree among themselves on 0 * inf).

    x [T, C], weight [C, 1, K], cu_seqlens int64 [N + 1]. Computed in promote_types(x.dtype,
    float32), returned in x's dtype.
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(compute)[:, 0]  # [C, K]
    K = w.shape[-1]
    outs = []
    for s, e in documents(cu_seqlens):
        xd = x[s:e].to(compute)
        # Tap j: w[:, K-1-j] x[t - j] for the tokens at least j into the document (the taps that
        # would reach before it are not computed: zero-padded convolution, without 0 * inf).
        y = xd * w[:, K - 1]
        for j in range(1, min(K, e - s)):
            y = y + F.pad(xd[: e - s - j] * w[:, K - 1 - j], (0, 0, j, 0))
        outs.append(y)
    y = torch.cat(outs) if outs else x.to(compute) * w[:, -1]  # no tokens: [0, C], still a function of x and w
    return F.silu(y).to(x.dtype)
