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

namespace v4::gdn {

// The gated RMSNorm's device kernels (cc/models/qwen3_5/gated_deltanet.cu; v4::Backend), for x,
// z [rows, D] and w [D] contiguous in one dtype (float32 or bfloat16), D <= kMaxNormWidth:
// y = round(w round(x r)) silu(z) with r = rsqrt(mean(x^2) + eps), rounding to the dtype where the
// reference does (its normed x and w times it are in x's dtype), computed in float32. The forward
// pass sets y and keeps r ([rows] float32); the backward takes dy and sets dx, dz (the dtype) and
// dw ([D] float32), without the reference's roundings of the intermediate gradients.
constexpr int64_t kMaxNormWidth = 256;

struct GatedNorm {
  at::Tensor x, z, w;
  double eps = 0.0;
  at::Tensor y, rstd;
  at::Tensor dy, dx, dz, dw;
};

struct GatedNormKernel {
  using Fn = void (*)(GatedNorm& n, bool backward);
};

}  // namespace v4::gdn

