// Dense attention of one document through ATen's fused kernels, shared by the attention ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace v4 {

// softmax(q k^T * scale [+ causal or boolean mask]) v for one document, heads second: q [Lq, Hq, D],
// k [Lk, Hk, D], v [Lk, Hk, Dv], Hq a multiple of Hk (query head h reads key head h / (Hq / Hk),
// transformers' repeat_kv). Returns [Lq, Hq, Dv]. float32/bf16/fp16 through
// at::scaled_dot_product_attention (flash, cuDNN or memory-efficient kernels on the GPU), with
// inputs re-laid out where a row is not 16-byte aligned; float64, the dtype the parity suite checks
// the math in, with explicit products (SDPA computes float64 through float32 steps, 1e-7 off).
at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal,
                const std::optional<at::Tensor>& mask = std::nullopt);

}  // namespace v4
