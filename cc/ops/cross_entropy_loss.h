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
