// Linear maps with the LoRA adapters beside their weights: the C++ side of
// v4train/reference/lora.py.
#pragma once

#include <ATen/core/Tensor.h>

#include "cc/common/weights.h"

namespace v4 {

// The layer's LoRA scaling (alpha / r) and dropout probability on an adapter's input.
struct Lora {
  double scaling = 0.0;
  double dropout = 0.0;
};

// The adapter's input: x, or dropout(x) when lora.dropout > 0 (a fresh mask per call, as the
// reference draws one per linear map).
at::Tensor adapter_input(const at::Tensor& x, const Lora& lora);

// x W^T (+ scaling * dropout(x) A^T B^T where w has an adapter); `name` names w in messages.
at::Tensor linear(const at::Tensor& x, const Linear& w, const Lora& lora, const char* op, const char* name);

// A float8 weight (weight_scale_inv given) is refused, naming op and the map: FP8 weights do not run yet.
void check_not_fp8(const Linear& w, const char* op, const char* name);

}  // namespace v4
