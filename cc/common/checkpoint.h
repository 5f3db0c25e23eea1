// Activation checkpointing of a layer op in C++: the forward pass keeps the input, the trainable
// weights and whatever the call records of its first pass; the backward pass recomputes the layer
// and differentiates it. Shared by the layer ops (v4_glm5_layer_forward, v4_qwen3_5_layer_forward).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <utility>
#include <vector>

#include "cc/common/layer_call.h"
#include "cc/common/lora.h"

namespace v4 {

// One layer call: what it needs besides its input (the weights, where its tokens sit in the
// packed batch, how it runs), kept by a checkpointed call for the recomputation. forward() is a
// plain pass: {hidden, carries...}, the carries not differentiable. run() is a pass of the
// checkpoint: with first == true the first one (record the choices that must repeat: routing,
// selections), with false the recomputation (repeat them); a plain pass unless overridden. The
// LoRA dropout masks repeat by restoring the random generator.
struct CheckpointedCall : torch::CustomClassHolder {
  Weights weights;
  int64_t layer = 0;
  Batch batch;
  LayerOptions options;
  Lora lora;  // options' LoRA settings, as the blocks take them
  at::Tensor rng_state;
  CheckpointedCall(Weights weights, int64_t layer, Batch batch, const LayerOptions& options)
      : weights(std::move(weights)), layer(layer), batch(std::move(batch)), options(options),
        lora{options.lora_scaling, options.lora_dropout} {}
  virtual ~CheckpointedCall() = default;
  virtual std::vector<at::Tensor> forward(const at::Tensor& hidden, const Weights& weights) = 0;
  virtual std::vector<at::Tensor> run(const at::Tensor& hidden, const Weights& weights, bool /*first*/) {
    return forward(hidden, weights);
  }
};

// The checks every layer op makes of its arguments (named in op's messages): hidden a floating
// [tokens, hidden] tensor, the weights on its device, layer one of `layers`, the batch's
// positions [tokens] and cu_seqlens, dropout in [0, 1).
void check_layer_call(const char* op, const at::Tensor& hidden, const Weights& weights, int64_t layer, int64_t layers,
                      const Batch& batch, const LayerOptions& options);

// call->forward(hidden, call->weights); or, with call->options.checkpoint under grad mode, the
// same without keeping its activations for backward: the backward pass runs it again (run with
// first == false) with gradients on hidden and the weights that require them.
std::vector<at::Tensor> run_layer(const at::Tensor& hidden, const c10::intrusive_ptr<CheckpointedCall>& call);

}  // namespace v4
