#include "cc/models/qwen3_5/gated_deltanet.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "cc/common/backend.h"
#include "cc/common/checks.h"
#include "cc/ops/causal_conv1d.h"
#include "cc/ops/gated_delta_rule.h"

// Named (not anonymous) so that autograd shows the node as CppNode<v4::gdn::FusedGatedNorm>.
namespace v4::gdn {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The device kernels as one autograd node; it keeps x, z, w and r.
struct FusedGatedNorm : public torch::autograd::Function<FusedGatedNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& z, const at::Tensor& w,
                            double eps) {
    GatedNorm n{x.contiguous(), z.contiguous(), w.contiguous(), eps};
    Backend<GatedNormKernel>::find(x.device().type())(n, false);
    ctx->save_for_backward({n.x, n.z, n.w, n.rstd});
    return n.y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "v4_gated_deltanet: no second derivative of the gated norm on the GPU (create_graph=True)");
    const auto s = ctx->get_saved_variables();
    GatedNorm n{s[0], s[1], s[2]};
    n.rstd = s[3];
    n.dy = grads[0].contiguous();
    Backend<GatedNormKernel>::find(n.x.device().type())(n, true);
    return {n.dx, n.dz, n.dw.to(n.w.scalar_type()), at::Tensor()};
  }
};

// RMSNorm(x) * w * silu(z) over rows of width D, in the reference's order of dtypes (the norm in
// the compute dtype, rounded to x's dtype, times w; silu(z) in the compute dtype), returned in
// `out` dtype: by the device kernels where they cover the call, else in ATen.
at::Tensor gated_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& w, double eps,
                      at::ScalarType out) {
  const auto dtype = x.scalar_type();
  if (Backend<GatedNormKernel>::find(x.device().type()) != nullptr && (dtype == at::kFloat || dtype == at::kBFloat16) &&
      z.scalar_type() == dtype && w.scalar_type() == dtype && out == dtype && x.size(-1) <= kMaxNormWidth &&
      x.numel() > 0) {
    return FusedGatedNorm::apply(x, z, w, eps);
  }
  const auto compute = v4::compute_dtype(dtype);
  const at::Tensor xf = x.to(compute);
  const at::Tensor normed = (xf * at::rsqrt(xf.square().mean(-1, /*keepdim=*/true) + eps)).to(dtype);
  return (w * normed * at::silu(z.to(compute))).to(out);
}

}  // namespace v4::gdn

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
  const at::Tensor y = v4::gdn::gated_norm(core, z.reshape({-1, dv}), weights.norm, eps, h.scalar_type());
  return v4::linear(y.reshape({T, nv * dv}), weights.out_proj, lora, op, "out_proj");
}
