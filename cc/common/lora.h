// A layer's tensors by their transformers names, and linear maps with the LoRA adapters that
// sit beside their weights: the C++ side of v4train/reference/lora.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <utility>

namespace v4 {

using Weights = std::map<std::string, at::Tensor>;

// The layer's LoRA scaling (alpha / r) and dropout probability on an adapter's input.
struct Lora {
  double scaling = 0.0;
  double dropout = 0.0;
};

// The (A, B) names of the adapter of a weight: X.weight -> X.lora_A, X.lora_B; a fused expert
// tensor P -> P_lora_A, P_lora_B.
std::pair<std::string, std::string> adapter_names(const std::string& weight_name);

// Every tensor of a layer's weights defined, floating and on x's device: a tensor on another
// device (a CPU or meta one among CUDA ones) is refused by name before any compute.
void check_weights(const char* op, const Weights& weights, const at::Tensor& x);

// weights[name], or a ValueError naming the op and the missing tensor.
const at::Tensor& get(const Weights& weights, const std::string& name, const char* op);

bool has_adapter(const Weights& weights, const std::string& weight_name);

// The adapter's input: x, or dropout(x) when lora.dropout > 0 (a fresh mask per call, as the
// reference draws one per linear map).
at::Tensor adapter_input(const at::Tensor& x, const Lora& lora);

// x W^T (+ scaling * dropout(x) A^T B^T when the weight has an adapter).
at::Tensor linear(const at::Tensor& x, const Weights& weights, const std::string& name, const Lora& lora,
                  const char* op);

}  // namespace v4
