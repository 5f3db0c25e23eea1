#include "cc/ops/causal_conv1d.h"

#include <ATen/ATen.h>

#include "cc/common/checks.h"

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
  const auto compute = v4::compute_dtype(x.scalar_type());
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
  return at::silu(y).to(x.scalar_type());
}
