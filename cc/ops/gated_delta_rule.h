#pragma once

#include <ATen/core/Tensor.h>

// The gated delta rule of Gated DeltaNet over packed documents, chunked (transformers'
// torch_chunk_gated_delta_rule; py/v4train/reference/gated_delta_rule.py has the math): per value
// head, with q, k L2-normalised (eps 1e-6), q scaled by Dk^-0.5 and key heads repeated to value
// heads,  S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,  o_t = S_t^T q_t,
// S = 0 at the start of every document. q, k [T, Hk, Dk]; v [T, Hv, Dv]; g (log decay), beta
// [T, Hv]; cu_seqlens int64 [N + 1]. Returns o [T, Hv, Dv] in q's dtype; fp32 math (float64 for
// float64).
//
// Chunks of 64: every document is cut into chunks (its last one padded); the work inside a chunk
// (the UT transform, a triangular solve) runs for all chunks of all documents at once; the scan
// across chunks runs once per chunk position for all documents that reach it, so the loop is as
// long as the longest document's chunks, never per document or per token. Autograd keeps per-chunk
// tensors and chunk-boundary states only. g is a log decay, <= 0 as Gated DeltaNet makes it
// (-exp(A_log) softplus(a + dt_bias)); a positive g (growth) is not refused, but the chunked form
// then takes exp of sums up to 64 g, and it and the reference part by 2e-4 in float64 at g = 0.5.
at::Tensor v4_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                               const at::Tensor& beta, const at::Tensor& cu_seqlens);
