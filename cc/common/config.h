// The model configs the layer ops read, filled from the Python config objects
// (v4train.models.config) by the nanobind caster in bridge.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace v4 {

// Each config's fields written once, as X(type, name, default): the struct below declares them
// and the caster in bridge.h reads each by the same name from the Python object
// (v4train.models.config); py/tests/test_config_fields.py checks that every one of them is a
// field of the Python dataclass, of the matching kind.
#define V4_ROPE_FIELDS(X)                          \
  X(double, theta, 10000.0)                        \
  X(int64_t, dim, 0)                               \
  X(std::string, type, "default")                  \
  X(double, factor, 1.0)                           \
  X(int64_t, original_max_position_embeddings, 0) \
  X(double, beta_fast, 32.0)                       \
  X(double, beta_slow, 1.0)                        \
  X(double, mscale, 0.0)                           \
  X(double, mscale_all_dim, 0.0)                   \
  X(std::optional<double>, attention_factor, std::nullopt) \
  X(bool, truncate, true)

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

#define V4_DECLARE_FIELD(type, name, init) type name = init;

// v4train.models.config.Rope: rotary frequencies over `dim` dims, YaRN when type is "yarn".
struct Rope {
  V4_ROPE_FIELDS(V4_DECLARE_FIELD)
};

// v4train.models.config.Glm5Config: what the GLM-5 layer ops need of it.
struct Glm5Config {
  V4_GLM5_CONFIG_FIELDS(V4_DECLARE_FIELD)
};

// v4train.models.config.Qwen35Config: what the Qwen3.5 layer op needs of it.
struct Qwen35Config {
  V4_QWEN35_CONFIG_FIELDS(V4_DECLARE_FIELD)
};

}  // namespace v4
