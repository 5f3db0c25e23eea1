#pragma once

#include <ATen/core/Tensor.h>

#include "cc/common/lora.h"

namespace v4 {

// Gated DeltaNet's weights (transformers' linear_attn.*): the projections in_proj_qkv
// [2 nk dk + nv dv, H], in_proj_z [nv dv, H], in_proj_b and in_proj_a [nv, H], out_proj
// [H, nv dv]; the depthwise conv1d [2 nk dk + nv dv, 1, kernel], dt_bias and A_log [nv], the
// gated norm's weight [dv].
#define V4_GATED_DELTANET_WEIGHTS_FIELDS(X) \
  X(Linear, in_proj_qkv, {})                \
  X(Linear, in_proj_z, {})                  \
  X(Linear, in_proj_b, {})                  \
  X(Linear, in_proj_a, {})                  \
  X(Linear, out_proj, {})                   \
  X(at::Tensor, conv1d, {})                 \
  X(at::Tensor, dt_bias, {})                \
  X(at::Tensor, A_log, {})                  \
  X(at::Tensor, norm, {})

struct GatedDeltaNetWeights {
  V4_GATED_DELTANET_WEIGHTS_FIELDS(V4_DECLARE_FIELD)
};
V4_FIELD_VISITOR(GatedDeltaNetWeights, V4_GATED_DELTANET_WEIGHTS_FIELDS)

}  // namespace v4

// Qwen3.5's linear-attention block (transformers' Qwen3_5MoeGatedDeltaNet) over packed documents,
// each from a zero state, in one call: in_proj_qkv (split flat as [Q_all | K_all | V_all]),
// in_proj_z, in_proj_b (beta = sigmoid), in_proj_a (g = -exp(A_log) softplus(a + dt_bias), fp32),
// v4_causal_conv1d, v4_gated_delta_rule, the gated RMSNorm (norm in fp32, weight in h's dtype,
// silu(z) in fp32), out_proj; LoRA adapters with the projections apply.
// h [T, H], cu_seqlens int64 [N + 1] -> [T, H].
at::Tensor v4_gated_deltanet(const at::Tensor& h, const v4::GatedDeltaNetWeights& weights, int64_t num_key_heads,
                             int64_t num_value_heads, int64_t key_head_dim, int64_t value_head_dim, double eps,
                             const at::Tensor& cu_seqlens, double lora_scaling, double lora_dropout);
