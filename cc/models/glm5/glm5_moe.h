#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "cc/common/layer_call.h"
#include "cc/common/lora.h"

namespace v4 {

// GLM-5's MoE weights (transformers' mlp.*): the router gate [E, H] and its correction bias [E]
// (both fp32), the routed experts, the shared expert.
#define V4_GLM5_MOE_WEIGHTS_FIELDS(X)    \
  X(at::Tensor, gate, {})                \
  X(at::Tensor, e_score_correction_bias, {}) \
  X(ExpertsWeights, experts, {})         \
  X(MlpWeights, shared_experts, {})

struct Glm5MoeWeights {
  V4_GLM5_MOE_WEIGHTS_FIELDS(V4_DECLARE_FIELD)
};
V4_FIELD_VISITOR(Glm5MoeWeights, V4_GLM5_MOE_WEIGHTS_FIELDS)

}  // namespace v4

// GLM-5's MoE block (transformers' GlmMoeDsaMoE): the sigmoid router with correction bias and
// group-limited top-k (fp32 logits; the bias chooses, the unbiased scores weigh, normalised when
// norm_topk_prob, times routed_scaling_factor), the routed experts through grouped GEMMs, plus
// the shared expert. `routing` [T, top_k]: route as given (a recomputation). Returns (out [T, H]
// in x's dtype, routing [T, top_k] int64 ascending). expert_parallel: weights.experts are this
// rank's E / size experts, the rows of the others' go to their ranks and back (v4::routed_experts).
std::tuple<at::Tensor, at::Tensor> v4_glm5_moe(const at::Tensor& x, const v4::Glm5MoeWeights& weights, int64_t top_k,
                                               int64_t n_group, int64_t topk_group, bool norm_topk_prob,
                                               double routed_scaling_factor, double lora_scaling, double lora_dropout,
                                               const std::optional<at::Tensor>& routing,
                                               const std::optional<v4::ExpertParallel>& expert_parallel = std::nullopt);
