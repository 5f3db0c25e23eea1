#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

// The gated delta rule of Gated DeltaNet over packed documents, chunked (transformers'
// torch_chunk_gated_delta_rule; py/v4train/reference/gated_delta_rule.py has the math): per value
// head, with q, k L2-normalised (eps 1e-6), q scaled by Dk^-0.5 and key heads repeated to value
// heads,  S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,  o_t = S_t^T q_t,
// S = 0 at the start of every document. q, k [T, Hk, Dk]; v [T, Hv, Dv]; g (log decay), beta
// [T, Hv]; cu_seqlens int64 [N + 1]. Returns o [T, Hv, Dv] in q's dtype; fp32 math (float64 for
// float64).
//
// Chunks of 64: every document is cut into chunks (its last one padded). On the GPU the fused
// kernels of cc/ops/gated_delta_rule.cu (gdr::Fused below) run it, a fixed number of launches a
// call. Elsewhere (the CPU; float16 and float64, which the parity suite does not draw for the
// kernels; widths over 128) ATen does: the work inside a chunk (the UT
// transform, a triangular solve, the intra-chunk products) for all chunks of all documents at
// once as batched matrix products; what crosses chunks is one recurrence on the [Dk, Dv] state
// (gdr::Recurrence below), forward and backward, a loop over chunk positions. Memory is linear in T.
// The cumulative log decay inside a chunk is summed and differenced in float64, and its gradient
// accumulated in float64: in fp32 the differences of sums of up to 64 log decays lose digits, and
// the A_log / dt_bias gradients that sum them with cancellation came out up to 19% off the exact
// answer (transformers' fp32 rule gives the same), against 1e-6 now. g may be float64 (Gated
// DeltaNet passes it so). g is a log decay, <= 0 as Gated DeltaNet makes it (-exp(A_log)
// softplus(a + dt_bias)); a positive g is refused (ValueError): the chunked form would take exp of
// sums of up to 64 of them, rounding noise in any precision but float64.
at::Tensor v4_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                               const at::Tensor& beta, const at::Tensor& cu_seqlens);

namespace v4::gdr {

constexpr int64_t kChunk = 64;

// v4_gated_delta_rule without its checks of the arguments' sizes and of g's sign (one read back to
// the host): for callers that made them, the Gated DeltaNet block.
at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, const at::Tensor& cu_seqlens);

// Where the chunks lie: [chunks, heads, 64, D] tensors hold chunk position 0 of every document,
// then position 1 of those that have one, ... (documents longest first), so that the documents
// reaching a position are a prefix: chunk c of document d is at offset[c] + d, for d < reach[c].
struct Plan {
  int64_t documents = 0;
  std::vector<int64_t> reach, offset;  // per chunk position
  at::Tensor chunks_of;                // int64 [documents] on the device: each document's chunks
  at::Tensor offset_device;            // int64 [positions] on the device
};

// The recurrence that crosses chunks, for each document and head, over its chunks in order
// (`reverse`: last to first), from S = 0 [Dk, Dv]:
//   state_out[c] = S;  x_out[c] = base[c] + sign_a * a[c] S;  S = decay[c] S + add[c] + sign_b * b[c]^T x_out[c]
// base, x_out [C, H, 64, Dv]; a, b [C, H, 64, Dk]; add (or undefined), state_out [C, H, Dk, Dv];
// decay [C, H]; all of the compute dtype, contiguous (the CUDA fused path's bfloat16 kernels at
// widths 128 hold a and b as bfloat16 values in the first half of each float32 [64, Dk] tile, and
// write state_out in bfloat16: gated_delta_rule.cu, kPlanes). The forward pass is (base u, a w, -1;
// b k_out, +1): the states at each chunk's start and the corrected values v_new. The backward
// is the same recurrence in reverse on the gradients (base dv_new, a k_out, +1; add dh, b w, -1).
struct Recurrence {
  at::Tensor base, a, b, add, decay;
  double sign_a = 1.0, sign_b = 1.0;
  bool reverse = false;
  at::Tensor state_out, x_out;
};

// The fused path (cc/ops/gated_delta_rule.cu): on the GPU the whole rule runs as a few kernels a
// pass, each over every chunk (or, for the recurrence above, every document) at once, forward and
// backward, with nothing per chunk in between but the states. Its inputs as the kernels read them:
// q, k [T, Hk, Dk] and v [T, Hv, Dv] contiguous in one dtype (float32 or bfloat16;
// Dk, Dv <= kFusedMaxDim), g float64 and beta float32 [T, Hv]; `slots` int64 [chunks * 64] on the
// device, the token of each chunk slot (T for the padding of a document's last chunk), chunks in
// the Plan's order. The forward pass sets o [T, Hv, Dv] and keeps h (the state at each chunk's
// start, [chunks, Hv, Dk, Dv] float32; bfloat16 from the CUDA plane kernels) and v_new ([chunks,
// Hv, 64, Dv], as h) for the backward, which takes d_o and sets dq, dk, dv (the inputs' dtype),
// dg (float64) and dbeta (float32).
constexpr int64_t kFusedMaxDim = 128;

struct Fused {
  at::Tensor q, k, v, g, beta, slots;
  Plan plan;
  at::Tensor o, h, v_new;
  at::Tensor d_o, dq, dk, dv, dg, dbeta;
};

// The device kernels of the fused path (v4::Backend): the forward pass, or with `backward` the
// backward pass, of f.
struct FusedKernel {
  using Fn = void (*)(Fused& f, bool backward);
};

}  // namespace v4::gdr
