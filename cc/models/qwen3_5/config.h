// The qwen3_5 config the layer ops read (fields as in cc/common/config.h's X lists).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cc/common/config.h"

namespace v4 {

#define V4_QWEN35_CONFIG_FIELDS(X)                 \
  X(int64_t, num_attention_heads, 0)               \
  X(int64_t, num_key_value_heads, 0)               \
  X(int64_t, head_dim, 0)                          \
  X(int64_t, linear_num_key_heads, 0)              \
  X(int64_t, linear_num_value_heads, 0)            \
  X(int64_t, linear_key_head_dim, 0)               \
  X(int64_t, linear_value_head_dim, 0)             \
  X(int64_t, num_experts_per_tok, 0)               \
  X(bool, is_moe, false)                           \
  X(double, rms_norm_eps, 1e-6)                    \
  X(std::vector<std::string>, layer_types, {})     \
  X(Rope, rope, {})

// v4train.models.qwen3_5.config.Qwen35Config: what the Qwen3.5 layer op needs of it.
struct Qwen35Config {
  V4_QWEN35_CONFIG_FIELDS(V4_DECLARE_FIELD)
};

}  // namespace v4
