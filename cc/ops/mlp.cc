#include "cc/ops/mlp.h"

#include <ATen/ATen.h>

#include "cc/common/checks.h"

at::Tensor v4_mlp(const at::Tensor& x, const v4::MlpWeights& weights, double lora_scaling, double lora_dropout) {
  constexpr const char* op = "v4_mlp";
  v4::check_floating(op, "x", x, /*float64=*/true);
  v4::check_dim(op, "x", x, 2);
  v4::check_weights(op, weights, x);
  const v4::Lora lora{lora_scaling, lora_dropout};
  // One statement per map: the adapters draw their dropout masks in the reference's order.
  const at::Tensor gate = v4::linear(x, weights.gate_proj, lora, op, "gate_proj");
  const at::Tensor up = v4::linear(x, weights.up_proj, lora, op, "up_proj");
  return v4::linear(at::silu(gate) * up, weights.down_proj, lora, op, "down_proj");
}
