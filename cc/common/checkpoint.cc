#include "cc/common/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "cc/common/checks.h"

#include <mutex>
#include <vector>

namespace v4 {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The random generator a layer's dropout draws from, on the input's device.
at::Generator generator(const at::Tensor& t) { return at::globalContext().defaultGenerator(t.device()); }

struct LayerCheckpoint : public torch::autograd::Function<LayerCheckpoint> {
  // trained: the weights that require gradients; positions: where each sits in
  // call->weight_tensors().
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, at::TensorList trained,
                               const std::vector<int64_t>& positions, c10::intrusive_ptr<CheckpointedCall> call) {
    if (call->lora.dropout > 0) {
      at::Generator gen = generator(hidden);
      std::lock_guard<std::mutex> lock(gen.mutex());
      call->rng_state = gen.get_state();
    }
    std::vector<at::Tensor> out;
    {
      at::NoGradGuard no_grad;
      out = call->run(hidden, /*first=*/true);
    }
    ctx->save_for_backward({hidden});
    ctx->saved_data["call"] = c10::IValue::make_capsule(call);
    ctx->saved_data["positions"] = positions;
    for (size_t i = 1; i < out.size(); ++i) {
      if (out[i].defined()) ctx->mark_non_differentiable({out[i]});
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor hidden = ctx->get_saved_variables()[0];
    auto call = c10::static_intrusive_pointer_cast<CheckpointedCall>(ctx->saved_data["call"].toCapsule());
    const auto positions = ctx->saved_data["positions"].toIntVector();
    at::Tensor current_rng;
    at::Generator gen;
    if (call->lora.dropout > 0) {  // the first pass's dropout masks
      gen = generator(hidden);
      std::lock_guard<std::mutex> lock(gen.mutex());
      current_rng = gen.get_state();
      gen.set_state(call->rng_state);
    }
    at::Tensor h = hidden.detach().requires_grad_(true);
    // The trained weights, in the call's own weights for the recomputation, as fresh leaves.
    const std::vector<at::Tensor*> tensors = call->weight_tensors();
    std::vector<at::Tensor> originals;
    variable_list inputs{h};
    for (const int64_t i : positions) {
      at::Tensor& w = *tensors[i];
      originals.push_back(w);
      w = w.detach().requires_grad_(true);
      inputs.push_back(w);
    }
    std::vector<at::Tensor> out;
    {
      at::AutoGradMode grad_mode(true);
      out = call->run(h, /*first=*/false);
    }
    for (size_t j = 0; j < positions.size(); ++j) *tensors[positions[j]] = originals[j];
    if (current_rng.defined()) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(current_rng);
    }
    variable_list result = torch::autograd::grad({out[0]}, inputs, {grads[0]}, /*retain_graph=*/false,
                                                 /*create_graph=*/false, /*allow_unused=*/true);
    if (!hidden.requires_grad()) result[0] = at::Tensor();
    result.emplace_back();  // positions
    result.emplace_back();  // call
    return result;
  }
};

}  // namespace

void check_layer_call(const char* op, const at::Tensor& hidden, int64_t layer, int64_t layers, const Batch& batch,
                      const LayerOptions& options) {
  check_floating(op, "hidden", hidden, /*float64=*/true);
  check_dim(op, "hidden", hidden, 2);
  TORCH_CHECK_VALUE(layer >= 0 && layer < layers, op, ": layer ", layer, " is not one of the config's ", layers,
                    " layers");
  TORCH_CHECK_VALUE(batch.positions.defined() && batch.cu_seqlens.defined(), op,
                    ": batch needs positions and cu_seqlens tensors");
  TORCH_CHECK_VALUE(options.lora_dropout >= 0 && options.lora_dropout < 1, op,
                    ": lora_dropout must lie in [0, 1), got ", options.lora_dropout);
}

std::vector<at::Tensor> run_layer(const at::Tensor& hidden, const c10::intrusive_ptr<CheckpointedCall>& call) {
  if (!(call->options.checkpoint && at::GradMode::is_enabled())) return call->forward(hidden);
  torch::autograd::variable_list trained;
  std::vector<int64_t> positions;
  const std::vector<at::Tensor*> tensors = call->weight_tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i]->requires_grad()) {
      trained.push_back(*tensors[i]);
      positions.push_back(static_cast<int64_t>(i));
    }
  }
  return LayerCheckpoint::apply(hidden, at::TensorList(trained), positions, call);
}

}  // namespace v4
