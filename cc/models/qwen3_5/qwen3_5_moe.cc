#include "cc/models/qwen3_5/qwen3_5_moe.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "cc/common/checks.h"
#include "cc/common/experts.h"
#include "cc/ops/mlp.h"

std::tuple<at::Tensor, at::Tensor> v4_qwen3_5_moe(const at::Tensor& x, const v4::Qwen35MoeWeights& weights,
                                                  int64_t top_k, bool norm_topk_prob, double lora_scaling,
                                                  double lora_dropout, const std::optional<at::Tensor>& routing,
                                                  const std::optional<v4::ExpertParallel>& expert_parallel_given) {
  const v4::ExpertParallel expert_parallel = expert_parallel_given.value_or(v4::ExpertParallel{});
  constexpr const char* op = "v4_qwen3_5_moe";
  v4::check_floating(op, "x", x, /*float64=*/true);
  v4::check_dim(op, "x", x, 2);
  v4::check_weights(op, weights, x);
  const at::Tensor& gate = weights.gate;
  const at::Tensor& shared_gate = weights.shared_expert_gate;
  const int64_t E = gate.size(0), T = x.size(0);
  TORCH_CHECK_VALUE(gate.dim() == 2 && gate.size(1) == x.size(1), op, ": gate has shape ",
                    gate.sizes(), ", expected [experts, ", x.size(1), "]");
  TORCH_CHECK_VALUE(shared_gate.dim() == 2 && shared_gate.size(0) == 1 && shared_gate.size(1) == x.size(1), op,
                    ": shared_expert_gate has shape ", shared_gate.sizes(), ", expected [1, ", x.size(1), "]");
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= E, op, ": top_k=", top_k, " must lie in [1, ", E, "] (the experts)");
  v4::check_experts(op, weights.experts, x, E, expert_parallel);

  // The router: the reference's ATen calls in its order, so the choice is the same bit for bit.
  const at::Tensor logits = at::linear(x, gate);
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
  at::Tensor route_weights, idx;
  if (routing) {
    idx = *routing;
    v4::check_routing(op, idx, x, top_k, E);
    route_weights = probs.gather(1, idx);
  } else {
    std::tie(route_weights, idx) = at::topk(probs, top_k, -1);
  }
  if (norm_topk_prob) route_weights = route_weights / route_weights.sum(-1, /*keepdim=*/true);
  route_weights = route_weights.to(logits.scalar_type());

  const v4::Lora lora{lora_scaling, lora_dropout};
  const at::Tensor shared = v4_mlp(x, weights.shared_expert, lora_scaling, lora_dropout) *
                            at::sigmoid(at::linear(x, shared_gate));
  const v4::Dispatch d = v4::dispatch(idx, E);
  const at::Tensor y_rows = v4::routed_experts(x, weights.experts, lora, d, expert_parallel, op);
  return {v4::combine(y_rows, d, route_weights, T) + shared, idx};
}
