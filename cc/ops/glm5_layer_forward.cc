#include "cc/ops/glm5_layer_forward.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

#include <mutex>
#include <string>
#include <vector>

#include "cc/common/checks.h"
#include "cc/ops/mla_dsa_attention.h"
#include "cc/ops/mlp.h"
#include "cc/ops/moe.h"
#include "cc/ops/rms_norm.h"

namespace v4 {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Documents up to this many tokens attend under a dense [queries, keys] mask; longer ones through
// the latent space (v4_mla_dsa_attention).
constexpr int64_t kMaskedMaxLen = 8192;

// Everything a layer call needs besides its input and the weights that train: kept by a
// checkpointed layer for its recomputation.
struct LayerCall : torch::CustomClassHolder {
  Weights weights;
  Glm5Config cfg;
  int64_t layer = 0;
  at::Tensor positions, cu_seqlens;
  std::optional<at::Tensor> carry;
  Lora lora;
  // The first pass's choices, which the recomputation repeats, and its sparse attention outputs,
  // which the recomputation takes instead of attending again.
  at::Tensor selection, routing, rng_state;
  AttentionStash stash;
};

struct LayerOut {
  at::Tensor hidden, selection, routing;
};

LayerOut run(const LayerCall& c, const at::Tensor& hidden, const Weights& weights) {
  const Glm5Config& cfg = c.cfg;
  const bool shared = cfg.indexer_types[c.layer] == "shared";
  std::optional<at::Tensor> given = shared ? c.carry : std::nullopt;
  if (!shared && c.selection.defined()) given = c.selection;
  const at::Tensor normed = v4_rms_norm(hidden, get(weights, "input_layernorm.weight", "v4_glm5_layer_forward"),
                                        cfg.rms_norm_eps, false);
  auto [attn, selection] = v4_mla_dsa_attention(normed, weights, cfg, c.layer, c.positions, c.cu_seqlens, given,
                                                c.lora.scaling, c.lora.dropout, kMaskedMaxLen);
  const at::Tensor mid = hidden + attn;
  const at::Tensor h = v4_rms_norm(mid, get(weights, "post_attention_layernorm.weight", "v4_glm5_layer_forward"),
                                   cfg.rms_norm_eps, false);
  if (cfg.mlp_layer_types[c.layer] == "dense") {
    return {mid + v4_mlp(h, weights, "mlp.", c.lora.scaling, c.lora.dropout), selection, at::Tensor()};
  }
  const std::optional<at::Tensor> routing = c.routing.defined() ? std::optional<at::Tensor>(c.routing) : std::nullopt;
  auto [out, chosen] = v4_moe(h, weights, "mlp.", cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                              cfg.norm_topk_prob, cfg.routed_scaling_factor, c.lora.scaling, c.lora.dropout, routing);
  return {mid + out, selection, chosen};
}

// The random generator a layer's dropout draws from, on the input's device.
at::Generator generator(const at::Tensor& t) { return at::globalContext().defaultGenerator(t.device()); }

// Activation checkpointing of a layer: the forward pass keeps the input, the trainable weights,
// the first pass's choices and its sparse attention outputs (AttentionStash: the costliest part
// of a long document's recomputation, [tokens, heads, 513] values per layer); the backward pass
// recomputes the rest of the layer and differentiates it.
struct LayerCheckpoint : public torch::autograd::Function<LayerCheckpoint> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, at::TensorList trained,
                               const std::vector<std::string>& trained_names, c10::intrusive_ptr<LayerCall> call) {
    if (call->lora.dropout > 0) {
      at::Generator gen = generator(hidden);
      std::lock_guard<std::mutex> lock(gen.mutex());
      call->rng_state = gen.get_state();
    }
    LayerOut out;
    {
      at::NoGradGuard no_grad;
      StashScope record(&call->stash);
      out = run(*call, hidden, call->weights);
    }
    call->selection = out.selection;
    call->routing = out.routing;
    ctx->save_for_backward({hidden});
    ctx->saved_data["call"] = c10::IValue::make_capsule(call);
    ctx->saved_data["names"] = trained_names;
    ctx->mark_non_differentiable({out.selection});
    return {out.hidden, out.selection};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor hidden = ctx->get_saved_variables()[0];
    auto call = c10::static_intrusive_pointer_cast<LayerCall>(ctx->saved_data["call"].toCapsule());
    const auto names = ctx->saved_data["names"].toList();
    at::Tensor current_rng;
    at::Generator gen;
    if (call->lora.dropout > 0) {  // the first pass's dropout masks
      gen = generator(hidden);
      std::lock_guard<std::mutex> lock(gen.mutex());
      current_rng = gen.get_state();
      gen.set_state(call->rng_state);
    }
    at::Tensor h = hidden.detach().requires_grad_(true);
    Weights weights = call->weights;
    variable_list inputs{h};
    for (const auto& name : names) {
      at::Tensor w = weights.at(name.get().toStringRef()).detach().requires_grad_(true);
      weights[name.get().toStringRef()] = w;
      inputs.push_back(w);
    }
    LayerOut out;
    {
      at::AutoGradMode grad_mode(true);
      call->stash.replay = true;
      call->stash.next = 0;
      StashScope replay(&call->stash);
      out = run(*call, h, weights);
    }
    call->stash = AttentionStash{};
    if (current_rng.defined()) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(current_rng);
    }
    variable_list result = torch::autograd::grad({out.hidden}, inputs, {grads[0]}, /*retain_graph=*/false,
                                                 /*create_graph=*/false, /*allow_unused=*/true);
    if (!hidden.requires_grad()) result[0] = at::Tensor();
    result.emplace_back();  // trained_names
    result.emplace_back();  // call
    return result;
  }
};

}  // namespace
}  // namespace v4

