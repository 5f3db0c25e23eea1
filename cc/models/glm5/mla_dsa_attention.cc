#include "cc/models/glm5/mla_dsa_attention.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "cc/common/attention.h"
#include "cc/common/backend.h"
#include "cc/common/checks.h"
#include "cc/common/rope.h"
#include "cc/ops/rms_norm.h"

namespace v4 {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {
thread_local AttentionStash* current_stash = nullptr;
}  // namespace

StashScope::StashScope(AttentionStash* stash) : previous_(current_stash) { current_stash = stash; }
StashScope::~StashScope() { current_stash = previous_; }

namespace {

constexpr const char* kOp = "v4_mla_dsa_attention";
// transformers builds q_a_layernorm, kv_a_layernorm and the indexer's k_norm with eps 1e-6.
constexpr double kLatentEps = 1e-6;
// Scores a block of queries may hold at once (indexer and sparse attention), in bytes: large
// enough that a 64k-token document scores in a few hundred blocks, not thousands of launches.
// Tests shrink it (set_block_bytes) to run the blocked paths on small documents.
std::atomic<int64_t> block_bytes{int64_t{1} << 30};

// Each row's key positions ascending, the unused slots (-1) last; rows are the queries from
// first_query on. A key after its query is unused: top-k picks one only where fewer than k causal
// keys score above the masked future's -inf (scores of -inf or NaN from non-finite weights), and
// no query may attend ahead of itself whatever its scores (the reference does the same).
at::Tensor canonical(const at::Tensor& keys, int64_t first_query) {
  constexpr int64_t big = std::numeric_limits<int64_t>::max();
  const at::Tensor query = at::arange(first_query, first_query + keys.size(0), keys.options()).unsqueeze(1);
  const at::Tensor ordered = std::get<0>(at::where((keys < 0).logical_or(keys > query), big, keys).sort(-1));
  return at::where(ordered == big, -1, ordered);
}

// A product with at least float32 output. On the GPU bf16/fp16 operands run on the tensor cores
// (fp32 accumulation) and the result is rounded to their dtype once, as the reference's bf16
// products are (the fp32-output bmm variant faults on unaligned views, e.g. a block of a slice).
at::Tensor bmm_f32(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == at::kDouble || a.scalar_type() == at::kFloat) return at::bmm(a, b);
  if (a.is_cuda()) return at::bmm(a, b).to(at::kFloat);
  return at::bmm(a.to(at::kFloat), b.to(at::kFloat));
}

at::ScalarType at_least_float(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// Queries per block so that `per_query` bytes each stay within block_bytes.
int64_t block_rows(int64_t per_query) { return std::max<int64_t>(1, block_bytes / std::max<int64_t>(per_query, 1)); }

// The DSA selection (v4train/reference/mla_dsa_attention.py:select_keys, the same ATen calls in
// the same order, so a document small enough to score at once selects exactly what the
// reference selects, near-ties included). Larger documents score in blocks of queries.
at::Tensor select_keys(const at::Tensor& h, const at::Tensor& q_resid, const MlaWeights& weights, const Glm5Config& cfg,
                       const at::Tensor& cos, const at::Tensor& sin,
                       const std::vector<std::pair<int64_t, int64_t>>& docs) {
  at::NoGradGuard no_grad;
  const int64_t T = h.size(0), K = cfg.index_topk, n = cfg.index_n_heads, d = cfg.index_head_dim,
                r = cfg.qk_rope_head_dim;
  const auto longs = h.options().dtype(at::kLong);
  at::Tensor out = at::full({T, K}, -1, longs);
  const at::Tensor pos = at::arange(K, longs);
  const bool ranked = std::any_of(docs.begin(), docs.end(), [&](const auto& dc) { return dc.second - dc.first > K; });
  at::Tensor q, k, head_weights;
  if (ranked) {
    TORCH_CHECK_VALUE(weights.indexer.has_value(), kOp, ": a 'full' indexer layer needs weights.indexer");
    const IndexerWeights& w = *weights.indexer;
    for (const auto& [map, name] : {std::pair{&w.wq_b, "indexer.wq_b"}, {&w.wk, "indexer.wk"},
                                    {&w.weights_proj, "indexer.weights_proj"}}) {
      TORCH_CHECK_VALUE(!has_adapter(*map, kOp, name), kOp, ": ", name,
                        " has a LoRA adapter; the indexer is not adapted");
    }
    // The FP8-aware linear map (an FP8 weight dequantised just in time, or on FP8 tensor cores where
    // path (a) applies); no adapter (refused above), so no Lora.
    q = linear(q_resid, w.wq_b, Lora{}, kOp, "indexer.wq_b").view({T, n, d});
    q = at::cat({rope_interleaved(q.slice(-1, 0, r), cos, sin), q.slice(-1, r)}, -1);
    k = at::layer_norm(linear(h, w.wk, Lora{}, kOp, "indexer.wk"), {d}, w.k_norm, w.k_norm_bias, kLatentEps);
    k = at::cat({rope_interleaved(k.unsqueeze(1).slice(-1, 0, r), cos, sin).select(1, 0), k.slice(-1, r)}, -1);
    // transformers keeps weights_proj in fp32 (an FP8 one dequantises to fp32 on load)
    const at::Tensor wp = dense_weight(w.weights_proj, at::kFloat, kOp, "indexer.weights_proj");
    head_weights = at::linear(h.to(wp.scalar_type()), wp).to(at::kFloat) * std::pow(n, -0.5);
  }
  const double scale = std::pow(d, -0.5);
  const auto scores_kernel = Backend<dsa::IndexerScores>::find(h.device().type());
  for (const auto& [start, end] : docs) {
    const int64_t L = end - start, first = std::min(L, K);
    const at::Tensor p = at::arange(first, longs);
    out.slice(0, start, start + first).copy_(at::where(pos.unsqueeze(0) <= p.unsqueeze(1), pos.unsqueeze(0), -1));
    if (L <= K) continue;
    const at::Tensor wd = head_weights.slice(0, start, end);
    if (scores_kernel) {  // fused on the device: only the [queries, keys] scores reach memory
      const at::Tensor ql = q.slice(0, start, end), kl = k.slice(0, start, end);
      const int64_t rows = block_rows(L * 4);
      bool covered = true;
      for (int64_t b0 = K; covered && b0 < L; b0 += rows) {
        const int64_t b1 = std::min(L, b0 + rows);
        at::Tensor scores;
        covered = scores_kernel(ql.slice(0, b0, b1), kl.slice(0, 0, b1), wd.slice(0, b0, b1), b0, scale, scores);
        // The set only (sorted false): canonical orders it by key. torch's CUDA topk selects, then
        // sorts what it selected, so the set is the one a sorted topk gives.
        if (covered) {
          const at::Tensor top = std::get<1>(scores.topk(K, -1, /*largest=*/true, /*sorted=*/false));
          out.slice(0, start + b0, start + b1).copy_(canonical(top, b0));
        }
      }
      if (covered) continue;
    }
    if (L * n * L * 4 <= block_bytes) {  // all at once, as the reference
      const at::Tensor qd = q.slice(0, start, end).to(at::kFloat), kd = k.slice(0, start, end).to(at::kFloat);
      const at::Tensor scores = at::relu(at::matmul(qd, kd.t()) * scale);                 // [L, n, L]
      at::Tensor index_scores = at::matmul(wd.unsqueeze(-2), scores).squeeze(-2);           // [L, L]
      const at::Tensor causal = at::ones({L, L}, h.options().dtype(at::kBool)).tril();
      index_scores = index_scores.masked_fill(causal.logical_not(), -std::numeric_limits<double>::infinity());
      out.slice(0, start + K, end).copy_(canonical(std::get<1>(index_scores.slice(0, K).topk(K, -1)), K));
      continue;
    }
    // Blocks of queries; the scores' products take the activations' dtype with fp32 accumulation
    // and output (on the GPU, bf16 operands run on the tensor cores; the values are the same
    // bf16 numbers the reference upcasts).
    const at::Tensor ql = q.slice(0, start, end), kl = k.slice(0, start, end);
    const int64_t rows = block_rows(n * L * 4);
    for (int64_t b0 = K; b0 < L; b0 += rows) {
      const int64_t b1 = std::min(L, b0 + rows), B = b1 - b0;  // queries b0..b1-1 see keys 0..b1-1
      const at::Tensor scores = bmm_f32(ql.slice(0, b0, b1).reshape({1, B * n, d}), kl.slice(0, 0, b1).t().unsqueeze(0))
                                    .view({B, n, b1})
                                    .mul_(scale)
                                    .relu_();
      at::Tensor index_scores = at::matmul(wd.slice(0, b0, b1).unsqueeze(-2), scores).squeeze(-2);  // [B, b1]
      const at::Tensor key = at::arange(b1, longs), query = at::arange(b0, b1, longs);
      index_scores = index_scores.masked_fill(key.unsqueeze(0) > query.unsqueeze(1),
                                              -std::numeric_limits<double>::infinity());
      out.slice(0, start + b0, start + b1).copy_(canonical(std::get<1>(index_scores.topk(K, -1)), b0));
    }
  }
  return out;
}

// Every query of a document attends to its causal keys: all of them (its first index_topk
// queries), or index_topk of them (the rest). A selection that leaves a later query with fewer,
// or names a key after its query or outside its document, is refused here instead of being read
// out of bounds: the indexer's own selection only over non-finite scores (NaN or inf in its
// weights or input), a carry whenever its maker broke it. One [T, K] comparison and one read.
void check_selection(const char* op, const at::Tensor& selection, const std::vector<std::pair<int64_t, int64_t>>& docs,
                     int64_t K, bool carried) {
  std::vector<int64_t> local(selection.size(0));  // each token's position in its document
  for (const auto& [start, end] : docs) {
    for (int64_t t = start; t < end; ++t) local[t] = t - start;
  }
  const at::Tensor query = at::tensor(local, selection.options().device(at::kCPU)).to(selection.device()).unsqueeze(1);
  const at::Tensor ok = (selection <= query).logical_and((selection >= 0).logical_or((selection == -1).logical_and(query < K)));
  TORCH_CHECK_VALUE(ok.all().item<bool>(), op, ": ", carried ? "carry" : "the DSA indexer's selection",
                    " must name for each query keys of its own document at or before it, index_topk of them from ",
                    "the document's query index_topk on",
                    carried ? "" : " (its scores were not finite: NaN or inf in the indexer's weights or input)");
}

// Attention of queries q [Lq, nh, D] to the selected rows of one latent per key, kv [L, D]
// (D = C value dims + rope dims, all heads sharing it): o = softmax(q kv[idx]^T * scale)
// kv[idx][:, :C], idx [Lq, K]. Runs in blocks of queries; the backward pass recomputes the
// scores from the saved log-sum-exp, so only q, kv, idx, o and [Lq, nh] floats are kept.
struct SparseLatentAttention : public torch::autograd::Function<SparseLatentAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx,
                            double scale, int64_t value_dims) {
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["value_dims"] = value_dims;
    AttentionStash* stash = current_stash;
    if (stash && stash->replay && stash->next < stash->saved.size()) {
      auto [o, lse] = std::move(stash->saved[stash->next++]);
      ctx->save_for_backward({q, kv, idx, lse, o});
      return o;
    }
    auto [o, lse] = attend(q, kv, idx, scale, value_dims);
    if (stash) stash->saved.emplace_back(o, lse);
    ctx->save_for_backward({q, kv, idx, lse, o});
    return o;
  }

