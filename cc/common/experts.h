#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

#include "cc/common/layer_call.h"
#include "cc/common/lora.h"

namespace v4 {

// The MoE seam, in three steps, so that expert parallelism can put an all-to-all between them:
// dispatch (tokens grouped by expert), expert compute (grouped GEMMs), combine (weighted sum back
// into token order). Shared by GLM-5's v4_glm5_moe and Qwen3.5's MoE.
struct Dispatch {
  at::Tensor token;    // [T * k] int64: the token of each routed row, rows grouped by expert (stable)
  at::Tensor order;    // [T * k] int64: the row's position in the flat [T, k] routing
  at::Tensor counts;   // [E] int64: rows per expert
  at::Tensor offsets;  // [E] int32: the end of each expert's rows (at::_grouped_mm's offs)
  at::Tensor inverse;  // [T * k] int64: the routed row of each (token, slot) of the flat routing
};

// The rows of x [T, in] in routed order, [T * k, in] (k = the slots per token): gathers both
// ways (the gradient sums each token's k rows), no scatter.
at::Tensor dispatch_rows(const at::Tensor& x, const Dispatch& d);

Dispatch dispatch(const at::Tensor& idx, int64_t num_experts);

// x [rows grouped by expert, in] times each row's expert's weight w [E, out, in]: [rows, out].
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w, const Dispatch& d);

// The routed experts' SwiGLU on rows grouped by expert: weights.gate_up_proj [E, 2I, H] (gate
// rows, then up), weights.down_proj [E, H, I], their LoRA adapters.
at::Tensor experts(const at::Tensor& x_rows, const ExpertsWeights& weights, const Lora& lora, const Dispatch& d,
                   const char* op);

// y's rows for x [T, H] routed as d says (d's order, [T k, H]): the experts' SwiGLU here, or with
// an expert-parallel group on the ranks that own each row's expert (weights: this rank's E / size
// experts): the rows go there and their results come back by all-to-all through torch's c10d
// functional collectives, whose gradients run back the same way in the autograd graph.
at::Tensor routed_experts(const at::Tensor& x, const ExpertsWeights& weights, const Lora& lora, const Dispatch& d,
                          const ExpertParallel& ep, const char* op);

// expert_parallel fits E experts, and weights.gate_up_proj [E / size, 2I, H] and down_proj
// [E / size, H, I] fit x [T, H] (this rank's experts), else a ValueError naming op and tensor.
void check_experts(const char* op, const ExpertsWeights& weights, const at::Tensor& x, int64_t E,
                   const ExpertParallel& ep);

// A given routing (a recomputation's): int64 [T, top_k] on x's device, naming experts in [0, E).
void check_routing(const char* op, const at::Tensor& idx, const at::Tensor& x, int64_t top_k, int64_t E);

// sum over k of route_weights[t, k] * y of token t's k-th row: [T, H] in y's dtype.
at::Tensor combine(const at::Tensor& y_rows, const Dispatch& d, const at::Tensor& route_weights, int64_t tokens);

// The combine's device kernels (cc/common/experts.cu; v4::Backend), a block a token: y_rows
// [T k, H] float32 or bfloat16, contiguous, 16-byte aligned, H a multiple of 8, a row at most
// kCombineMaxRowBytes; w [T, k] float32 (combine() widens bf16 or fp16 weights, exactly),
// contiguous, k at most kCombineMaxSlots; inverse int64 [T k]. The forward pass sets out [T, H]
// (each product rounded to y's dtype, summed in float32: the ATen path's roundings); the backward
// pass takes dout [T, H] (y's dtype, contiguous, aligned), sets dw [T, k] float32 and writes y's
// gradient, dout[t] w[t, j] rounded once, over y_rows (each row read before it is overwritten).
constexpr int64_t kCombineMaxSlots = 16, kCombineMaxRowBytes = 32768;

struct CombineRows {
  at::Tensor y_rows, w, inverse;
  at::Tensor out;
  at::Tensor dout, dw;
};

struct CombineKernel {
  using Fn = void (*)(CombineRows& c, bool backward);
};

// The experts' SwiGLU as device kernels (cc/common/experts.cu): act = silu(gate) * up over
// gate_up = [gate | up] [rows, 2I], float32 or bfloat16, contiguous, 16-byte aligned, I a multiple
// of 8, with the ATen path's roundings (silu rounded to the dtype, then the product). The forward
// pass sets act [rows, I]; the backward pass takes dact (like act) and sets dgate_up [rows, 2I]:
// one read of each tensor, where ATen took five passes and a concatenation of the halves' gradients.
struct SwigluRows {
  at::Tensor gate_up, act;
  at::Tensor dact, dgate_up;
};

struct SwigluKernel {
  using Fn = void (*)(SwigluRows& s, bool backward);
};

}  // namespace v4
