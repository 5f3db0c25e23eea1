#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "cc/common/layer_call.h"
#include "cc/common/lora.h"
#include "cc/models/qwen3_5/config.h"

// One Qwen3.5 / Qwen3.6 decoder layer (transformers' Qwen3_5MoeDecoderLayer, Qwen3_5DecoderLayer)
// over packed tokens, in one call: x = x + Mixer(RMSNorm0(x)); x = x + MLP(RMSNorm0(x)), RMSNorm0
// the zero-centred norm. Mixer: v4_gated_deltanet on 'linear_attention' layers, v4_gated_attention
// on 'full_attention' ones; MLP: v4_qwen3_5_moe (qwen3_5_moe) or v4_mlp (qwen3_5). LoRA adapters
// beside the weights apply inside. options.checkpoint: keep only the input (and the MoE routing) and
// recompute the layer in the backward pass, routing as the first pass did.
// hidden [T, H]; batch: the tokens' positions and document boundaries (nothing crosses layers).
// Returns hidden [T, H].
at::Tensor v4_qwen3_5_layer_forward(const at::Tensor& hidden, const v4::Weights& weights, const v4::Qwen35Config& cfg,
                                    int64_t layer, const v4::Batch& batch, const v4::LayerOptions& options);
