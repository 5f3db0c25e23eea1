#include "cc/ops/embedding.h"

#include <ATen/ATen.h>

#include "cc/common/checks.h"

at::Tensor v4_embedding(const at::Tensor& input_ids, const at::Tensor& weight) {
  constexpr const char* op = "v4_embedding";
  TORCH_CHECK_VALUE(input_ids.defined() && input_ids.scalar_type() == at::kLong, op, ": input_ids must be int64");
  v4::check_floating(op, "weight", weight);
  v4::check_dim(op, "weight", weight, 2);
  v4::check_same_device(op, "input_ids", input_ids, "weight", weight);
  // A table of width 0 embeds nothing; on CUDA its gradient faulted (the fuzzer, docs/gpu.md).
  TORCH_CHECK_VALUE(weight.size(1) > 0, op, ": weight has shape ", weight.sizes(), ", expected [vocab, hidden > 0]");
  if (input_ids.numel() > 0) {
    const auto [lo, hi] = at::aminmax(input_ids);
    const int64_t vocab = weight.size(0);
    TORCH_CHECK_VALUE(lo.item<int64_t>() >= 0 && hi.item<int64_t>() < vocab, op, ": input_ids must lie in [0, ",
                      vocab, "), got [", lo.item<int64_t>(), ", ", hi.item<int64_t>(), "]");
  }
  return at::embedding(weight, input_ids);
}
