"""One Qwen3.5 / Qwen3.6 decoder layer (transformers' Qwen3_5MoeDecoderLayer and Qwen3_5DecoderLayer)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as recompute

from v4train.reference import rope as rope_ref
from v4train.reference.attention import causal_attention, documents
from v4train.reference.lora import Lora, linear


def _gated_rms_norm(x, gate, weight, eps):
    """RMSNorm(x) * w * silu(gate) (transformers' Qwen3_5MoeRMSNormGated: w applied in x's dtype)."""
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


def _gated_deltanet(h, w, cfg, cu_seqlens, lora, ops):
    """Gated DeltaNet (transformers' Qwen3_5MoeGatedDeltaNet), conv and state reset per document."""
    T = h.shape[0]
    nk, nv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qkv = linear(h, w, "linear_attn.in_proj_qkv.weight", lora)  # [T, 2*nk*dk + nv*dv]: [Q_all | K_all | V_all]
    z = linear(h, w, "linear_attn.in_proj_z.weight", lora).view(T, nv, dv)
    beta = linear(h, w, "linear_attn.in_proj_b.weight", lora).sigmoid()
    g = -w["linear_attn.A_log"].float().exp() * F.softplus(linear(h, w, "linear_attn.in_proj_a.weight", lora).float()
                                                            + w["linear_attn.dt_bias"])
    x = ops.v4_causal_conv1d(qkv, w["linear_attn.conv1d.weight"], cu_seqlens)  # depthwise, causal, + SiLU
    q, k, v = torch.split(x, [nk * dk, nk * dk, nv * dv], dim=-1)
    core = ops.v4_gated_delta_rule(q.reshape(T, nk, dk), k.reshape(T, nk, dk), v.reshape(T, nv, dv), g, beta, cu_seqlens)
    core = _gated_rms_norm(core.reshape(-1, dv), z.reshape(-1, dv), w["linear_attn.norm.weight"], cfg.rms_norm_eps)
    return linear(core.reshape(T, nv * dv), w, "linear_attn.out_proj.weight", lora)


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
            hidden = hidden + _gated_deltanet(h, w, cfg, cu_seqlens, lora, ops)
        else:
            hidden = hidden + _gated_attention(h, w, cfg, positions, docs, lora, ops)
        h = ops.v4_rms_norm(hidden, w["post_attention_layernorm.weight"], eps, True)
        if not cfg.is_moe:
            return hidden + ops.v4_mlp(h, w, "mlp.", lora_scaling, lora_dropout)
        return hidden + ops.v4_qwen_moe(h, w, "mlp.", cfg.num_experts_per_tok, True, lora_scaling, lora_dropout)[0]

    if checkpoint and torch.is_grad_enabled():
        return recompute(forward, hidden, use_reentrant=False), None
    return forward(hidden), None
