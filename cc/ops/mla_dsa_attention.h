#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "cc/common/config.h"
#include "cc/common/lora.h"

// GLM-5's attention (transformers' GlmMoeDsaAttention + GlmMoeDsaIndexer) over packed documents:
// MLA (q_a_proj -> RMSNorm -> q_b_proj; kv_a_proj_with_mqa -> [latent | k_rope], RMSNorm ->
// kv_b_proj), interleaved RoPE with YaRN, softmax over the keys the DSA selection keeps, o_proj;
// LoRA adapters beside the projections apply.
//
// h [T, H]; positions [T]; cu_seqlens [N + 1] document boundaries; carry [T, index_topk]: the
// selection to attend with (a 'shared' layer's, or a recomputation's), None on a 'full' layer
// runs the indexer. Returns (out [T, H], the selection [T, index_topk]: each query's selected
// key positions in its document, ascending, -1 in unused slots).
//
// Memory grows linearly with the sequence. A query with at most index_topk causal keys attends
// to all of them (a dense causal kernel); the others attend to exactly index_topk. In a document
// of up to masked_max_len tokens those run as dense attention under a [queries, keys] mask; in a
// longer one through the latent space (MLA's keys are one 576-wide latent shared by all heads):
// per block of queries the selected latents are gathered once and all heads computed against
// them with batched GEMMs, recomputed in the backward pass. The indexer scores in blocks of
// queries, so no [seq, seq] tensor exists at long sequences.
std::tuple<at::Tensor, at::Tensor> v4_mla_dsa_attention(const at::Tensor& h, const v4::Weights& weights,
                                                        const v4::Glm5Config& cfg, int64_t layer,
                                                        const at::Tensor& positions, const at::Tensor& cu_seqlens,
                                                        const std::optional<at::Tensor>& carry, double lora_scaling,
                                                        double lora_dropout, int64_t masked_max_len);
