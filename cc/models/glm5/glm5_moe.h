#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

#include "cc/common/lora.h"

// GLM-5's MoE block (transformers' GlmMoeDsaMoE): the sigmoid router with correction bias and
// group-limited top-k (fp32 logits; the bias chooses, the unbiased scores weigh, normalised when
// norm_topk_prob, times routed_scaling_factor), the routed experts through grouped GEMMs, plus
// the shared expert (weights[prefix + "shared_experts.*"]). `routing` [T, top_k]: route as
// given (a recomputation). Returns (out [T, H] in x's dtype, routing [T, top_k] int64 ascending).
std::tuple<at::Tensor, at::Tensor> v4_glm5_moe(const at::Tensor& x, const v4::Weights& weights, const std::string& prefix,
                                               int64_t top_k, int64_t n_group, int64_t topk_group, bool norm_topk_prob,
                                          double routed_scaling_factor, double lora_scaling, double lora_dropout,
                                          const std::optional<at::Tensor>& routing);
