// The glm5 config the layer ops read (fields as in cc/common/config.h's X lists).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cc/common/config.h"

namespace v4 {

#define V4_GLM5_CONFIG_FIELDS(X)                         \
  X(int64_t, hidden_size, 0)                             \
  X(int64_t, num_attention_heads, 0)                     \
  X(int64_t, q_lora_rank, 0)                             \
  X(int64_t, kv_lora_rank, 0)                            \
  X(int64_t, qk_nope_head_dim, 0)                        \
  X(int64_t, qk_rope_head_dim, 0)                        \
  X(int64_t, v_head_dim, 0)                              \
  X(int64_t, index_topk, 0)                              \
  X(int64_t, index_head_dim, 0)                          \
  X(int64_t, index_n_heads, 0)                           \
  X(int64_t, num_experts_per_tok, 0)                     \
  X(int64_t, n_group, 1)                                 \
  X(int64_t, topk_group, 1)                              \
  X(bool, norm_topk_prob, true)                          \
  X(double, routed_scaling_factor, 1.0)                  \
  X(double, rms_norm_eps, 1e-5)                          \
  X(std::vector<std::string>, mlp_layer_types, {})       \
  X(std::vector<std::string>, indexer_types, {})         \
  X(Rope, rope, {})

// v4train.models.glm5.config.Glm5Config: what the GLM-5 layer ops need of it.
struct Glm5Config {
  V4_GLM5_CONFIG_FIELDS(V4_DECLARE_FIELD)
};

}  // namespace v4
