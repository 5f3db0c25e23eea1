#pragma once

#include <ATen/core/Tensor.h>

// RMSNorm over the last dimension, computed in float32, returned in x's dtype:
//   y = x / sqrt(mean(x^2) + eps) * w          (GLM-5, DeepSeek-V3 style)
//   y = x / sqrt(mean(x^2) + eps) * (1 + w)    (zero_centered: Qwen3.5 decoder norms)
// x: [..., H] float32/bfloat16/float16, any strides; weight: [H], any floating dtype.
// Its backward is analytic (fp32), saving only x, weight and the per-row 1/rms.
at::Tensor v4_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                       bool zero_centered);