  // (o, log-sum-exp): on the GPU's kernels where they apply, else ATen in blocks of queries.
  static std::pair<at::Tensor, at::Tensor> attend(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx,
                                                  double scale, int64_t value_dims) {
    at::Tensor o, lse;
    const auto kernel = Backend<dsa::SparseForward>::find(q.device().type());
    if (kernel && kernel(q, kv, idx, scale, value_dims, o, lse)) return {o, lse};
    const int64_t Lq = q.size(0), nh = q.size(1), D = q.size(2), K = idx.size(1);
    o = at::empty({Lq, nh, value_dims}, q.options());
    lse = at::empty({Lq, nh}, q.options().dtype(at_least_float(q.scalar_type())));
    const int64_t rows = block_rows(K * D * 2 + nh * K * 4 * 3);
    for (int64_t b0 = 0; b0 < Lq; b0 += rows) {
      const int64_t b1 = std::min(Lq, b0 + rows), B = b1 - b0;
      const at::Tensor sel = kv.index_select(0, idx.slice(0, b0, b1).reshape(-1)).view({B, K, D});
      const at::Tensor s = bmm_f32(q.slice(0, b0, b1), sel.transpose(1, 2)) * scale;  // [B, nh, K]
      const at::Tensor m = at::logsumexp(s, -1);
      lse.slice(0, b0, b1).copy_(m);
      const at::Tensor p = (s - m.unsqueeze(-1)).exp_().to(q.scalar_type());
      o.slice(0, b0, b1).copy_(at::bmm(p, sel.slice(-1, 0, value_dims)));
    }
    return {o, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &kv = saved[1], &idx = saved[2], &lse = saved[3], &o = saved[4];
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t C = ctx->saved_data["value_dims"].toInt();
    {
      at::Tensor dq, dkv;
      const auto kernel = Backend<dsa::SparseBackward>::find(q.device().type());
      if (kernel && kernel(q, kv, idx, o, lse, grads[0], scale, C, dq, dkv)) {
        return {dq, dkv.to(kv.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor()};
      }
    }
    const at::Tensor dout = grads[0].to(q.scalar_type());
    const int64_t Lq = q.size(0), nh = q.size(1), D = q.size(2), K = idx.size(1);
    const auto acc = at_least_float(q.scalar_type());
    at::Tensor dq = at::empty_like(q);
    at::Tensor dkv = at::zeros({kv.size(0), D}, kv.options().dtype(acc));
    const int64_t rows = block_rows(K * D * 2 + K * D * 4 + nh * K * 4 * 4);
    for (int64_t b0 = 0; b0 < Lq; b0 += rows) {
      const int64_t b1 = std::min(Lq, b0 + rows), B = b1 - b0;
      const at::Tensor flat = idx.slice(0, b0, b1).reshape(-1);
      const at::Tensor sel = kv.index_select(0, flat).view({B, K, D});
      const at::Tensor qb = q.slice(0, b0, b1), dob = dout.slice(0, b0, b1);
      const at::Tensor p = (bmm_f32(qb, sel.transpose(1, 2)) * scale - lse.slice(0, b0, b1).unsqueeze(-1)).exp_();
      const at::Tensor dp = bmm_f32(dob, sel.slice(-1, 0, C).transpose(1, 2));  // [B, nh, K]
      // delta = sum_j p dp, which equals rowsum(dout * o) but from the same (on the GPU, rounded)
      // dp: a query with one key gets ds = 0 exactly, where the rounded o's delta left dp's
      // rounding in dq (its exact gradient is 0), as softmax's own backward does.
      const at::Tensor ds = (p * (dp - (p * dp).sum(-1, true)) * scale).to(q.scalar_type());
      dq.slice(0, b0, b1).copy_(at::bmm(ds, sel));
      at::Tensor dsel = bmm_f32(ds.transpose(1, 2), qb);  // [B, K, D]
      dsel.slice(-1, 0, C).add_(bmm_f32(p.to(q.scalar_type()).transpose(1, 2), dob));
      dkv.index_add_(0, flat, dsel.view({B * K, D}));
    }
    return {dq, dkv.to(kv.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The queries past the first index_topk of a long document, through the latent space: q [Lq, nh,
// nope + r] against the document's latents [L, C] and rotated k_rope [L, r]; kv_b weight (with
// its adapter folded in) supplies the per-head key and value maps. Returns [Lq, nh, dv]. Taking
// the maps to the query and output side reassociates the products; float32 inputs compute in
// float64 here, so the result is as accurate as the direct form's.
at::Tensor latent_attention(const at::Tensor& q_in, const at::Tensor& latent_in, const at::Tensor& k_rot_in,
                            const at::Tensor& kv_b_in, const at::Tensor& idx, const Glm5Config& cfg, double scale) {
  const int64_t nh = cfg.num_attention_heads, nope = cfg.qk_nope_head_dim, dv = cfg.v_head_dim,
                C = cfg.kv_lora_rank;
  const auto widen = [&](const at::Tensor& t) { return q_in.scalar_type() == at::kFloat ? t.to(at::kDouble) : t; };
  const at::Tensor q = widen(q_in), latent = widen(latent_in), k_rot = widen(k_rot_in);
  const at::Tensor maps = widen(kv_b_in).view({nh, nope + dv, C});
  const at::Tensor q_lat = at::bmm(q.slice(-1, 0, nope).transpose(0, 1), maps.slice(1, 0, nope)).transpose(0, 1);
  const at::Tensor kv = at::cat({latent, k_rot}, -1);
  const at::Tensor o_lat = SparseLatentAttention::apply(at::cat({q_lat, q.slice(-1, nope)}, -1), kv, idx, scale, C);
  return at::bmm(o_lat.transpose(0, 1), maps.slice(1, nope).transpose(1, 2)).transpose(0, 1).to(q_in.scalar_type());
}

}  // namespace

int64_t set_block_bytes(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes > 0, kOp, ": the block size must be > 0 bytes, got ", bytes);
  return block_bytes.exchange(bytes);
}

at::Tensor sparse_latent_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx, double scale,
                                   int64_t value_dims) {
  constexpr const char* op = "sparse_latent_attention";
  check_floating(op, "q", q, /*float64=*/true);
  check_dim(op, "q", q, 3);
  check_dim(op, "kv", kv, 2);
  check_dim(op, "idx", idx, 2);
  check_same_device(op, "kv", kv, "q", q);
  check_same_device(op, "idx", idx, "q", q);
  TORCH_CHECK_VALUE(kv.scalar_type() == q.scalar_type() && kv.size(1) == q.size(2) && idx.size(0) == q.size(0) &&
                        idx.scalar_type() == at::kLong && value_dims > 0 && value_dims <= q.size(2),
                    op, ": expected q [Lq, nh, D], kv [L, D] of q's dtype, idx int64 [Lq, K] and 0 < value_dims <= D; got q ",
                    q.sizes(), " ", q.scalar_type(), ", kv ", kv.sizes(), " ", kv.scalar_type(), ", idx ", idx.sizes(),
                    " ", idx.scalar_type(), ", value_dims ", value_dims);
  TORCH_CHECK_VALUE(idx.numel() == 0 || (idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < kv.size(0)),
                    op, ": idx must lie in [0, ", kv.size(0), "): the op gives the sparse path only queries with every slot used");
  return SparseLatentAttention::apply(q.contiguous(), kv.contiguous(), idx.contiguous(), scale, value_dims);
}

at::Tensor indexer_scores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& w, int64_t first, double scale) {
  at::Tensor out;
  const auto kernel = Backend<dsa::IndexerScores>::find(q.device().type());
  TORCH_CHECK_VALUE(kernel && kernel(q, k, w, first, scale, out), "indexer_scores: no device kernel covers q ",
                    q.sizes(), " ", q.scalar_type(), " on ", q.device(), ", k ", k.sizes(), ", w ", w.sizes());
  return out;
}

}  // namespace v4

std::tuple<at::Tensor, at::Tensor> v4_mla_dsa_attention(const at::Tensor& h, const v4::MlaWeights& weights,
                                                        const v4::Glm5Config& cfg, int64_t layer,
                                                        const at::Tensor& positions, const at::Tensor& cu_seqlens,
                                                        const std::optional<at::Tensor>& carry, double lora_scaling,
                                                        double lora_dropout, int64_t masked_max_len) {
  using namespace v4;
  constexpr const char* op = kOp;
  check_floating(op, "h", h, /*float64=*/true);
  check_dim(op, "h", h, 2);
  v4::check_weights(op, weights, h);
  const int64_t T = h.size(0), K = cfg.index_topk;
  TORCH_CHECK_VALUE(h.size(1) == cfg.hidden_size, op, ": h has shape ", h.sizes(), ", expected [T, hidden_size=",
                    cfg.hidden_size, "]");
  TORCH_CHECK_VALUE(layer >= 0 && layer < static_cast<int64_t>(cfg.indexer_types.size()), op, ": layer ", layer,
                    " is not one of the config's ", cfg.indexer_types.size(), " layers");
  TORCH_CHECK_VALUE(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == T, op,
                    ": positions must be int64 [", T, "], got ", positions.scalar_type(), " ", positions.sizes());
  check_same_device(op, "positions", positions, "h", h);
  const auto docs = documents(op, cu_seqlens, T);
  if (carry) {
    TORCH_CHECK_VALUE(carry->scalar_type() == at::kLong && carry->dim() == 2 && carry->size(0) == T &&
                          carry->size(1) == K,
                      op, ": carry must be the int64 [", T, ", ", K, "] selection, got ", carry->scalar_type(), " ",
                      carry->sizes());
    check_same_device(op, "carry", *carry, "h", h);
  } else {
    TORCH_CHECK_VALUE(cfg.indexer_types[layer] == "full", op, ": layer ", layer,
                      " is a 'shared' indexer layer but no earlier layer's selection was given (carry)");
  }
  const Lora lora{lora_scaling, lora_dropout};
  const int64_t nh = cfg.num_attention_heads, nope = cfg.qk_nope_head_dim, r = cfg.qk_rope_head_dim,
                dv = cfg.v_head_dim, C = cfg.kv_lora_rank;

  const at::Tensor q_resid = v4_rms_norm(linear(h, weights.q_a_proj, lora, op, "q_a_proj"), weights.q_a_layernorm,
                                         kLatentEps, false);
  at::Tensor q = linear(q_resid, weights.q_b_proj, lora, op, "q_b_proj").view({T, nh, nope + r});
  const at::Tensor kv_a = linear(h, weights.kv_a_proj_with_mqa, lora, op, "kv_a_proj_with_mqa");
  const at::Tensor latent = v4_rms_norm(kv_a.slice(-1, 0, C), weights.kv_a_layernorm, kLatentEps, false);
  const auto [cos, sin] = rope_cos_sin(cfg.rope, positions, h.scalar_type());
  q = at::cat({q.slice(-1, 0, nope), rope_interleaved(q.slice(-1, nope), cos, sin)}, -1);
  const at::Tensor k_rot = rope_interleaved(kv_a.slice(-1, C).unsqueeze(1), cos, sin);  // [T, 1, r]
  // Per-head keys and values of the tokens that attend densely: every token of a document up to
  // masked_max_len, the first index_topk of a longer one (its other queries attend through the latent).
  const bool any_long = std::any_of(docs.begin(), docs.end(), [&](const auto& d) { return d.second - d.first > masked_max_len; });
  const auto keys_values = [&](const at::Tensor& latent_rows, const at::Tensor& rot_rows) {
    const int64_t rows = latent_rows.size(0);
    const at::Tensor kv = linear(latent_rows, weights.kv_b_proj, lora, op, "kv_b_proj").view({rows, nh, nope + dv});
    return std::pair{at::cat({kv.slice(-1, 0, nope), rot_rows.expand({rows, nh, r})}, -1), kv.slice(-1, nope)};
  };
  const auto [k, v] = any_long ? std::pair<at::Tensor, at::Tensor>{} : keys_values(latent, k_rot);
  const at::Tensor selection = carry ? *carry : select_keys(h, q_resid, weights, cfg, cos, sin, docs);
  check_selection(op, selection, docs, K, carry.has_value());

  const double scale = std::pow(nope + r, -0.5) * rope_softmax_scale_factor(cfg.rope);
  std::vector<at::Tensor> outs;
  const auto qs = per_document(q, docs), latents = per_document(latent, docs), rots = per_document(k_rot, docs);
  const auto ks = any_long ? std::vector<at::Tensor>{} : per_document(k, docs);
  const auto vs = any_long ? std::vector<at::Tensor>{} : per_document(v, docs);
  for (size_t i = 0; i < docs.size(); ++i) {
    const int64_t start = docs[i].first, end = docs[i].second, L = end - start;
    const int64_t rows = L > masked_max_len ? std::min(L, K) : L;  // the keys it attends densely
    const auto [kd, vd] = any_long ? keys_values(latents[i].slice(0, 0, rows), rots[i].slice(0, 0, rows))
                                   : std::pair{ks[i], vs[i]};
    const at::Tensor& qd = qs[i];
    if (L <= K) {  // every query attends to all its causal keys
      outs.push_back(sdpa(qd, kd, vd, scale, /*causal=*/true));
      continue;
    }
    outs.push_back(sdpa(qd.slice(0, 0, K), kd.slice(0, 0, K), vd.slice(0, 0, K), scale, /*causal=*/true));
    const at::Tensor sel = selection.slice(0, start + K, end);
    if (L <= masked_max_len) {
      const at::Tensor mask = at::zeros({L - K, L}, h.options().dtype(at::kBool)).scatter_(1, sel, true);
      outs.push_back(sdpa(qd.slice(0, K), kd, vd, scale, /*causal=*/false, mask));
    } else {
      const Linear& map = weights.kv_b_proj;
      at::Tensor kv_b = dense_weight(map, latent.scalar_type(), op, "kv_b_proj");
      if (has_adapter(map, op, "kv_b_proj")) {  // folded in: the latent path needs the whole map
        TORCH_CHECK_VALUE(lora_dropout == 0, op, ": lora_dropout > 0 with an adapter on kv_b_proj is not supported "
                          "for documents longer than ", masked_max_len, " tokens (the latent path folds the adapter)");
        kv_b = kv_b + at::matmul(*map.lora_B, *map.lora_A) * lora_scaling;
      }
      outs.push_back(latent_attention(qd.slice(0, K), latents[i], rots[i].select(1, 0), kv_b, sel, cfg, scale));
    }
  }
  const at::Tensor attn = outs.empty() ? at::empty({0, nh, dv}, h.options()) : at::cat(outs, 0);
  return {linear(attn.reshape({T, nh * dv}), weights.o_proj, lora, op, "o_proj"), selection};
}
