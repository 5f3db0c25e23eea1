#pragma once

#include <ATen/core/Tensor.h>

#include "cc/common/lora.h"

// Qwen3.5's linear-attention block (transformers' Qwen3_5MoeGatedDeltaNet) over packed documents,
// each from a zero state, in one call: in_proj_qkv (split flat as [Q_all | K_all | V_all]),
// in_proj_z, in_proj_b (beta = sigmoid), in_proj_a (g = -exp(A_log) softplus(a + dt_bias), fp32),
// v4_causal_conv1d, v4_gated_delta_rule, the gated RMSNorm (norm in fp32, weight in h's dtype,
// silu(z) in fp32), out_proj; LoRA adapters beside the projections apply. Weights named
// "linear_attn.*" as in a transformers layer. h [T, H], cu_seqlens int64 [N + 1] -> [T, H].
at::Tensor v4_gated_deltanet(const at::Tensor& h, const v4::Weights& weights, int64_t num_key_heads,
                             int64_t num_value_heads, int64_t key_head_dim, int64_t value_head_dim, double eps,
                             const at::Tensor& cu_seqlens, double lora_scaling, double lora_dropout);
