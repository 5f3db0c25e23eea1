#include "cc/common/lora.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace v4 {

at::Tensor adapter_input(const at::Tensor& x, const Lora& lora) {
  return lora.dropout > 0 ? at::dropout(x, lora.dropout, /*train=*/true) : x;
}

void check_not_fp8(const Linear& w, const char* op, const char* name) {
  TORCH_CHECK_VALUE(!w.weight_scale_inv.has_value(), op, ": ", name, " is an FP8 weight with block scales; the C++ ops ",
                    "take bf16/fp32 weights (load the checkpoint dequantised)");
}

at::Tensor linear(const at::Tensor& x, const Linear& w, const Lora& lora, const char* op, const char* name) {
  check_not_fp8(w, op, name);
  const at::Tensor& weight = w.weight;
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == x.size(-1), op, ": ", name, ".weight has shape ",
                    weight.sizes(), ", expected [out, ", x.size(-1), "] for an input of shape ", x.sizes());
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), op, ": ", name, ".weight is ", weight.scalar_type(),
                    " but its input is ", x.scalar_type());
  at::Tensor y = at::linear(x, weight);
  if (!w.has_adapter()) return y;
  TORCH_CHECK_VALUE(w.lora_B.has_value(), op, ": the adapter of ", name, " has lora_A but no lora_B");
  const at::Tensor &a = *w.lora_A, &b = *w.lora_B;
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && a.size(1) == weight.size(1) && b.size(0) == weight.size(0) &&
                        b.size(1) == a.size(0),
                    op, ": the adapter of ", name, " ", weight.sizes(), " has A ", a.sizes(), " and B ", b.sizes(),
                    ", expected [r, ", weight.size(1), "] and [", weight.size(0), ", r]");
  return y + at::linear(at::linear(adapter_input(x, lora), a), b) * lora.scaling;
}

}  // namespace v4
