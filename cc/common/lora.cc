#include "cc/common/lora.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace v4 {

std::pair<std::string, std::string> adapter_names(const std::string& weight_name) {
  const std::string suffix = ".weight";
  const bool module_weight =
      weight_name.size() > suffix.size() && weight_name.compare(weight_name.size() - suffix.size(), suffix.size(), suffix) == 0;
  const std::string base =
      module_weight ? weight_name.substr(0, weight_name.size() - suffix.size()) + "." : weight_name + "_";
  return {base + "lora_A", base + "lora_B"};
}

void check_weights(const char* op, const Weights& weights, const at::Tensor& x) {
  for (const auto& [name, w] : weights) {
    TORCH_CHECK_VALUE(w.defined(), op, ": weights[", name, "] is undefined");
    TORCH_CHECK_VALUE(w.is_floating_point(), op, ": weights[", name, "] must be floating point, got ", w.scalar_type());
    TORCH_CHECK_VALUE(w.device() == x.device(), op, ": weights[", name, "] is on ", w.device(), " but the input is on ",
                      x.device());
  }
}

const at::Tensor& get(const Weights& weights, const std::string& name, const char* op) {
  const auto it = weights.find(name);
  TORCH_CHECK_VALUE(it != weights.end() && it->second.defined(), op, ": weights lacks the tensor ", name);
  return it->second;
}

bool has_adapter(const Weights& weights, const std::string& weight_name) {
  return weights.count(adapter_names(weight_name).first) > 0;
}

at::Tensor adapter_input(const at::Tensor& x, const Lora& lora) {
  return lora.dropout > 0 ? at::dropout(x, lora.dropout, /*train=*/true) : x;
}

at::Tensor linear(const at::Tensor& x, const Weights& weights, const std::string& name, const Lora& lora,
                  const char* op) {
  const at::Tensor& w = get(weights, name, op);
  TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == x.size(-1), op, ": ", name, " has shape ", w.sizes(),
                    ", expected [out, ", x.size(-1), "] for an input of shape ", x.sizes());
  TORCH_CHECK_VALUE(w.scalar_type() == x.scalar_type(), op, ": ", name, " is ", w.scalar_type(), " but its input is ",
                    x.scalar_type());
  at::Tensor y = at::linear(x, w);
  if (!has_adapter(weights, name)) return y;
  const auto [a_name, b_name] = adapter_names(name);
  const at::Tensor &a = get(weights, a_name, op), &b = get(weights, b_name, op);
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && a.size(1) == w.size(1) && b.size(0) == w.size(0) &&
                        b.size(1) == a.size(0),
                    op, ": the adapter of ", name, " ", w.sizes(), " has A ", a.sizes(), " and B ", b.sizes(),
                    ", expected [r, ", w.size(1), "] and [", w.size(0), ", r]");
  return y + at::linear(at::linear(adapter_input(x, lora), a), b) * lora.scaling;
}

}  // namespace v4
