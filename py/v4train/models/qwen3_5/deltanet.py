"""Qwen3.5's linear-attention block, Gated DeltaNet (transformers' Qwen3_5MoeGatedDeltaNet)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from v4train.reference.lora import Linear, Lora, linear, linear_map, tensor


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetWeights:
    """Gated DeltaNet's weights (transformers' linear_attn.*): the projections in_proj_qkv
    [2 nk dk + nv dv, H], in_proj_z [nv dv, H], in_proj_b and in_proj_a [nv, H], out_proj
    [H, nv dv]; the depthwise conv1d [2 nk dk + nv dv, 1, kernel], dt_bias and A_log [nv], the
    gated norm's weight [dv]."""

    in_proj_qkv: Linear = linear_map("in_proj_qkv.weight")
    in_proj_z: Linear = linear_map("in_proj_z.weight")
    in_proj_b: Linear = linear_map("in_proj_b.weight")
    in_proj_a: Linear = linear_map("in_proj_a.weight")
    out_proj: Linear = linear_map("out_proj.weight")
    conv1d: torch.Tensor = tensor("conv1d.weight")
    dt_bias: torch.Tensor = tensor("dt_bias")
    A_log: torch.Tensor = tensor("A_log")
    norm: torch.Tensor = tensor("norm.weight")


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * w * silu(gate) (transformers' Qwen3_5MoeRMSNormGated: the norm in fp32, w
    applied in x's dtype, the gate in fp32; float64 stays float64)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    y = weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y * F.silu(gate.to(compute))).to(x.dtype)


def v4_gated_deltanet(h: torch.Tensor, weights: GatedDeltaNetWeights, num_key_heads: int, num_value_heads: int,
                      key_head_dim: int, value_head_dim: int, eps: float, cu_seqlens: torch.Tensor,
                      lora_scaling: float = 0.0, lora_dropout: float = 0.0, *, ops) -> torch.Tensor:
    """The Gated DeltaNet block over packed documents, each from a zero state.

    qkv = in_proj_qkv(h) split flat as [Q_all | K_all | V_all]; z = in_proj_z(h);
    beta = sigmoid(in_proj_b(h)); g = -exp(A_log) softplus(in_proj_a(h) + dt_bias) (fp32);
    x = ops.v4_causal_conv1d(qkv, conv1d.weight); o = ops.v4_gated_delta_rule(q, k, v, g, beta);
    out = out_proj(gated_rms_norm(o, z, norm.weight)). weights: GatedDeltaNetWeights, LoRA adapters
    with the projections. h [T, H] -> [T, H] in h's dtype.
    """
    lora = Lora(lora_scaling, lora_dropout)
    w, T = weights, h.shape[0]
    nk, nv, dk, dv = num_key_heads, num_value_heads, key_head_dim, value_head_dim
    compute = torch.promote_types(h.dtype, torch.float32)
    qkv = linear(h, w.in_proj_qkv, lora)
    z = linear(h, w.in_proj_z, lora).view(T, nv, dv)
    beta = linear(h, w.in_proj_b, lora).sigmoid()
    # g in float64: the A_log and dt_bias gradients sum g's gradient over every token with heavy
    # cancellation, so it is accumulated in float64 (and the delta rule takes g's cumulative sums
    # in float64 anyway); in fp32 their error came out 1e-4 of their norm, against 7e-6.
    a = linear(h, w.in_proj_a, lora).double()
    g = -w.A_log.double().exp() * F.softplus(a + w.dt_bias.double())
    x = ops.v4_causal_conv1d(qkv, w.conv1d, cu_seqlens)
    q, k, v = torch.split(x, [nk * dk, nk * dk, nv * dv], dim=-1)
    core = ops.v4_gated_delta_rule(q.reshape(T, nk, dk), k.reshape(T, nk, dk), v.reshape(T, nv, dv), g, beta, cu_seqlens)
    core = gated_rms_norm(core.reshape(-1, dv), z.reshape(-1, dv), w.norm, eps)
    return linear(core.reshape(T, nv * dv), w.out_proj, lora)
