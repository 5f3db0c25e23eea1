// What the FP8 tensor-core products share (cc/common/fp8.cu, fp8_grouped.cu): the activations'
// quantisation to e4m3, issue 16's path (a).
#pragma once

#include <ATen/core/Tensor.h>

namespace v4::cuda {

// The rows of a bf16 matrix [m, k] (k a multiple of 128) quantised to float8_e4m3fn per row per
// 128 columns: scale = amax / 448 (1 for a zero block, at least FLT_MIN), q = x / scale rounded to
// the nearest, saturating. q [padded, k] row-major and scale [k / 128, padded] (the [padded, k / 128]
// column-major scales cuBLAS's blockwise GEMM reads), padded = m rounded up to 16 rows, the rows
// past m zeros of scale 1. Re-copies x where its rows are not 16-byte aligned.
void quantize_rows(const at::Tensor& x, at::Tensor& q, at::Tensor& scale);

}  // namespace v4::cuda