std::tuple<at::Tensor, at::Tensor> v4_glm5_layer_forward(const at::Tensor& hidden, const v4::Weights& weights,
                                                         const v4::Glm5Config& cfg, int64_t layer,
                                                         const at::Tensor& positions, const at::Tensor& cu_seqlens,
                                                         const std::optional<at::Tensor>& carry, double lora_scaling,
                                                         double lora_dropout, bool checkpoint) {
  constexpr const char* op = "v4_glm5_layer_forward";
  v4::check_floating(op, "hidden", hidden, /*float64=*/true);
  v4::check_dim(op, "hidden", hidden, 2);
  v4::check_weights(op, weights, hidden);
  const int64_t layers = static_cast<int64_t>(cfg.mlp_layer_types.size());
  TORCH_CHECK_VALUE(layer >= 0 && layer < layers && static_cast<int64_t>(cfg.indexer_types.size()) == layers, op,
                    ": layer ", layer, " is not one of the config's ", layers, " layers");
  TORCH_CHECK_VALUE(lora_dropout >= 0 && lora_dropout < 1, op, ": lora_dropout must lie in [0, 1), got ", lora_dropout);
  auto call = c10::make_intrusive<v4::LayerCall>();
  call->weights = weights;
  call->cfg = cfg;
  call->layer = layer;
  call->positions = positions;
  call->cu_seqlens = cu_seqlens;
  call->carry = carry;
  call->lora = {lora_scaling, lora_dropout};
  if (!(checkpoint && at::GradMode::is_enabled())) {
    const v4::LayerOut out = v4::run(*call, hidden, weights);
    return {out.hidden, out.selection};
  }
  torch::autograd::variable_list trained;
  std::vector<std::string> names;
  for (const auto& [name, w] : weights) {
    if (w.requires_grad()) {
      trained.push_back(w);
      names.push_back(name);
    }
  }
  const auto out = v4::LayerCheckpoint::apply(hidden, at::TensorList(trained), names, call);
  return {out[0], out[1]};
}
