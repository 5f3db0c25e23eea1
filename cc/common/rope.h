// Rotary position embeddings: frequencies (default and YaRN) and the rotations, mirroring
// v4train/reference/rope.py operation for operation (so both compute the same bits).
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

#include "cc/common/config.h"

namespace v4 {

// cos, sin [T, rope.dim] (the half frequencies repeated twice, times YaRN's attention factor), in dtype.
std::pair<at::Tensor, at::Tensor> rope_cos_sin(const Rope& rope, const at::Tensor& positions, at::ScalarType dtype);

// The extra softmax scale of YaRN with mscale_all_dim (DeepSeek/GLM `yarn_apply_mscale`).
double rope_softmax_scale_factor(const Rope& rope);

// GLM-5/DeepSeek interleaved RoPE on x [T, heads, dim]: pairs (x0, x1), (x2, x3), ... rotate; the
// result lists the rotated even elements, then the odd ones.
at::Tensor rope_interleaved(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// Qwen's partial RoPE on x [T, heads, head_dim]: rotate_half on the first cos.size(-1) dims, the
// rest passed through.
at::Tensor rope_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace v4
