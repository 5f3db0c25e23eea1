#include "cc/models/glm5/glm5_layer_forward.h"

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "cc/common/checkpoint.h"
#include "cc/common/checks.h"
#include "cc/models/glm5/glm5_moe.h"
#include "cc/models/glm5/mla_dsa_attention.h"
#include "cc/ops/mlp.h"
#include "cc/ops/rms_norm.h"

namespace v4 {
namespace {

constexpr const char* kOp = "v4_glm5_layer_forward";

// Documents up to this many tokens attend under a dense [queries, keys] mask; longer ones through
// the latent space (v4_mla_dsa_attention).
constexpr int64_t kMaskedMaxLen = 8192;

// Everything a layer call needs besides its input and the weights that train: kept by a
// checkpointed layer for its recomputation, with the first pass's DSA selection, which the
// recomputation repeats, and its sparse attention outputs, which the recomputation takes instead
// of attending again (AttentionStash: the costliest part of a long document's recomputation,
// [tokens, heads, 513] values per layer). The MoE routing is the tail's record (checkpoint.h).
struct LayerCall : LayerCallOf<Glm5LayerWeights> {
  using LayerCallOf::LayerCallOf;
  Glm5Config cfg;
  std::optional<at::Tensor> carry;
  at::Tensor selection;
  AttentionStash stash;

  // {mid, h, selection}
  std::vector<at::Tensor> head(const at::Tensor& hidden, Pass pass) override {
    stash.replay = pass == Pass::kRecompute;
    stash.next = 0;
    std::vector<at::Tensor> out;
    {
      std::optional<StashScope> scope;
      if (pass != Pass::kPlain) scope.emplace(&stash);
      out = attend(hidden);
    }
    if (pass == Pass::kRecompute) stash = AttentionStash{};
    return out;
  }

  std::vector<at::Tensor> attend(const at::Tensor& hidden) {
    const bool shared = cfg.indexer_types[layer] == "shared";
    std::optional<at::Tensor> given = shared ? carry : std::nullopt;
    if (!shared && selection.defined()) given = selection;
    const at::Tensor normed = v4_rms_norm(hidden, weights.input_layernorm, cfg.rms_norm_eps, false);
    auto [attn, chosen_keys] = v4_mla_dsa_attention(normed, weights.self_attn, cfg, layer, batch.positions,
                                                    batch.cu_seqlens, given, lora.scaling, lora.dropout, kMaskedMaxLen);
    selection = chosen_keys;
    const at::Tensor mid = hidden + attn;
    return {mid, v4_rms_norm(mid, weights.post_attention_layernorm, cfg.rms_norm_eps, false), selection};
  }

  std::pair<at::Tensor, at::Tensor> tail(const at::Tensor& h, const at::Tensor& given) override {
    if (!sparse()) {
      TORCH_CHECK_VALUE(weights.mlp.has_value(), kOp, ": layer ", layer, " is a dense layer but weights has no mlp");
      return {v4_mlp(h, *weights.mlp, lora.scaling, lora.dropout), at::Tensor()};
    }
    TORCH_CHECK_VALUE(weights.moe.has_value(), kOp, ": layer ", layer, " is an MoE layer but weights has no moe");
    const std::optional<at::Tensor> routing = given.defined() ? std::optional<at::Tensor>(given) : std::nullopt;
    auto [out, chosen] = v4_glm5_moe(h, *weights.moe, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                                     cfg.norm_topk_prob, cfg.routed_scaling_factor, lora.scaling, lora.dropout, routing,
                                     options.expert_parallel);
    return {out, chosen};
  }

  int64_t tail_bytes_per_token(int64_t element_size) const override {
    return mlp_or_moe_bytes(sparse(), cfg.num_experts_per_tok, cfg.hidden_size, element_size);
  }

  bool sparse() const { return cfg.mlp_layer_types[layer] != "dense"; }
};

}  // namespace
}  // namespace v4

std::tuple<at::Tensor, at::Tensor> v4_glm5_layer_forward(const at::Tensor& hidden, const v4::Glm5LayerWeights& weights,
                                                         const v4::Glm5Config& cfg, int64_t layer,
                                                         const v4::Batch& batch, const v4::LayerOptions& options,
                                                         const std::optional<at::Tensor>& carry) {
  constexpr const char* op = v4::kOp;
  const int64_t layers = static_cast<int64_t>(cfg.mlp_layer_types.size());
  v4::check_layer_call(op, hidden, layer, layers, batch, options);
  v4::check_weights(op, weights, hidden);
  TORCH_CHECK_VALUE(static_cast<int64_t>(cfg.indexer_types.size()) == layers, op, ": the config has ",
                    cfg.indexer_types.size(), " indexer types for ", layers, " layers");
  auto call = c10::make_intrusive<v4::LayerCall>(weights, layer, batch, options);
  call->cfg = cfg;
  call->carry = carry;
  const auto out = v4::run_layer(hidden, call);
  return {out[0], out[1]};
}
