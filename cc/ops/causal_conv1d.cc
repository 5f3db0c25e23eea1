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
  // Each token's position in its document: tap j reaches back only where it is at least j.
  std::vector<int64_t> pos(T);
  for (const auto& [start, end] : docs) {
    for (int64_t t = start; t < end; ++t) pos[t] = t - start;
  }
  const at::Tensor position = at::tensor(pos, x.options().dtype(at::kLong)).unsqueeze(1);
  const auto compute = v4::compute_dtype(x.scalar_type());
  const at::Tensor xf = x.to(compute), w = weight.to(compute).select(1, 0);  // [C, K]
  at::Tensor y = xf * w.select(1, K - 1);
  for (int64_t j = 1; j < K && j < T; ++j) {
    const at::Tensor earlier = at::constant_pad_nd(xf.slice(0, 0, T - j), {0, 0, j, 0});
    // where, not a product with the mask: a value of another document (even inf) must not leak.
    y = y + at::where(position >= j, earlier, 0) * w.select(1, K - 1 - j);
  }
  return at::silu(y).to(x.scalar_type());
}
