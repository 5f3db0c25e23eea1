#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "cc/common/layer_call.h"
#include "cc/common/lora.h"
#include "cc/models/qwen3_5/config.h"
#include "cc/models/qwen3_5/gated_attention.h"
#include "cc/models/qwen3_5/gated_deltanet.h"
#include "cc/models/qwen3_5/qwen3_5_moe.h"

namespace v4 {

// A Qwen3.5 decoder layer's weights: its two norms [H]; Gated DeltaNet (linear_attn) or gated
// attention (self_attn), as the config's layer_types say; the MoE block (moe, qwen3_5_moe) or the
// dense MLP (mlp, qwen3_5).
#define V4_QWEN35_LAYER_WEIGHTS_FIELDS(X)                            \
  X(at::Tensor, input_layernorm, {})                                 \
  X(at::Tensor, post_attention_layernorm, {})                        \
  X(std::optional<GatedDeltaNetWeights>, linear_attn, std::nullopt)  \
  X(std::optional<GatedAttentionWeights>, self_attn, std::nullopt)   \
  X(std::optional<MlpWeights>, mlp, std::nullopt)                    \
  X(std::optional<Qwen35MoeWeights>, moe, std::nullopt)

struct Qwen35LayerWeights {
  V4_QWEN35_LAYER_WEIGHTS_FIELDS(V4_DECLARE_FIELD)
};
V4_FIELD_VISITOR(Qwen35LayerWeights, V4_QWEN35_LAYER_WEIGHTS_FIELDS)

}  // namespace v4

// One Qwen3.5 / Qwen3.6 decoder layer (transformers' Qwen3_5MoeDecoderLayer, Qwen3_5DecoderLayer)
// over packed tokens, in one call: x = x + Mixer(RMSNorm0(x)); x = x + MLP(RMSNorm0(x)), RMSNorm0
// the zero-centred norm. Mixer: v4_gated_deltanet on 'linear_attention' layers, v4_gated_attention
// on 'full_attention' ones; MLP: v4_qwen3_5_moe (qwen3_5_moe) or v4_mlp (qwen3_5). LoRA adapters
// with the linear maps apply inside. options.checkpoint: keep only the input (and the MoE routing) and
// recompute the layer in the backward pass, routing as the first pass did.
// hidden [T, H]; batch: the tokens' positions and document boundaries (nothing crosses layers).
// Returns hidden [T, H].
at::Tensor v4_qwen3_5_layer_forward(const at::Tensor& hidden, const v4::Qwen35LayerWeights& weights,
                                    const v4::Qwen35Config& cfg, int64_t layer, const v4::Batch& batch,
                                    const v4::LayerOptions& options);
