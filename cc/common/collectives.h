// Collectives called from C++ (the layer ops' expert-parallel exchange, the global gradient norm):
// the dispatcher's functional collectives (_c10d_functional), the group resolved by its registered
// name (a torch.distributed group's `group_name`), NCCL on CUDA and gloo on the CPU through the
// same code. Each call waits for its result.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace v4 {

// x's rows to the ranks of `group`: in_splits[r] rows to rank r, out_splits[r] rows from it.
at::Tensor all_to_all(const at::Tensor& x, const std::vector<int64_t>& out_splits,
                      const std::vector<int64_t>& in_splits, const std::string& group);

// The elementwise sum of x over the ranks of `group` (a new tensor; x is unchanged).
at::Tensor all_reduce_sum(const at::Tensor& x, const std::string& group);

}  // namespace v4
