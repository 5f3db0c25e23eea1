"""Qwen3.5's gated full attention (transformers' Qwen3_5MoeAttention)."""

from __future__ import annotations

import torch

from v4train.reference import rope as rope_ref
from v4train.reference.attention import causal_attention, documents
from v4train.reference.lora import Lora, linear


def v4_gated_attention(h: torch.Tensor, weights: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int,
                       head_dim: int, rope, eps: float, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                       lora_scaling: float = 0.0, lora_dropout: float = 0.0, *, ops) -> torch.Tensor:
    """Gated attention over packed documents: q_proj gives per head [q | gate]; zero-centred RMSNorm
    on q and k per head (ops.v4_rms_norm); partial RoPE (rotate_half on the first rope.dim dims);
    causal attention within each document (grouped heads); times sigmoid(gate); o_proj.

    h [T, H]; weights named "self_attn.*" as in a transformers layer; positions [T] per document;
    cu_seqlens int64 [N + 1]. Returns [T, H] in h's dtype.
    """
    lora, w, T = Lora(lora_scaling, lora_dropout), weights, h.shape[0]
    nh, nkv, hd = num_heads, num_kv_heads, head_dim
    q, gate = linear(h, w, "self_attn.q_proj.weight", lora).view(T, nh, 2 * hd).chunk(2, dim=-1)
    q = ops.v4_rms_norm(q, w["self_attn.q_norm.weight"], eps, True)
    k = ops.v4_rms_norm(linear(h, w, "self_attn.k_proj.weight", lora).view(T, nkv, hd), w["self_attn.k_norm.weight"],
                        eps, True)
    v = linear(h, w, "self_attn.v_proj.weight", lora).view(T, nkv, hd)
    cos, sin = rope_ref.cos_sin(rope, positions, h.dtype)
    q, k = rope_ref.apply_half(q, cos, sin), rope_ref.apply_half(k, cos, sin)
    outs = [causal_attention(q[s:e], k[s:e], v[s:e], hd**-0.5) for s, e in documents(cu_seqlens) if e > s]
    attn = torch.cat(outs, dim=0) if outs else q.new_zeros(0, nh, hd)
    attn = attn.reshape(T, nh * hd) * torch.sigmoid(gate.reshape(T, nh * hd))
    return linear(attn, w, "self_attn.o_proj.weight", lora)
