#include "cc/models/qwen3_5/gated_deltanet.h"

#include <ATen/ATen.h>

#include "cc/common/checks.h"
#include "cc/ops/causal_conv1d.h"
#include "cc/ops/gated_delta_rule.h"

at::Tensor v4_gated_deltanet(const at::Tensor& h, const v4::GatedDeltaNetWeights& weights, int64_t num_key_heads,
                             int64_t num_value_heads, int64_t key_head_dim, int64_t value_head_dim, double eps,
                             const at::Tensor& cu_seqlens, double lora_scaling, double lora_dropout) {
  constexpr const char* op = "v4_gated_deltanet";
  v4::check_floating(op, "h", h, /*float64=*/true);
  v4::check_dim(op, "h", h, 2);
  v4::check_weights(op, weights, h);
  const int64_t T = h.size(0), nk = num_key_heads, nv = num_value_heads, dk = key_head_dim, dv = value_head_dim;
  TORCH_CHECK_VALUE(nk >= 1 && nv >= 1 && dk >= 1 && dv >= 1 && nv % nk == 0, op, ": heads ", nk, " (key) and ", nv,
                    " (value) of dims ", dk, " and ", dv, " do not fit: value heads must be a multiple of key heads");
  const at::Tensor& qkv_w = weights.in_proj_qkv.weight;
  TORCH_CHECK_VALUE(qkv_w.dim() == 2 && qkv_w.size(0) == 2 * nk * dk + nv * dv && qkv_w.size(1) == h.size(1), op,
                    ": in_proj_qkv.weight has shape ", qkv_w.sizes(), ", expected [", 2 * nk * dk + nv * dv,
                    ", ", h.size(1), "]");
  const v4::Lora lora{lora_scaling, lora_dropout};
  const auto compute = v4::compute_dtype(h.scalar_type());

  const at::Tensor qkv = v4::linear(h, weights.in_proj_qkv, lora, op, "in_proj_qkv");
  const at::Tensor z = v4::linear(h, weights.in_proj_z, lora, op, "in_proj_z").view({T, nv, dv});
  const at::Tensor beta = v4::linear(h, weights.in_proj_b, lora, op, "in_proj_b").sigmoid();
  // g in float64: the A_log and dt_bias gradients sum g's gradient over every token with heavy
  // cancellation (in fp32 their error came out 1e-4 of their norm, against 7e-6); the delta rule
  // takes g's cumulative sums in float64 anyway.
  const at::Tensor a = v4::linear(h, weights.in_proj_a, lora, op, "in_proj_a").to(at::kDouble);
  const at::Tensor g = -weights.A_log.to(at::kDouble).exp() *
                       at::softplus(a + weights.dt_bias.to(at::kDouble));
  const at::Tensor x = v4_causal_conv1d(qkv, weights.conv1d, cu_seqlens);
  const at::Tensor q = x.slice(-1, 0, nk * dk).reshape({T, nk, dk});
  const at::Tensor k = x.slice(-1, nk * dk, 2 * nk * dk).reshape({T, nk, dk});
  const at::Tensor v = x.slice(-1, 2 * nk * dk).reshape({T, nv, dv});
  const at::Tensor core = v4::gdr::gated_delta_rule(q, k, v, g, beta, cu_seqlens).reshape({-1, dv});
  // The gated RMSNorm, in the reference's order of dtypes.
  const at::Tensor cf = core.to(compute);
  const at::Tensor normed = (cf * at::rsqrt(cf.square().mean(-1, /*keepdim=*/true) + eps)).to(core.scalar_type());
  const at::Tensor y = (weights.norm * normed * at::silu(z.reshape({-1, dv}).to(compute)))
                           .to(h.scalar_type());
  return v4::linear(y.reshape({T, nv * dv}), weights.out_proj, lora, op, "out_proj");
}
