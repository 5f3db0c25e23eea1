#pragma once

#include <ATen/core/Tensor.h>

// RMSNorm over the last dimension, computed in float32, returned in x's dtype:
//   y = x / sqrt(mean(x^2) + eps) * w          (GLM-5, DeepSeek-V3 style)
//   y = x / sqrt(mean(x^2) + eps) * (1 + w)    (zero_centered: Qwen3.5 decoder norms)
// x: [..., H] float32/bfloat16/float16, any strides; weight: [H], any floating dtype.
// Its backward is analytic (fp32), saving only x, weight and the per-row 1/rms.
at::Tensor v4_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                       bool zero_centered);

namespace v4::rms {

// The device kernels (cc/ops/rms_norm.cu; v4::Backend), a block of threads a row with the row in
// registers: x [rows, H] float32 or bfloat16, contiguous, 16-byte aligned, H a multiple of 8 and at
// most kMaxWidth; s the float32 scale [H] (w, or 1 + w). The forward pass sets y (x's dtype) and
// rstd ([rows] float32); the backward pass takes dy (like x) and sets dx (x's dtype) and ds ([H]
// float32), one kernel each. Same roundings as the ATen path: (x rstd) s in float32, rounded once.
constexpr int64_t kMaxWidth = 8192;

struct Norm {
  at::Tensor x, s;
  double eps = 0.0;
  at::Tensor y, rstd;
  at::Tensor dy, dx, ds;
};

struct Kernel {
  using Fn = void (*)(Norm& n, bool backward);
};

}  // namespace v4::rms
