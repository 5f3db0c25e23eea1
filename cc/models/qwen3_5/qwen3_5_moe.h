#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

#include "cc/common/lora.h"

// Qwen3.5-MoE's sparse MoE block (transformers' Qwen3_5MoeSparseMoeBlock), through the MoE seam
// of v4_glm5_moe (dispatch, grouped-GEMM experts, combine): the softmax router (logits x W^T in x's
// dtype, softmax in fp32, top_k, renormalised when norm_topk_prob, in x's dtype), the routed
// experts, plus sigmoid(x . shared_expert_gate) times the shared expert (v4_mlp).
//
// x [T, H]; weights[prefix + "gate.weight"] [E, H], prefix + "experts.gate_up_proj" [E, 2I, H],
// prefix + "experts.down_proj" [E, H, I], prefix + "shared_expert.{gate,up,down}_proj.weight",
// prefix + "shared_expert_gate.weight" [1, H], LoRA adapters beside them. routing [T, top_k]:
// route as given (a recomputation). Returns (out [T, H] in x's dtype, routing [T, top_k] int64).
std::tuple<at::Tensor, at::Tensor> v4_qwen3_5_moe(const at::Tensor& x, const v4::Weights& weights, const std::string& prefix,
                                               int64_t top_k, bool norm_topk_prob, double lora_scaling,
                                               double lora_dropout, const std::optional<at::Tensor>& routing);
