// The model configs the layer ops read, filled from the Python config objects
// (v4train.models.config) by the nanobind caster in bridge.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace v4 {

// v4train.models.config.Rope: rotary frequencies over `dim` dims, YaRN when type is "yarn".
struct Rope {
  double theta = 10000.0;
  int64_t dim = 0;
  std::string type = "default";
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 0.0;
  double mscale_all_dim = 0.0;
  std::optional<double> attention_factor;
  bool truncate = true;
};

// v4train.models.config.Glm5Config: what the GLM-5 layer ops need of it.
struct Glm5Config {
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t index_topk = 0;
  int64_t index_head_dim = 0;
  int64_t index_n_heads = 0;
  int64_t num_experts_per_tok = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
  double rms_norm_eps = 1e-5;
  std::vector<std::string> mlp_layer_types;
  std::vector<std::string> indexer_types;
  Rope rope;
};

// v4train.models.config.Qwen35Config: what the Qwen3.5 layer op needs of it.
struct Qwen35Config {
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  int64_t num_experts_per_tok = 0;
  bool is_moe = false;
  double rms_norm_eps = 1e-6;
  std::vector<std::string> layer_types;
  Rope rope;
};

}  // namespace v4
