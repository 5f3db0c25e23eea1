#include "cc/models/glm5/glm5_moe.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <limits>

#include "cc/common/checks.h"
#include "cc/common/experts.h"
#include "cc/ops/mlp.h"

std::tuple<at::Tensor, at::Tensor> v4_glm5_moe(const at::Tensor& x, const v4::Glm5MoeWeights& weights, int64_t top_k, int64_t n_group, int64_t topk_group, bool norm_topk_prob,
                                          double routed_scaling_factor, double lora_scaling, double lora_dropout,
                                          const std::optional<at::Tensor>& routing,
                                          const std::optional<v4::ExpertParallel>& expert_parallel_given) {
  const v4::ExpertParallel expert_parallel = expert_parallel_given.value_or(v4::ExpertParallel{});
  constexpr const char* op = "v4_glm5_moe";
  v4::check_floating(op, "x", x, /*float64=*/true);
  v4::check_dim(op, "x", x, 2);
  v4::check_weights(op, weights, x);
  const at::Tensor& gate = weights.gate;
  const at::Tensor& bias = weights.e_score_correction_bias;
  const int64_t E = gate.size(0);
  TORCH_CHECK_VALUE(gate.dim() == 2 && gate.size(1) == x.size(1), op, ": gate has shape ",
                    gate.sizes(), ", expected [experts, ", x.size(1), "]");
  TORCH_CHECK_VALUE(bias.dim() == 1 && bias.size(0) == E, op, ": e_score_correction_bias has shape ",
                    bias.sizes(), ", expected [", E, "]");
  TORCH_CHECK_VALUE(n_group >= 1 && E % n_group == 0 && E / n_group >= 2 && topk_group >= 1 && topk_group <= n_group,
                    op, ": n_group=", n_group, ", topk_group=", topk_group, " do not fit ", E,
                    " experts (n_group must divide them into groups of at least 2, topk_group lie in [1, n_group])");
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= topk_group * (E / n_group), op, ": top_k=", top_k, " must lie in [1, ",
                    topk_group * (E / n_group), "] (the experts of topk_group groups)");
  v4::check_experts(op, weights.experts, x, E, expert_parallel);
  const int64_t T = x.size(0);
  const v4::Lora lora{lora_scaling, lora_dropout};

  // The router: fp32 sigmoid scores; the correction bias chooses, the unbiased scores weigh.
  const at::Tensor scores = at::linear(x.to(at::kFloat), gate.to(at::kFloat)).sigmoid();
  at::Tensor idx;
  if (routing) {
    idx = *routing;
    v4::check_routing(op, idx, x, top_k, E);
  } else {
    at::NoGradGuard no_grad;
    at::Tensor choice = scores.detach() + bias.to(at::kFloat);
    const at::Tensor group_scores = std::get<0>(choice.view({-1, n_group, E / n_group}).topk(2, -1)).sum(-1);
    const at::Tensor group_idx = std::get<1>(at::topk(group_scores, topk_group, -1, true, /*sorted=*/false));
    const at::Tensor group_mask = at::zeros_like(group_scores).scatter_(1, group_idx, 1);
    const at::Tensor score_mask = group_mask.unsqueeze(-1).expand({-1, n_group, E / n_group}).reshape({-1, E});
    choice = choice.masked_fill(score_mask.logical_not(), -std::numeric_limits<double>::infinity());
    idx = std::get<0>(std::get<1>(at::topk(choice, top_k, -1, true, /*sorted=*/false)).sort(-1));
  }
  at::Tensor route_weights = scores.gather(1, idx);
  if (norm_topk_prob) route_weights = route_weights / (route_weights.sum(-1, /*keepdim=*/true) + 1e-20);
  route_weights = route_weights * routed_scaling_factor;

  const at::Tensor shared = v4_mlp(x, weights.shared_experts, lora_scaling, lora_dropout);
  const v4::Dispatch d = v4::dispatch(idx, E);
  const at::Tensor y_rows = v4::routed_experts(x, weights.experts, lora, d, expert_parallel, op);
  return {v4::combine(y_rows, d, route_weights, T) + shared, idx};
}
