#include "cc/models/qwen3_5/qwen3_5_layer_forward.h"

#include <ATen/ATen.h>

#include <vector>

#include "cc/common/checkpoint.h"
#include "cc/common/checks.h"
#include "cc/models/qwen3_5/gated_attention.h"
#include "cc/models/qwen3_5/gated_deltanet.h"
#include "cc/ops/mlp.h"
#include "cc/models/qwen3_5/qwen3_5_moe.h"
#include "cc/ops/rms_norm.h"

namespace v4 {
namespace {

constexpr const char* kOp = "v4_qwen3_5_layer_forward";

// A layer call; a checkpointed one keeps it (the MoE routing is the tail's record, checkpoint.h).
struct QwenLayerCall : LayerCallOf<Qwen35LayerWeights> {
  using LayerCallOf::LayerCallOf;
  Qwen35Config cfg;

  // {mid, h}
  std::vector<at::Tensor> head(const at::Tensor& hidden, Pass) override {
    const double eps = cfg.rms_norm_eps;
    const at::Tensor h = v4_rms_norm(hidden, weights.input_layernorm, eps, true);
    const bool deltanet = cfg.layer_types[layer] == "linear_attention";
    TORCH_CHECK_VALUE(deltanet ? weights.linear_attn.has_value() : weights.self_attn.has_value(), kOp, ": layer ", layer,
                      " is a ", cfg.layer_types[layer], " layer but weights has no ", deltanet ? "linear_attn" : "self_attn");
    const at::Tensor mixed =
        deltanet
            ? v4_gated_deltanet(h, *weights.linear_attn, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                cfg.linear_key_head_dim, cfg.linear_value_head_dim, eps, batch.cu_seqlens, lora.scaling,
                                lora.dropout)
            : v4_gated_attention(h, *weights.self_attn, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rope,
                                 eps, batch.positions, batch.cu_seqlens, lora.scaling, lora.dropout);
    const at::Tensor mid = hidden + mixed;
    TORCH_CHECK_VALUE(cfg.is_moe ? weights.moe.has_value() : weights.mlp.has_value(), kOp, ": layer ", layer,
                      cfg.is_moe ? " is an MoE layer but weights has no moe" : " is a dense layer but weights has no mlp");
    return {mid, v4_rms_norm(mid, weights.post_attention_layernorm, eps, true)};
  }

  std::pair<at::Tensor, at::Tensor> tail(const at::Tensor& h, const at::Tensor& given) override {
    if (!cfg.is_moe) return {v4_mlp(h, *weights.mlp, lora.scaling, lora.dropout), at::Tensor()};
    const std::optional<at::Tensor> routing = given.defined() ? std::optional<at::Tensor>(given) : std::nullopt;
    auto [out, chosen] = v4_qwen3_5_moe(h, *weights.moe, cfg.num_experts_per_tok, true, lora.scaling, lora.dropout,
                                        routing, options.expert_parallel);
    return {out, chosen};
  }

  int64_t tail_bytes_per_token(int64_t element_size) const override {
    return mlp_or_moe_bytes(cfg.is_moe, cfg.num_experts_per_tok, h_size(), element_size);
  }

  int64_t h_size() const { return weights.post_attention_layernorm.size(0); }
};

}  // namespace
}  // namespace v4

at::Tensor v4_qwen3_5_layer_forward(const at::Tensor& hidden, const v4::Qwen35LayerWeights& weights,
                                    const v4::Qwen35Config& cfg, int64_t layer, const v4::Batch& batch,
                                    const v4::LayerOptions& options) {
  constexpr const char* op = v4::kOp;
  v4::check_layer_call(op, hidden, layer, static_cast<int64_t>(cfg.layer_types.size()), batch, options);
  v4::check_weights(op, weights, hidden);
  auto call = c10::make_intrusive<v4::QwenLayerCall>(weights, layer, batch, options);
  call->cfg = cfg;
  return v4::run_layer(hidden, call)[0];
}
