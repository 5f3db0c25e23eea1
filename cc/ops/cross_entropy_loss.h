#pragma once

#include <ATen/core/Tensor.h>

// The LM head and next-token cross-entropy in one op, a chunk of tokens at a time:
//   sum over t with targets[t] != -100 of (logsumexp(h_t W^T) - (h_t W^T)[targets[t]]) / normalizer
// hidden [T, H], weight [V, H] (same floating dtype), targets [T] int64. Logits are formed in
// the model dtype and reduced in float32 (as transformers' ForCausalLMLoss); the [T, V] logits never
// outlive one chunk. Where autograd will want gradients, the forward pass forms them too (Liger-
// Kernel's fused linear cross-entropy: the backward pass only scales them by the loss's incoming
// gradient).
at::Tensor v4_cross_entropy_loss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                 double normalizer, int64_t chunk_tokens);

namespace v4::ce {

constexpr int64_t kIgnore = -100;  // a target that takes no part in the loss

// The device kernel (cc/ops/cross_entropy_loss.cu; v4::Backend) for one chunk's logits [c, V]
// (float32 or bfloat16, contiguous) and targets [c] (int64, -100 ignored): sets loss [c] (float32)
// to -log_softmax(row)[target], 0 where ignored; with `grad`, overwrites the logits with the loss's
// gradient, (softmax(row) - onehot(target)) * (target ignored ? 0 : 1 / normalizer), in their
// dtype. As the ATen path computes them (log_softmax in float32, then exp, the product and the
// target's term, one rounding to the dtype), NaN where a row holds a NaN or an infinity, in one
// read of the logits and one read and write with `grad`, instead of some nine passes over a float32
// copy. Returns false where it does not cover the inputs (another dtype, non-contiguous rows).
struct Rows {
  at::Tensor logits, targets;
  double normalizer;
  bool grad;
  at::Tensor loss;
};

struct Kernel {
  using Fn = bool (*)(Rows& rows);
};

}  // namespace v4::ce
