#pragma once

#include <ATen/core/Tensor.h>

#include "cc/models/qwen3_5/config.h"
#include "cc/common/lora.h"

// Qwen3.5's gated full attention (transformers' Qwen3_5MoeAttention) over packed documents, in one
// call: q_proj gives per head [q | gate]; zero-centred RMSNorm on q and k per head (v4_rms_norm);
// partial RoPE (rotate_half on the first rope.dim dims); causal attention within each document
// (grouped heads, SDPA: flash or cuDNN on the GPU); times sigmoid(gate); o_proj. LoRA adapters
// beside the projections apply. Weights named "self_attn.*" as in a transformers layer.
// h [T, H], positions [T] int64 (per document), cu_seqlens int64 [N + 1] -> [T, H].
at::Tensor v4_gated_attention(const at::Tensor& h, const v4::Weights& weights, int64_t num_heads, int64_t num_kv_heads,
                              int64_t head_dim, const v4::Rope& rope, double eps, const at::Tensor& positions,
                              const at::Tensor& cu_seqlens, double lora_scaling, double lora_dropout);
