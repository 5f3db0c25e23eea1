"""Qwen3.5's gated full attention (transformers' Qwen3_5MoeAttention)."""

from __future__ import annotations

import dataclasses

import torch

from v4train.reference import rope as rope_ref
from v4train.reference.attention import causal_attention, documents
from v4train.reference.lora import Linear, Lora, linear, linear_map, tensor


@dataclasses.dataclass(frozen=True)
class GatedAttentionWeights:
    """The gated attention's weights (transformers' self_attn.*): q_proj [nh 2 hd, H] (query and
    gate per head), k_proj and v_proj [nkv hd, H], o_proj [H, nh hd], the q and k norms [hd]."""

    q_proj: Linear = linear_map("q_proj.weight")
    k_proj: Linear = linear_map("k_proj.weight")
    v_proj: Linear = linear_map("v_proj.weight")
    o_proj: Linear = linear_map("o_proj.weight")
    q_norm: torch.Tensor = tensor("q_norm.weight")
    k_norm: torch.Tensor = tensor("k_norm.weight")


def v4_gated_attention(h: torch.Tensor, weights: GatedAttentionWeights, num_heads: int, num_kv_heads: int,
                       head_dim: int, rope, eps: float, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                       lora_scaling: float = 0.0, lora_dropout: float = 0.0, *, ops) -> torch.Tensor:
    """Gated attention over packed documents: q_proj gives per head [q | gate]; zero-centred RMSNorm
    on q and k per head (ops.v4_rms_norm); partial RoPE (rotate_half on the first rope.dim dims);
    causal attention within each document (grouped heads); times sigmoid(gate); o_proj.

    h [T, H]; weights: GatedAttentionWeights; positions [T] per document;
    cu_seqlens int64 [N + 1]. Returns [T, H] in h's dtype.
    """
    lora, w, T = Lora(lora_scaling, lora_dropout), weights, h.shape[0]
    nh, nkv, hd = num_heads, num_kv_heads, head_dim
    q, gate = linear(h, w.q_proj, lora).view(T, nh, 2 * hd).chunk(2, dim=-1)
    q = ops.v4_rms_norm(q, w.q_norm, eps, True)
    k = ops.v4_rms_norm(linear(h, w.k_proj, lora).view(T, nkv, hd), w.k_norm, eps, True)
    v = linear(h, w.v_proj, lora).view(T, nkv, hd)
    cos, sin = rope_ref.cos_sin(rope, positions, h.dtype)
    q, k = rope_ref.apply_half(q, cos, sin), rope_ref.apply_half(k, cos, sin)
    outs = [causal_attention(q[s:e], k[s:e], v[s:e], hd**-0.5) for s, e in documents(cu_seqlens) if e > s]
    attn = torch.cat(outs, dim=0) if outs else q.new_zeros(0, nh, hd)
    attn = attn.reshape(T, nh * hd) * torch.sigmoid(gate.reshape(T, nh * hd))
    return linear(attn, w.o_proj, lora)
