#include "cc/ops/rms_norm.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>

#include "cc/common/backend.h"
#include "cc/common/checks.h"

// Named (not anonymous) so that autograd shows the node as CppNode<v4::RmsNorm>.
namespace v4 {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor scale_of(const at::Tensor& weight, bool zero_centered, at::ScalarType compute) {
  const at::Tensor w = weight.to(compute);
  return zero_centered ? w + 1.0 : w;
}

// A copy in the compute dtype that in-place ops may overwrite (x.to(dtype) would alias x).
at::Tensor compute_copy(const at::Tensor& t, at::ScalarType compute) {
  return t.to(compute, /*non_blocking=*/false, /*copy=*/true);
}

// Every [rows, H] float32 temporary is as large as four bf16 activations, so the ops below work
// in place on the few they need.
struct RmsNorm : public torch::autograd::Function<RmsNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps, bool zero_centered) {
    const auto compute = v4::compute_dtype(x.scalar_type());
    at::Tensor y = compute_copy(x, compute);
    const at::Tensor rstd = at::rsqrt(y.square().mean(-1, /*keepdim=*/true) + eps);
    ctx->save_for_backward({x, weight, rstd});
    ctx->saved_data["zero_centered"] = zero_centered;
    return y.mul_(rstd).mul_(scale_of(weight, zero_centered, compute)).to(x.scalar_type());
  }

  // With xhat = x * rstd and s the scale (w or 1 + w), y = xhat * s, so
  //   dx = rstd * (g*s - xhat * mean(g*s*xhat))      dw = sum over rows of g*xhat
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& rstd = saved[2];
    const bool zero_centered = ctx->saved_data["zero_centered"].toBool();
    const auto compute = v4::compute_dtype(x.scalar_type());
    at::Tensor g = compute_copy(grads[0], compute);
    at::Tensor xhat = compute_copy(x, compute).mul_(rstd);

    at::Tensor dx, dw;
    if (ctx->needs_input_grad(1)) {
      dw = (g * xhat).reshape({-1, x.size(-1)}).sum(0).to(weight.scalar_type());
    }
    if (ctx->needs_input_grad(0)) {
      at::Tensor& gs = g.mul_(scale_of(weight, zero_centered, compute));
      const at::Tensor dot = (gs * xhat).mean(-1, /*keepdim=*/true);
      dx = gs.sub_(xhat.mul_(dot)).mul_(rstd).to(x.scalar_type());
    }
    return {dx, dw, at::Tensor(), at::Tensor()};
  }
};

// The device kernels as one autograd node over rows [rows, H]; it keeps x, the float32 scale and
// 1 / rms.
struct FusedRmsNorm : public torch::autograd::Function<FusedRmsNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps,
                            bool zero_centered) {
    rms::Norm n{dense16(x.reshape({-1, x.size(-1)})), scale_of(weight, zero_centered, at::kFloat).contiguous(), eps};
    Backend<rms::Kernel>::find(x.device().type())(n, false);
    ctx->save_for_backward({n.x, n.s, n.rstd});
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    return n.y.view(x.sizes());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "v4_rms_norm: no second derivative on the GPU (create_graph=True)");
    const auto saved = ctx->get_saved_variables();
    rms::Norm n{saved[0], saved[1]};
    n.rstd = saved[2];
    n.dy = dense16(grads[0].reshape(n.x.sizes()).to(n.x.scalar_type()));
    Backend<rms::Kernel>::find(n.x.device().type())(n, true);
    const auto weight_dtype = static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    return {n.dx.view(grads[0].sizes()), n.ds.to(weight_dtype), at::Tensor(), at::Tensor()};
  }
};

}  // namespace v4

at::Tensor v4_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                       bool zero_centered) {
  constexpr const char* op = "v4_rms_norm";
  v4::check_floating(op, "x", x, /*float64=*/true);
  v4::check_min_dim(op, "x", x, 1);
  v4::check_floating(op, "weight", weight, /*float64=*/true);
  v4::check_dim(op, "weight", weight, 1);
  v4::check_size(op, "weight", weight, 0, x.size(-1), "x.size(-1)");
  v4::check_same_device(op, "weight", weight, "x", x);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps > 0, op, ": eps must be a finite number > 0, got ",
                    eps);
  TORCH_CHECK_VALUE(x.size(-1) > 0, op, ": x.size(-1) must be > 0, got shape ", x.sizes());
  const auto dtype = x.scalar_type();
  const int64_t H = x.size(-1);
  if (v4::Backend<v4::rms::Kernel>::find(x.device().type()) != nullptr && (dtype == at::kFloat || dtype == at::kBFloat16) &&
      H % 8 == 0 && H <= v4::rms::kMaxWidth && x.numel() > 0) {
    return v4::FusedRmsNorm::apply(x, weight, eps, zero_centered);
  }
  return v4::RmsNorm::apply(x, weight, eps, zero_centered);
}
