// Activation checkpointing of a layer op in C++: the forward pass keeps the input, the trainable
// weights and whatever the call records of its first pass; the backward pass recomputes the layer
// and differentiates it. Shared by the layer ops (v4_glm5_layer_forward, v4_qwen3_5_layer_forward).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <vector>

#include "cc/common/lora.h"

namespace v4 {

// One layer call that checkpointing can repeat. run() computes the layer from its input and
// weights: {hidden, carries...}, the carries not differentiable. With first == true it is the
// first pass (record the choices that must repeat: routing, selections); with false, the
// recomputation (repeat them). The LoRA dropout masks repeat by restoring the random generator.
struct CheckpointedCall : torch::CustomClassHolder {
  Weights weights;
  double lora_dropout = 0.0;
  at::Tensor rng_state;
  virtual ~CheckpointedCall() = default;
  virtual std::vector<at::Tensor> run(const at::Tensor& hidden, const Weights& weights, bool first) = 0;
};

// call->run(hidden, call->weights, true) without keeping its activations for backward; the
// backward pass runs it again (first == false) with gradients on hidden and the weights that
// require them.
std::vector<at::Tensor> checkpointed(const at::Tensor& hidden, const c10::intrusive_ptr<CheckpointedCall>& call);

}  // namespace v4
