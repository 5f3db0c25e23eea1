// Linear maps with the LoRA adapters beside their weights: the C++ side of
// v4train/reference/lora.py.
#pragma once

#include <ATen/core/Tensor.h>

#include "cc/common/weights.h"

namespace v4 {

struct Dispatch;

// The layer's LoRA scaling (alpha / r) and dropout probability on an adapter's input.
struct Lora {
  double scaling = 0.0;
  double dropout = 0.0;
};

// Whether w has a LoRA adapter: both of its factors (one without the other is a ValueError naming
// op and the map).
bool has_adapter(const Linear& w, const char* op, const char* name);

// The adapter's input: x, or dropout(x) when lora.dropout > 0 (a fresh mask per call, as the
// reference draws one per linear map).
at::Tensor adapter_input(const at::Tensor& x, const Lora& lora);

// x W^T (+ scaling * dropout(x) A^T B^T where w has an adapter); `name` names w in messages.
at::Tensor linear(const at::Tensor& x, const Linear& w, const Lora& lora, const char* op, const char* name);

// w's weight as the products take it, in `dtype`: an FP8 checkpoint's weight (weight_scale_inv
// given: float8_e4m3fn [..., out, in] with fp32 scales [..., ceil(out/128), ceil(in/128)])
// dequantised just in time, each 128 x 128 block times its scale in fp32 (float64 for a float64
// dtype), exactly as the reference and the loader's --fp8=dequantize do
// (v4train.reference.lora.dequantize_fp8); else the weight itself. A frozen base: no gradient
// reaches an FP8 weight or its scales.
at::Tensor dense_weight(const Linear& w, at::ScalarType dtype, const char* op, const char* name);

// The device kernel that dequantises an FP8 weight (cc/common/fp8.cu on CUDA): out = weight
// [..., out, in] with each 128 x 128 block times its scale, in `dtype`; false where it declines.
struct Fp8Dequantize {
  using Fn = bool (*)(const at::Tensor& weight, const at::Tensor& scale, at::ScalarType dtype, at::Tensor& out);
};

// The device kernel of an FP8 weight's forward product x W^T on tensor cores (cc/common/fp8.cu on
// CUDA, issue 16's path (a)): x (bf16 [..., in]) quantised to float8_e4m3fn per row per 128
// columns (scale = amax / 448), times the FP8 weight [out, in] with its 128 x 128 scales, in bf16;
// false where it declines (not CUDA, not bf16, a weight of partial blocks, no rows, unaligned), and
// the product dequantises instead. Not exact against dequantise-then-linear: the activation's
// rounding to e4m3 bounds its error (docs/testing.md, "FP8 path (a)").
struct Fp8Linear {
  using Fn = bool (*)(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, at::Tensor& out);
};

// The activations' quantisation that the products on FP8 tensor cores share (cc/common/fp8.cuh
// quantize_rows: q [padded, k] e4m3 and scale [k / 128, padded]), alone for the test that holds it
// to its definition bit for bit; false where it declines (not CUDA, not a bf16 [m, k] of whole blocks).
struct Fp8QuantizeRows {
  using Fn = bool (*)(const at::Tensor& x, at::Tensor& q, at::Tensor& scale);
};

// The device kernel of the routed experts' product on FP8 weights (cc/common/fp8_grouped.cu on
// CUDA): each row of x (bf16, grouped by expert; offsets [E] int32, the end of each expert's rows,
// the last one x's row count, as dispatch() makes them)
// times its expert's weight [E, out, in] with its 128 x 128 scales: x W_e^T, or x W_e where
// `transposed` (the backward). With `e4m3` false the weight is dequantised tile by tile inside the
// GEMM to the values dense_weight gives, so the product is dequantise-then-grouped-GEMM's up to
// the order of its sums; with `e4m3` x is quantised as Fp8Linear's and the products run on FP8
// tensor cores, within path (a)'s bound. False where it declines (not sm_90, not bf16, a weight of
// partial blocks, no rows).
struct Fp8GroupedProduct {
  using Fn = bool (*)(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, const at::Tensor& offsets,
                      bool transposed, bool e4m3, at::Tensor& out);
};

// Which FP8 products take FP8 tensor cores, x (or dy) quantised to e4m3 per row per 128 columns
// (path (a), not exact against dequantise-then-linear): a mask of the Fp8TensorCores bits, read
// from V4TRAIN_FP8_TENSOR_CORES at each call (so one process can time each): a comma list of
// `experts` (the routed experts' products, both ways), `experts_forward` (their forward alone: the
// backward's tile transposition made it slower than the bf16 kernel, H100, docs/benchmarks.md),
// `dense_backward` (a dense map's dy W),
// `dense_forward` (its x W^T); `all` (or 1); `none` (or 0, or unset). An unknown word is an error
// naming the variable. Opt-in while the experts' FP8 kernel waits for its CUDA parity and
// timing (docs/gpu.md); the dense forward moved the proxy's loss 6.6e-2 after 50 steps
// (docs/benchmarks.md), the experts both ways 4.4e-3.
enum Fp8TensorCores : unsigned { kFp8Experts = 1, kFp8DenseBackward = 2, kFp8DenseForward = 4, kFp8ExpertsForward = 8 };
unsigned fp8_tensor_cores();

// x times w's FP8 weight (its scales checked), dequantised as dense_weight does, just in time in
// the forward and again in the backward: x W^T, or with `grouped` each row of x (grouped by
// expert) times its expert's weight [E, out, in]. On CUDA the grouped product takes
// Fp8GroupedProduct both ways; the dense forward takes Fp8Linear, and the dense backward
// Fp8GroupedProduct (the weight as one expert), where fp8_tensor_cores() asks for them; else the
// dense maps dequantise. No gradient to the weight (a frozen base).
at::Tensor fp8_product(const at::Tensor& x, const Linear& w, const Dispatch* grouped, const char* op, const char* name);

}  // namespace v4
