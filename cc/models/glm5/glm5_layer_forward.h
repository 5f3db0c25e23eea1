#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "cc/common/layer_call.h"
#include "cc/common/lora.h"
#include "cc/models/glm5/config.h"
#include "cc/models/glm5/glm5_moe.h"
#include "cc/models/glm5/mla_dsa_attention.h"

namespace v4 {

// A GLM-5 decoder layer's weights: its two norms [H], the attention, and the dense MLP (mlp) or
// the MoE block (moe), as the config's mlp_layer_types say.
#define V4_GLM5_LAYER_WEIGHTS_FIELDS(X)                  \
  X(at::Tensor, input_layernorm, {})                     \
  X(at::Tensor, post_attention_layernorm, {})            \
  X(MlaWeights, self_attn, {})                           \
  X(std::optional<MlpWeights>, mlp, std::nullopt)        \
  X(std::optional<Glm5MoeWeights>, moe, std::nullopt)

struct Glm5LayerWeights {
  V4_GLM5_LAYER_WEIGHTS_FIELDS(V4_DECLARE_FIELD)
};
V4_FIELD_VISITOR(Glm5LayerWeights, V4_GLM5_LAYER_WEIGHTS_FIELDS)

}  // namespace v4

// One GLM-5 decoder layer over packed tokens, in one call (transformers' GlmMoeDsaDecoderLayer):
//   x = x + v4_mla_dsa_attention(RMSNorm(x)); x = x + v4_mlp or v4_glm5_moe(RMSNorm(x)).
// hidden [T, H]; weights: the layer's (LoRA adapters with the linear maps they adapt); batch: the tokens' positions and document boundaries; carry: the DSA
// selection of the last 'full' indexer layer (used by a 'shared' one). With options.checkpoint,
// only the layer's input is kept for the backward pass, which recomputes the layer with the first
// pass's DSA selection, MoE routing and dropout masks.
// Returns (hidden [T, H], this layer's selection [T, index_topk]: the next layer's carry).
std::tuple<at::Tensor, at::Tensor> v4_glm5_layer_forward(const at::Tensor& hidden, const v4::Glm5LayerWeights& weights,
                                                         const v4::Glm5Config& cfg, int64_t layer,
                                                         const v4::Batch& batch, const v4::LayerOptions& options,
                                                         const std::optional<at::Tensor>& carry);
