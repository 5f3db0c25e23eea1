// Activation checkpointing of a layer op in C++: the forward pass keeps the input, the trainable
// weights and whatever the call records of its first pass; the backward pass recomputes the layer
// and differentiates it. Shared by the layer ops (v4_glm5_layer_forward, v4_qwen3_5_layer_forward).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <string>
#include <utility>
#include <vector>

#include "cc/common/layer_call.h"
#include "cc/common/lora.h"

namespace v4 {

// One layer call: what it needs besides its input (its weights, where its tokens sit in the
// packed batch, how it runs), kept by a checkpointed call for the recomputation. forward() is a
// plain pass: {hidden, carries...}, the carries not differentiable. run() is a pass of the
// checkpoint: with first == true the first one (record the choices that must repeat: routing,
// selections), with false the recomputation (repeat them); a plain pass unless overridden. The
// LoRA dropout masks repeat by restoring the random generator. weight_tensors(): every tensor of
// the call's weights, which the recomputation replaces by fresh leaves to differentiate.
struct CheckpointedCall : torch::CustomClassHolder {
  int64_t layer = 0;
  Batch batch;
  LayerOptions options;
  Lora lora;  // options' LoRA settings, as the blocks take them
  at::Tensor rng_state;
  CheckpointedCall(int64_t layer, Batch batch, const LayerOptions& options)
      : layer(layer), batch(std::move(batch)), options(options), lora{options.lora_scaling, options.lora_dropout} {}
  virtual ~CheckpointedCall() = default;
  virtual std::vector<at::Tensor> forward(const at::Tensor& hidden) = 0;
  virtual std::vector<at::Tensor> run(const at::Tensor& hidden, bool /*first*/) { return forward(hidden); }
  virtual std::vector<at::Tensor*> weight_tensors() = 0;
};

// A call whose weights are the struct W (a family's layer weights).
template <typename W>
struct LayerCallOf : CheckpointedCall {
  W weights;
  LayerCallOf(W weights, int64_t layer, Batch batch, const LayerOptions& options)
      : CheckpointedCall(layer, std::move(batch), options), weights(std::move(weights)) {}
  std::vector<at::Tensor*> weight_tensors() override {
    std::vector<at::Tensor*> out;
    auto add = [&](const std::string&, at::Tensor& t) { out.push_back(&t); };
    visit_fields(weights, "", add);
    return out;
  }
};

// The checks every layer op makes of its arguments (named in op's messages): hidden a floating
// [tokens, hidden] tensor, layer one of `layers`, the batch's positions and cu_seqlens given,
// dropout in [0, 1). (Each block checks its own weights.)
void check_layer_call(const char* op, const at::Tensor& hidden, int64_t layer, int64_t layers, const Batch& batch,
                      const LayerOptions& options);

// call->forward(hidden); or, with call->options.checkpoint under grad mode, the same without
// keeping its activations for backward: the backward pass runs it again (run with first ==
// false) with gradients on hidden and the weights that require them.
std::vector<at::Tensor> run_layer(const at::Tensor& hidden, const c10::intrusive_ptr<CheckpointedCall>& call);

}  // namespace v4
