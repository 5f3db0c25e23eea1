// Dense attention of one document, shared by the attention ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace v4 {

// x's rows [T, ...] as one view a document (docs tile [0, T) in order, as documents() checks), from
// one split: its backward is one concatenation, where a slice's writes a zero tensor of x's whole
// size, so that slicing each of a packed batch's documents took a backward quadratic in T (a
// micro-batch of many short chats, the usual SFT batch).
std::vector<at::Tensor> per_document(const at::Tensor& x, const std::vector<std::pair<int64_t, int64_t>>& docs);

// softmax(q k^T * scale [+ causal or boolean mask]) v for one document, heads second: q [Lq, Hq, D],
// k [Lk, Hk, D], v [Lk, Hk, Dv], Hq a multiple of Hk (query head h reads key head h / (Hq / Hk),
// transformers' repeat_kv). Returns [Lq, Hq, Dv]. On the GPU, float32/bf16/fp16 through
// at::scaled_dot_product_attention (flash, cuDNN or memory-efficient kernels), with inputs
// re-laid out where a row is not 16-byte aligned. On the CPU, and in float64 anywhere, explicit
// products and softmax in float32 (float64): SDPA computes float64 through float32 steps (1e-7
// off), and its fused CPU backward takes softmax's row term from the bf16-rounded output, so
// that a key gradient that cancels (a query attending almost only to one key, as in a document
// of one or two tokens) came out 20% off in bf16 (found by the wide parity profile). The CPU
// trains small models, where the [heads, queries, keys] scores this keeps are affordable. Every
// query must keep at least one key (causal rows keep their own; a mask row with none is NaN on
// the CPU and 0 through SDPA).
at::Tensor sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal,
                const std::optional<at::Tensor>& mask = std::nullopt);

}  // namespace v4
