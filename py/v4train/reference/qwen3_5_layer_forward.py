"""One Qwen3.5 / Qwen3.6 decoder layer (transformers' Qwen3_5MoeDecoderLayer and Qwen3_5DecoderLayer)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint as recompute

from v4train.reference import rope as rope_ref
from v4train.reference.attention import causal_attention, documents
from v4train.reference.lora import Lora, linear


def _gated_attention(h, w, cfg, positions, docs, lora, ops):
    """Gated full attention (transformers' Qwen3_5MoeAttention): q/gate per head, q/k norm, partial RoPE."""
    T, nh, nkv, hd = h.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, gate = linear(h, w, "self_attn.q_proj.weight", lora).view(T, nh, 2 * hd).chunk(2, dim=-1)
    q = ops.v4_rms_norm(q, w["self_attn.q_norm.weight"], cfg.rms_norm_eps, True)
    k = ops.v4_rms_norm(linear(h, w, "self_attn.k_proj.weight", lora).view(T, nkv, hd), w["self_attn.k_norm.weight"],
                    cfg.rms_norm_eps, True)
    v = linear(h, w, "self_attn.v_proj.weight", lora).view(T, nkv, hd)
    cos, sin = rope_ref.cos_sin(cfg.rope, positions, h.dtype)
    q, k = rope_ref.apply_half(q, cos, sin), rope_ref.apply_half(k, cos, sin)
    attn = torch.cat([causal_attention(q[s:e], k[s:e], v[s:e], hd**-0.5) for s, e in docs], dim=0)
    attn = attn.reshape(T, nh * hd) * torch.sigmoid(gate.reshape(T, nh * hd))
    return linear(attn, w, "self_attn.o_proj.weight", lora)


def v4_qwen3_5_layer_forward(hidden: torch.Tensor, weights: dict[str, torch.Tensor], cfg, layer: int,
                             positions: torch.Tensor, cu_seqlens: torch.Tensor, carry: None = None,
                             lora_scaling: float = 0.0, lora_dropout: float = 0.0, checkpoint: bool = False, *,
                             ops) -> tuple[torch.Tensor, None]:
    """One Qwen3.5 decoder layer over packed tokens (the conventions of v4_glm5_layer_forward;
    nothing is carried from layer to layer: carry is None in and out).

    x = x + Mixer(RMSNorm0(x)); x = x + MLP(RMSNorm0(x)), RMSNorm0 the zero-centred norm
    (scale 1 + w). Mixer: Gated DeltaNet on 'linear_attention' layers, gated full attention on
    'full_attention' ones. MLP: softmax top-k MoE plus sigmoid(shared_expert_gate(x)) times the
    shared expert (qwen3_5_moe), or a SwiGLU MLP (qwen3_5).
    """
    w, eps, lora = weights, cfg.rms_norm_eps, Lora(lora_scaling, lora_dropout)
    docs = documents(cu_seqlens)

    def forward(hidden):
        h = ops.v4_rms_norm(hidden, w["input_layernorm.weight"], eps, True)
        if cfg.layer_types[layer] == "linear_attention":
            hidden = hidden + ops.v4_gated_deltanet(h, w, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                                    cfg.linear_key_head_dim, cfg.linear_value_head_dim, eps,
                                                    cu_seqlens, lora_scaling, lora_dropout)
        else:
            hidden = hidden + _gated_attention(h, w, cfg, positions, docs, lora, ops)
        h = ops.v4_rms_norm(hidden, w["post_attention_layernorm.weight"], eps, True)
        if not cfg.is_moe:
            return hidden + ops.v4_mlp(h, w, "mlp.", lora_scaling, lora_dropout)
        return hidden + ops.v4_qwen_moe(h, w, "mlp.", cfg.num_experts_per_tok, True, lora_scaling, lora_dropout)[0]

    if checkpoint and torch.is_grad_enabled():
        return recompute(forward, hidden, use_reentrant=False), None
    return forward(hidden), None
