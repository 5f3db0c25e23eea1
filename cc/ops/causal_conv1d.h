#pragma once

#include <ATen/core/Tensor.h>

// Gated DeltaNet's short convolution over packed documents (transformers' Qwen3_5MoeGatedDeltaNet
// conv1d + SiLU): y[t, c] = silu(sum_j weight[c, 0, K-1-j] x[t-j, c]) over the previous K-1
// tokens of t's own document (none across a boundary: the state resets at each document).
// x [T, C] float32/bfloat16/float16/float64, any strides; weight [C, 1, K]; cu_seqlens int64
// [N + 1]. Computed in float32 (float64 for float64), returned in x's dtype.
at::Tensor v4_causal_conv1d(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cu_seqlens);

namespace v4::conv {

// The device kernels (cc/ops/causal_conv1d.cu; v4::Backend), for x float32 or bfloat16 and
// K <= kMaxKernel: x [T, C] contiguous, w [C, K] float32 contiguous, cu_seqlens int64 [N + 1] on
// x's device. The forward pass sets y (x's dtype); the backward pass takes dy (x's dtype,
// contiguous) and sets dx (x's dtype) and dw ([C, K] float32), one kernel each, the SiLU
// recomputed.
constexpr int64_t kMaxKernel = 8;

struct Conv {
  at::Tensor x, w, cu_seqlens;
  at::Tensor y, dy, dx, dw;
};

struct Kernel {
  using Fn = void (*)(Conv& c, bool backward);
};

}  // namespace v4::conv
