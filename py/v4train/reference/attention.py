"""Causal softmax attention over one document (the reference loops over documents)."""

from __future__ import annotations

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     allowed: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v for one document.

    q [L, Hq, D], k [L, Hk, D], v [L, Hk, Dv] with Hq a multiple of Hk (grouped heads: query head
    h reads key head h // (Hq // Hk), as transformers' repeat_kv). `allowed` [L, L] bool further
    restricts which keys a query sees (the DSA top-k selection). Softmax in fp32 (float64 for
    float64 input), then back to q's dtype (transformers' eager attention). Returns [L, Hq, Dv].
    """
    L, hq, _ = q.shape
    rep = hq // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    if allowed is not None:
        mask = mask & allowed
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


def documents(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of each document from cu_seqlens [N + 1] = [0, end_0, end_1, ...]."""
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))
