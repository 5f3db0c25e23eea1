#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "cc/common/lora.h"
#include "cc/models/glm5/config.h"

namespace v4 {

// The DSA indexer's weights (transformers' self_attn.indexer.*): wq_b [n d, q_lora_rank], wk
// [d, H], the key LayerNorm's weight and bias [d], weights_proj [n, H] (fp32). Never adapted.
#define V4_INDEXER_WEIGHTS_FIELDS(X) \
  X(Linear, wq_b, {})                \
  X(Linear, wk, {})                  \
  X(at::Tensor, k_norm, {})          \
  X(at::Tensor, k_norm_bias, {})     \
  X(Linear, weights_proj, {})

struct IndexerWeights {
  V4_INDEXER_WEIGHTS_FIELDS(V4_DECLARE_FIELD)
};
V4_FIELD_VISITOR(IndexerWeights, V4_INDEXER_WEIGHTS_FIELDS)

// MLA's weights (transformers' self_attn.*): q_a_proj [q_lora_rank, H] and its norm, q_b_proj
// [nh (nope + rope), q_lora_rank], kv_a_proj_with_mqa [kv_lora_rank + rope, H] and the latent's
// norm, kv_b_proj [nh (nope + v), kv_lora_rank], o_proj [H, nh v]; the indexer on a 'full' layer.
#define V4_MLA_WEIGHTS_FIELDS(X)               \
  X(Linear, q_a_proj, {})                      \
  X(at::Tensor, q_a_layernorm, {})             \
  X(Linear, q_b_proj, {})                      \
  X(Linear, kv_a_proj_with_mqa, {})            \
  X(at::Tensor, kv_a_layernorm, {})            \
  X(Linear, kv_b_proj, {})                     \
  X(Linear, o_proj, {})                        \
  X(std::optional<IndexerWeights>, indexer, std::nullopt)

struct MlaWeights {
  V4_MLA_WEIGHTS_FIELDS(V4_DECLARE_FIELD)
};
V4_FIELD_VISITOR(MlaWeights, V4_MLA_WEIGHTS_FIELDS)

}  // namespace v4

// GLM-5's attention (transformers' GlmMoeDsaAttention + GlmMoeDsaIndexer) over packed documents:
// MLA (q_a_proj -> RMSNorm -> q_b_proj; kv_a_proj_with_mqa -> [latent | k_rope], RMSNorm ->
// kv_b_proj), interleaved RoPE with YaRN, softmax over the keys the DSA selection keeps, o_proj;
// LoRA adapters with the projections apply.
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
std::tuple<at::Tensor, at::Tensor> v4_mla_dsa_attention(const at::Tensor& h, const v4::MlaWeights& weights,
                                                        const v4::Glm5Config& cfg, int64_t layer,
                                                        const at::Tensor& positions, const at::Tensor& cu_seqlens,
                                                        const std::optional<at::Tensor>& carry, double lora_scaling,
                                                        double lora_dropout, int64_t masked_max_len);

namespace v4 {

// Selective recomputation: a checkpointed layer keeps the sparse latent attention's outputs (o and
// its log-sum-exp, [queries, heads, 512 + 1] per long document) from its first pass, and its
// recomputation takes them instead of attending again; everything else is recomputed. While a
// StashScope is alive, the sparse latent attention calls on this thread record into the stash,
// or, once `replay` is set, take from it in the same order.
struct AttentionStash {
  std::vector<std::pair<at::Tensor, at::Tensor>> saved;
  size_t next = 0;
  bool replay = false;
};

// The bytes of scores a block of queries may hold at once in the indexer and the sparse attention
// (1 GiB); returns the previous value. For tests: a small value runs the blocked paths, which
// otherwise start beyond a few thousand tokens.
int64_t set_block_bytes(int64_t bytes);

// For tests, the op's sparse kernels alone (parity/test_mla_dsa_attention.py holds them to their
// float64 truth, where a layer's chain of roundings would hide a wrong part of a gradient):
// softmax(q kv[idx]^T scale) kv[idx][:, :value_dims] with its autograd, q [Lq, nh, D], kv [L, D],
// idx [Lq, K] (keys of kv, every slot used as the op's sparse queries use them); and the device's indexer scores (dsa::IndexerScores), which raise
// where no device kernel covers their inputs.
at::Tensor sparse_latent_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx, double scale,
                                   int64_t value_dims);
at::Tensor indexer_scores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w, int64_t first, double scale);

class StashScope {
 public:
  explicit StashScope(AttentionStash* stash);
  ~StashScope();
  StashScope(const StashScope&) = delete;
  StashScope& operator=(const StashScope&) = delete;

 private:
  AttentionStash* previous_;
};

}  // namespace v4

namespace v4::dsa {
// The device kernels of v4_mla_dsa_attention (v4::Backend; cc/ops/mla_dsa_attention.cu registers
// CUDA's): each returns false where it does not cover its inputs, and the op's ATen code computes.

// The indexer's scores of a block of queries (on the tensor cores: bf16 or fp16):
// out[i, j] = scale * sum_h w[i, h] relu(q[i, h] . k[j]), -inf where key j comes after query
// first + i. q [B, n, d] and k [Nk, d] with contiguous rows, w [B, n] float32; out [B, Nk]
// float32, no [B, n, Nk] tensor.
struct IndexerScores {
  using Fn = bool (*)(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w, int64_t first, double scale,
                      at::Tensor& out);
};

// Attention of q [Lq, nh, D] to the rows idx [Lq, K] (-1: unused) of kv [L, D], values the first
// C columns (SparseLatentAttention in mla_dsa_attention.cc), one block per query gathering the
// selected rows in tiles, no score written to memory. Forward: o [Lq, nh, C] and the natural-log
// lse [Lq, nh] float32; backward: dq [Lq, nh, D] and dkv [L, D] float32 (accumulated atomically).
// CUDA's: bf16/fp16, D and C multiples of 8, D up to 1152 and shared memory for the tiles.
struct SparseForward {
  using Fn = bool (*)(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx, double scale, int64_t C,
                      at::Tensor& o, at::Tensor& lse);
};
struct SparseBackward {
  using Fn = bool (*)(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx, const at::Tensor& o,
                      const at::Tensor& lse, const at::Tensor& dout, double scale, int64_t C, at::Tensor& dq,
                      at::Tensor& dkv);
};
}  // namespace v4::dsa
