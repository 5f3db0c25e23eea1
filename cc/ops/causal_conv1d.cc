#include "cc/ops/causal_conv1d.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "cc/common/backend.h"
#include "cc/common/checks.h"

// Named (not anonymous) so that autograd shows the node as CppNode<v4::conv::FusedConv>.
namespace v4::conv {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The device kernels as one autograd node; it keeps x, w and cu_seqlens.
struct FusedConv : public torch::autograd::Function<FusedConv> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& cu_seqlens) {
    Conv c{x.contiguous(), weight.select(1, 0).to(at::kFloat).contiguous(), cu_seqlens};
    Backend<Kernel>::find(x.device().type())(c, false);
    ctx->save_for_backward({c.x, c.w, cu_seqlens});
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    return c.y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "v4_causal_conv1d: no second derivative on the GPU (create_graph=True)");
    const auto s = ctx->get_saved_variables();
    Conv c{s[0], s[1], s[2]};
    c.dy = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(c.x);
    Backend<Kernel>::find(c.x.device().type())(c, true);
    const auto weight_dtype = static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    return {c.dx, c.dw.unsqueeze(1).to(weight_dtype), at::Tensor()};
  }
};

}  // namespace v4::conv

at::Tensor v4_causal_conv1d(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cu_seqlens) {
  constexpr const char* op = "v4_causal_conv1d";
  v4::check_floating(op, "x", x, /*float64=*/true);
  v4::check_dim(op, "x", x, 2);
  v4::check_floating(op, "weight", weight, /*float64=*/true);
  TORCH_CHECK_VALUE(weight.dim() == 3 && weight.size(0) == x.size(1) && weight.size(1) == 1 && weight.size(2) >= 1, op,
                    ": weight has shape ", weight.sizes(), ", expected [C=", x.size(1), ", 1, kernel size]");
  v4::check_same_device(op, "weight", weight, "x", x);
  const int64_t T = x.size(0), K = weight.size(2);
  const auto docs = v4::documents(op, cu_seqlens, T);
  const auto dtype = x.scalar_type();
  if (v4::Backend<v4::conv::Kernel>::find(x.device().type()) != nullptr && T > 0 && x.size(1) > 0 &&
      (dtype == at::kFloat || dtype == at::kBFloat16) && K <= v4::conv::kMaxKernel) {
    return v4::conv::FusedConv::apply(x, weight, v4::upload(cu_seqlens, x.device()));
  }
  const auto compute = v4::compute_dtype(dtype);
  const at::Tensor xf = x.to(compute), w = weight.to(compute).select(1, 0);  // [C, K]
  at::Tensor y = xf * w.select(1, K - 1);
  // Tap j adds w[:, K-1-j] x[t - j] to the tokens t at least j into their document, gathered by
  // index: a tap outside the document is not computed at all (not multiplied by zero), so no inf
  // or NaN of another document or of the weight reaches an output or gradient it does not touch.
  for (int64_t j = 1; j < K; ++j) {
    std::vector<int64_t> rows;
    for (const auto& [start, end] : docs) {
      for (int64_t t = start + j; t < end; ++t) rows.push_back(t);
    }
    if (rows.empty()) break;
    const at::Tensor to = at::tensor(rows, x.options().dtype(at::kLong));
    y = y.index_add(0, to, xf.index_select(0, to - j) * w.select(1, K - 1 - j));
  }
  return at::silu(y).to(dtype);
}
