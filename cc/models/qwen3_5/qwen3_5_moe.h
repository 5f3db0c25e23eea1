#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "cc/common/layer_call.h"
#include "cc/common/lora.h"

namespace v4 {

// Qwen3.5-MoE's MoE weights (transformers' mlp.*): the router gate [E, H], the routed experts,
// the shared expert and its gate [1, H].
#define V4_QWEN35_MOE_WEIGHTS_FIELDS(X) \
  X(at::Tensor, gate, {})               \
  X(ExpertsWeights, experts, {})        \
  X(MlpWeights, shared_expert, {})      \
  X(at::Tensor, shared_expert_gate, {})

struct Qwen35MoeWeights {
  V4_QWEN35_MOE_WEIGHTS_FIELDS(V4_DECLARE_FIELD)
};
V4_FIELD_VISITOR(Qwen35MoeWeights, V4_QWEN35_MOE_WEIGHTS_FIELDS)

}  // namespace v4

// Qwen3.5-MoE's sparse MoE block (transformers' Qwen3_5MoeSparseMoeBlock), through the MoE seam
// of v4_glm5_moe (dispatch, grouped-GEMM experts, combine): the softmax router (logits x W^T in x's
// dtype, softmax in fp32, top_k, renormalised when norm_topk_prob, in x's dtype), the routed
// experts, plus sigmoid(x . shared_expert_gate) times the shared expert (v4_mlp).
//
// x [T, H]; weights: gate [E, H], experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I],
// shared_expert, shared_expert_gate [1, H], LoRA adapters with the linear maps. routing
// [T, top_k]: route as given (a recomputation). Returns (out [T, H] in x's dtype, routing
// [T, top_k] int64). expert_parallel: as v4_glm5_moe's.
std::tuple<at::Tensor, at::Tensor> v4_qwen3_5_moe(const at::Tensor& x, const v4::Qwen35MoeWeights& weights,
                                                  int64_t top_k, bool norm_topk_prob, double lora_scaling,
                                                  double lora_dropout, const std::optional<at::Tensor>& routing,
                                                  const std::optional<v4::ExpertParallel>& expert_parallel = std::nullopt);
