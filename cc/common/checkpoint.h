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

// The memory a block of a checkpointed layer's tail may take for its largest activations: a GLM-5
// MoE layer's 8 routed rows per token of 6144 + 3 x 2048 columns (two of each) in bf16 make
// 6,553 tokens a block, each routed expert's share of it still a full-size GEMM.
constexpr int64_t kTailBlockMiB = 2048;

// One layer call: what it needs besides its input (its weights, where its tokens sit in the
// packed batch, how it runs), kept by a checkpointed call for the recomputation. A layer is
//   {mid, h, carries...} = head(hidden),  out = mid + tail(h),
// head the attention with the residual and the second norm, tail the MLP or MoE, which acts on
// each token alone: so a checkpointed call runs, recomputes and differentiates the tail a block of
// tokens at a time (tail_block()), and its [tokens x top-k, ...] rows never exist for all tokens
// at once. forward() is a plain pass: {out, carries...}, the carries not differentiable.
// head(hidden, pass): kFirst in a checkpoint's first pass (record the choices that must repeat:
// selections), kRecompute in its recomputation (repeat them). tail(h, given): the tail on rows of
// h; given: those rows' record of the first pass (the MoE routing) to repeat, undefined the first
// time; returns {the rows' output, their record (undefined if none)}. The LoRA dropout masks
// repeat by restoring the random generator (the blocks run in the same order in both passes).
// weight_tensors(): every tensor of the call's weights, which the recomputation replaces by fresh
// leaves to differentiate. tail_bytes_per_token(element_size): the tail's largest activations per
// token (swiglu_tail_bytes), which the block size divides.
struct CheckpointedCall : torch::CustomClassHolder {
  enum class Pass { kPlain, kFirst, kRecompute };
  int64_t layer = 0;
  Batch batch;
  LayerOptions options;
  Lora lora;  // options' LoRA settings, as the blocks take them
  at::Tensor rng_state;
  at::Tensor tail_record;  // a checkpointed call's first pass: every token's record of the tail
  CheckpointedCall(int64_t layer, Batch batch, const LayerOptions& options)
      : layer(layer), batch(std::move(batch)), options(options), lora{options.lora_scaling, options.lora_dropout} {}
  virtual ~CheckpointedCall() = default;
  virtual std::vector<at::Tensor> head(const at::Tensor& hidden, Pass pass) = 0;
  virtual std::pair<at::Tensor, at::Tensor> tail(const at::Tensor& h, const at::Tensor& given) = 0;
  virtual int64_t tail_bytes_per_token(int64_t element_size) const = 0;
  virtual std::vector<at::Tensor*> weight_tensors() = 0;
  std::vector<at::Tensor> forward(const at::Tensor& hidden);
  // The tokens of one block of the tail on h [T, H]: options.checkpoint_block where given (a plain
  // call too, so that a test can compare it with a checkpointed one: the same dropout masks), else
  // all of them in a plain call and as many as kTailBlockMiB holds in a checkpointed one.
  int64_t tail_block(const at::Tensor& h, bool checkpointed) const;
};

// An MLP's or MoE's activations per token: `rows` rows per token (the top-k routed rows; 1 for an
// MLP) of its input and output (H wide) and of its gate and up products, SwiGLU's silu and product
// (I wide), in elements of element_size bytes.
inline int64_t swiglu_tail_bytes(int64_t rows, int64_t H, int64_t I, int64_t element_size) {
  return rows * (2 * H + 4 * I) * element_size;
}

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
  // swiglu_tail_bytes of the layer's MLP, or of its MoE's top_k rows a token; 1 where the weights
  // lack the block (the layer call names what is missing).
  int64_t mlp_or_moe_bytes(bool moe, int64_t top_k, int64_t H, int64_t element_size) const {
    if (!moe) return weights.mlp ? swiglu_tail_bytes(1, H, weights.mlp->gate_proj.weight.size(0), element_size) : 1;
    return weights.moe ? swiglu_tail_bytes(top_k, H, weights.moe->experts.gate_up_proj.weight.size(1) / 2, element_size)
                       : 1;
  }
};

// The checks every layer op makes of its arguments (named in op's messages): hidden a floating
// [tokens, hidden] tensor, layer one of `layers`, the batch's positions and cu_seqlens given,
// dropout in [0, 1). (Each block checks its own weights.)
void check_layer_call(const char* op, const at::Tensor& hidden, int64_t layer, int64_t layers, const Batch& batch,
                      const LayerOptions& options);

// call->forward(hidden); or, with call->options.checkpoint under grad mode, the same without
// keeping its activations for backward: the backward pass runs it again (the head, then the tail
// a block at a time) with gradients on hidden and the weights that require them.
std::vector<at::Tensor> run_layer(const at::Tensor& hidden, const c10::intrusive_ptr<CheckpointedCall>& call);

}  // namespace v4
