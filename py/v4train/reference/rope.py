"""Rotary position embeddings: frequencies (default and YaRN) and the two rotation layouts."""

from __future__ import annotations

import math

import torch


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_scale(rope) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope.dim // 2] and the factor cos/sin are multiplied by.

    Matches transformers' `_compute_default_rope_parameters` and `_compute_yarn_parameters`.
    """
    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations):
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale_factor(rope) -> float:
    """The extra softmax scale of YaRN with mscale_all_dim (DeepSeek/GLM `yarn_apply_mscale`)."""
    if rope.type != "default" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        return m * m
    return 1.0


def cos_sin(rope, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, rope.dim] (the half-frequencies repeated twice), in `dtype`."""
    inv_freq, scale = inv_freq_and_scale(rope)
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GLM-5/DeepSeek interleaved RoPE on x [T, heads, dim]: pairs (x0, x1), (x2, x3), ... rotate.

    The result lists the rotated even elements, then the odd ones (transformers'
    `apply_rotary_pos_emb_interleave`); q and k are permuted alike, so q.k is unchanged.
    """
    c = cos[:, None, : cos.shape[-1] // 2]
    s = sin[:, None, : sin.shape[-1] // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def apply_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Qwen partial RoPE on x [T, heads, head_dim]: rotate_half on the first cos.shape[-1] dims."""
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    r1, r2 = rot[..., : d // 2], rot[..., d // 2:]
    rotated = rot * cos[:, None] + torch.cat((-r2, r1), dim=-1) * sin[:, None]
    return torch.cat([rotated, rest], dim=-1)
