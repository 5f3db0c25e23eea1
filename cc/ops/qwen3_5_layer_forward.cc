#include "cc/ops/qwen3_5_layer_forward.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <vector>

#include "cc/common/checkpoint.h"
#include "cc/common/checks.h"
#include "cc/ops/gated_attention.h"
#include "cc/ops/gated_deltanet.h"
#include "cc/ops/mlp.h"
#include "cc/ops/qwen_moe.h"
#include "cc/ops/rms_norm.h"

namespace v4 {
namespace {

constexpr const char* kOp = "v4_qwen3_5_layer_forward";

// A layer call; a checkpointed one keeps it, with the first pass's MoE routing, for the recomputation.
struct QwenLayerCall : CheckpointedCall {
  Qwen35Config cfg;
  int64_t layer = 0;
  at::Tensor positions, cu_seqlens;
  Lora lora;
  at::Tensor routing;

  std::vector<at::Tensor> run(const at::Tensor& hidden, const Weights& weights, bool) override {
    return {forward(hidden, weights)};
  }

  at::Tensor forward(const at::Tensor& hidden, const Weights& weights) {
    const double eps = cfg.rms_norm_eps;
    const at::Tensor h = v4_rms_norm(hidden, get(weights, "input_layernorm.weight", kOp), eps, true);
    const at::Tensor mixed =
        cfg.layer_types[layer] == "linear_attention"
            ? v4_gated_deltanet(h, weights, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                cfg.linear_key_head_dim, cfg.linear_value_head_dim, eps, cu_seqlens, lora.scaling,
                                lora.dropout)
            : v4_gated_attention(h, weights, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rope,
                                 eps, positions, cu_seqlens, lora.scaling, lora.dropout);
    const at::Tensor mid = hidden + mixed;
    const at::Tensor h2 = v4_rms_norm(mid, get(weights, "post_attention_layernorm.weight", kOp), eps, true);
    if (!cfg.is_moe) return mid + v4_mlp(h2, weights, "mlp.", lora.scaling, lora.dropout);
    const std::optional<at::Tensor> given = routing.defined() ? std::optional<at::Tensor>(routing) : std::nullopt;
    auto [out, chosen] = v4_qwen_moe(h2, weights, "mlp.", cfg.num_experts_per_tok, true, lora.scaling, lora.dropout, given);
    routing = chosen;
    return mid + out;
  }
};

}  // namespace
}  // namespace v4

std::tuple<at::Tensor, std::optional<at::Tensor>> v4_qwen3_5_layer_forward(
    const at::Tensor& hidden, const v4::Weights& weights, const v4::Qwen35Config& cfg, int64_t layer,
    const at::Tensor& positions, const at::Tensor& cu_seqlens, const std::optional<at::Tensor>& carry,
    double lora_scaling, double lora_dropout, bool checkpoint) {
  constexpr const char* op = v4::kOp;
  v4::check_floating(op, "hidden", hidden, /*float64=*/true);
  v4::check_dim(op, "hidden", hidden, 2);
  v4::check_weights(op, weights, hidden);
  const int64_t layers = static_cast<int64_t>(cfg.layer_types.size());
  TORCH_CHECK_VALUE(layer >= 0 && layer < layers, op, ": layer ", layer, " is not one of the config's ", layers,
                    " layers");
  TORCH_CHECK_VALUE(!carry, op, ": carry must be None (a Qwen3.5 layer takes nothing from the one before)");
  TORCH_CHECK_VALUE(lora_dropout >= 0 && lora_dropout < 1, op, ": lora_dropout must lie in [0, 1), got ", lora_dropout);
  auto call = c10::make_intrusive<v4::QwenLayerCall>();
  call->weights = weights;
  call->lora_dropout = lora_dropout;
  call->cfg = cfg;
  call->layer = layer;
  call->positions = positions;
  call->cu_seqlens = cu_seqlens;
  call->lora = {lora_scaling, lora_dropout};
  if (!(checkpoint && at::GradMode::is_enabled())) return {call->forward(hidden, weights), std::nullopt};
  return {v4::checkpointed(hidden, call)[0], std::nullopt};
}
