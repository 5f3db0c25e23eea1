#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "cc/common/layer_call.h"
#include "cc/common/lora.h"
#include "cc/models/glm5/config.h"

// One GLM-5 decoder layer over packed tokens, in one call (transformers' GlmMoeDsaDecoderLayer):
//   x = x + v4_mla_dsa_attention(RMSNorm(x)); x = x + v4_mlp or v4_glm5_moe(RMSNorm(x)).
// hidden [T, H]; weights: the layer's tensors by their transformers names, LoRA adapters beside
// the weights they adapt; batch: the tokens' positions and document boundaries; carry: the DSA
// selection of the last 'full' indexer layer (used by a 'shared' one). With options.checkpoint,
// only the layer's input is kept for the backward pass, which recomputes the layer with the first
// pass's DSA selection, MoE routing and dropout masks.
// Returns (hidden [T, H], this layer's selection [T, index_topk]: the next layer's carry).
std::tuple<at::Tensor, at::Tensor> v4_glm5_layer_forward(const at::Tensor& hidden, const v4::Weights& weights,
                                                         const v4::Glm5Config& cfg, int64_t layer,
                                                         const v4::Batch& batch, const v4::LayerOptions& options,
                                                         const std::optional<at::Tensor>& carry);
