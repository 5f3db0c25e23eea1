"""Qwen3.5's linear-attention block, Gated DeltaNet (transformers' Qwen3_5MoeGatedDeltaNet)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from v4train.reference.lora import Lora, linear


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * w * silu(gate) (transformers' Qwen3_5MoeRMSNormGated: the norm in fp32, w
    applied in x's dtype, the gate in fp32; float64 stays float64)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    y = weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y * F.silu(gate.to(compute))).to(x.dtype)


def v4_gated_deltanet(h: torch.Tensor, weights: dict[str, torch.Tensor], num_key_heads: int, num_value_heads: int,
                      key_head_dim: int, value_head_dim: int, eps: float, cu_seqlens: torch.Tensor,
                      lora_scaling: float = 0.0, lora_dropout: float = 0.0, *, ops) -> torch.Tensor:
    """The Gated DeltaNet block over packed documents, each from a zero state.

    qkv = in_proj_qkv(h) split flat as [Q_all | K_all | V_all]; z = in_proj_z(h);
    beta = sigmoid(in_proj_b(h)); g = -exp(A_log) softplus(in_proj_a(h) + dt_bias) (fp32);
    x = ops.v4_causal_conv1d(qkv, conv1d.weight); o = ops.v4_gated_delta_rule(q, k, v, g, beta);
    out = out_proj(gated_rms_norm(o, z, norm.weight)). Weights named "linear_attn.*" as in a
    transformers layer, LoRA adapters beside the projections. h [T, H] -> [T, H] in h's dtype.
    """
    lora = Lora(lora_scaling, lora_dropout)
    w, T = weights, h.shape[0]
    nk, nv, dk, dv = num_key_heads, num_value_heads, key_head_dim, value_head_dim
    compute = torch.promote_types(h.dtype, torch.float32)
    qkv = linear(h, w, "linear_attn.in_proj_qkv.weight", lora)
    z = linear(h, w, "linear_attn.in_proj_z.weight", lora).view(T, nv, dv)
    beta = linear(h, w, "linear_attn.in_proj_b.weight", lora).sigmoid()
    # g in float64: the A_log and dt_bias gradients sum g's gradient over every token with heavy
    # cancellation, so it is accumulated in float64 (and the delta rule takes g's cumulative sums
    # in float64 anyway); in fp32 their error came out 1e-4 of their norm, against 7e-6.
    a = linear(h, w, "linear_attn.in_proj_a.weight", lora).double()
    g = -w["linear_attn.A_log"].double().exp() * F.softplus(a + w["linear_attn.dt_bias"].double())
    x = ops.v4_causal_conv1d(qkv, w["linear_attn.conv1d.weight"], cu_seqlens)
    q, k, v = torch.split(x, [nk * dk, nk * dk, nv * dv], dim=-1)
    core = ops.v4_gated_delta_rule(q.reshape(T, nk, dk), k.reshape(T, nk, dk), v.reshape(T, nv, dv), g, beta, cu_seqlens)
    core = gated_rms_norm(core.reshape(-1, dv), z.reshape(-1, dv), w["linear_attn.norm.weight"], eps)
    return linear(core.reshape(T, nv * dv), w, "linear_attn.out_proj.weight", lora)
