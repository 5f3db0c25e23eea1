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

// The blocks of a call's tail (tail_block), [start, start + n) each, in order.
template <typename F>
void for_each_block(const CheckpointedCall& call, const at::Tensor& h, bool checkpointed, F&& f) {
  const int64_t T = h.size(0), block = call.tail_block(h, checkpointed);
  if (T == 0) f(0, 0);  // (no tokens: one empty block, the ops' outputs shaped as ever)
  for (int64_t start = 0; start < T; start += block) f(start, std::min(block, T - start));
}

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
      out = call->head(hidden, CheckpointedCall::Pass::kFirst);
      at::Tensor y = out[0].clone();  // mid + the tail, block by block
      const at::Tensor h = out[1];
      std::vector<at::Tensor> records;
      for_each_block(*call, h, /*checkpointed=*/true, [&](int64_t start, int64_t n) {
        auto [rows, record] = call->tail(h.narrow(0, start, n), at::Tensor());
        y.narrow(0, start, n).add_(rows);
        if (record.defined()) records.push_back(record);
      });
      if (!records.empty()) call->tail_record = at::cat(records);
      out.erase(out.begin() + 1);
      out[0] = y;
    }
    ctx->save_for_backward({hidden});
    ctx->saved_data["call"] = c10::IValue::make_capsule(call);
    ctx->saved_data["positions"] = positions;
    for (size_t i = 1; i < out.size(); ++i) {
      if (out[i].defined()) ctx->mark_non_differentiable({out[i]});
    }
    return out;
  }

  // The head recomputed with its graph; the tail recomputed and differentiated a block at a time
  // (its rows' gradient into dh, its weights' gradients summed), then the head differentiated
  // with the gradients of both its outputs: out = mid + tail(h).
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
    at::Tensor x = hidden.detach().requires_grad_(true);
    // The trained weights, in the call's own weights for the recomputation, as fresh leaves.
    const std::vector<at::Tensor*> tensors = call->weight_tensors();
    std::vector<at::Tensor> originals;
    variable_list inputs{x};
    for (const int64_t i : positions) {
      at::Tensor& w = *tensors[i];
      originals.push_back(w);
      w = w.detach().requires_grad_(true);
      inputs.push_back(w);
    }
    const at::Tensor dy = grads[0];
    at::AutoGradMode grad_mode(true);
    const std::vector<at::Tensor> head = call->head(x, CheckpointedCall::Pass::kRecompute);
    const at::Tensor &mid = head[0], &h = head[1];
    at::Tensor dh = at::zeros_like(h);
    variable_list weight_grads(inputs.size());
    for_each_block(*call, h, /*checkpointed=*/true, [&](int64_t start, int64_t n) {
      variable_list block_inputs = inputs;
      block_inputs[0] = h.detach().narrow(0, start, n).requires_grad_(true);
      const at::Tensor given = call->tail_record.defined() ? call->tail_record.narrow(0, start, n) : at::Tensor();
      const at::Tensor rows = call->tail(block_inputs[0], given).first;
      const variable_list g = torch::autograd::grad({rows}, block_inputs, {dy.narrow(0, start, n)},
                                                    /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
      if (g[0].defined()) dh.narrow(0, start, n).copy_(g[0]);
      for (size_t j = 1; j < g.size(); ++j) {
        if (g[j].defined()) weight_grads[j] = weight_grads[j].defined() ? weight_grads[j] + g[j] : g[j];
      }
    });
    for (size_t j = 0; j < positions.size(); ++j) *tensors[positions[j]] = originals[j];
    if (current_rng.defined()) {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(current_rng);
    }
    variable_list result = torch::autograd::grad({mid, h}, inputs, {dy, dh}, /*retain_graph=*/false,
                                                 /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t j = 1; j < result.size(); ++j) {
      if (weight_grads[j].defined()) result[j] = result[j].defined() ? result[j] + weight_grads[j] : weight_grads[j];
    }
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
  TORCH_CHECK_VALUE(options.checkpoint_block >= 0, op, ": checkpoint_block must be 0 (automatic) or a number of tokens, got ",
                    options.checkpoint_block);
}

std::vector<at::Tensor> CheckpointedCall::forward(const at::Tensor& hidden) {
  std::vector<at::Tensor> out = head(hidden, Pass::kPlain);
  const at::Tensor h = out[1];
  std::vector<at::Tensor> rows;
  for_each_block(*this, h, /*checkpointed=*/false,
                 [&](int64_t start, int64_t n) { rows.push_back(tail(h.narrow(0, start, n), at::Tensor()).first); });
  out[0] = out[0] + (rows.size() == 1 ? rows[0] : at::cat(rows));
  out.erase(out.begin() + 1);
  return out;
}

int64_t CheckpointedCall::tail_block(const at::Tensor& h, bool checkpointed) const {
  const int64_t T = std::max<int64_t>(h.size(0), 1);
  // One block under expert parallelism: every rank's all-to-alls must pair up, whatever its tokens.
  if (options.expert_parallel.size > 1) return T;
  if (options.checkpoint_block > 0) return options.checkpoint_block;
  if (!checkpointed) return T;
  return std::max<int64_t>(1, (kTailBlockMiB << 20) / std::max<int64_t>(tail_bytes_per_token(h.element_size()), 1));
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
