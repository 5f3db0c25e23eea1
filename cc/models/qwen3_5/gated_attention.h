#pragma once

#include <ATen/core/Tensor.h>

#include "cc/common/lora.h"
#include "cc/models/qwen3_5/config.h"

namespace v4 {

// The gated attention's weights (transformers' self_attn.*): q_proj [nh 2 hd, H] (query and gate
// per head), k_proj and v_proj [nkv hd, H], o_proj [H, nh hd], the q and k norms [hd].
#define V4_GATED_ATTENTION_WEIGHTS_FIELDS(X) \
  X(Linear, q_proj, {})                      \
  X(Linear, k_proj, {})                      \
  X(Linear, v_proj, {})                      \
  X(Linear, o_proj, {})                      \
  X(at::Tensor, q_norm, {})                  \
  X(at::Tensor, k_norm, {})

struct GatedAttentionWeights {
  V4_GATED_ATTENTION_WEIGHTS_FIELDS(V4_DECLARE_FIELD)
};
V4_FIELD_VISITOR(GatedAttentionWeights, V4_GATED_ATTENTION_WEIGHTS_FIELDS)

}  // namespace v4

// Qwen3.5's gated full attention (transformers' Qwen3_5MoeAttention) over packed documents, in one
// call: q_proj gives per head [q | gate]; zero-centred RMSNorm on q and k per head (v4_rms_norm);
// partial RoPE (rotate_half on the first rope.dim dims); causal attention within each document
// (grouped heads, SDPA: flash or cuDNN on the GPU); times sigmoid(gate); o_proj. LoRA adapters
// with the projections apply.
// h [T, H], positions [T] int64 (per document), cu_seqlens int64 [N + 1] -> [T, H].
at::Tensor v4_gated_attention(const at::Tensor& h, const v4::GatedAttentionWeights& weights, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, const v4::Rope& rope, double eps, const at::Tensor& positions,
                              const at::Tensor& cu_seqlens, double lora_scaling, double lora_dropout);
