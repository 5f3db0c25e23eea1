#include "cc/ops/gated_delta_rule.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "cc/common/checks.h"

namespace {

constexpr int64_t kChunk = 64;

at::Tensor l2_normalised(const at::Tensor& x) { return x * at::rsqrt(x.square().sum(-1, /*keepdim=*/true) + 1e-6); }

}  // namespace

at::Tensor v4_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                               const at::Tensor& beta, const at::Tensor& cu_seqlens) {
  constexpr const char* op = "v4_gated_delta_rule";
  for (const auto& [name, t] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}}) {
    v4::check_floating(op, name, *t, /*float64=*/true);
    v4::check_dim(op, name, *t, 3);
    v4::check_same_device(op, name, *t, "q", q);
  }
  for (const auto& [name, t] : {std::pair{"g", &g}, {"beta", &beta}}) {
    v4::check_floating(op, name, *t, /*float64=*/true);
    v4::check_dim(op, name, *t, 2);
    v4::check_same_device(op, name, *t, "q", q);
  }
  const int64_t T = q.size(0), Hk = q.size(1), Dk = q.size(2), Hv = v.size(1), Dv = v.size(2);
  TORCH_CHECK_VALUE(k.sizes() == q.sizes(), op, ": k has shape ", k.sizes(), ", expected q's ", q.sizes());
  TORCH_CHECK_VALUE(v.size(0) == T && Hk >= 1 && Hv % Hk == 0, op, ": v has shape ", v.sizes(), ", expected [T=", T,
                    ", a multiple of the ", Hk, " key heads, Dv]");
  TORCH_CHECK_VALUE(g.size(0) == T && g.size(1) == Hv && beta.sizes() == g.sizes(), op, ": g and beta must be [T=", T,
                    ", Hv=", Hv, "], got ", g.sizes(), " and ", beta.sizes());
  const auto docs = v4::documents(op, cu_seqlens, T);
  const auto compute = v4::compute_dtype(q.scalar_type());
  const auto longs = q.options().dtype(at::kLong);

  // Chunks in scan order: chunk position 0 of every document, then position 1 of those that have
  // one, ...; documents longest first, so that the documents a position reaches are a prefix.
  struct Live {
    int64_t start, end, chunks;
  };
  std::vector<Live> live;  // the non-empty documents
  for (const auto& [start, end] : docs) {
    if (end > start) live.push_back({start, end, (end - start + kChunk - 1) / kChunk});
  }
  std::stable_sort(live.begin(), live.end(), [](const Live& a, const Live& b) { return a.chunks > b.chunks; });
  const int64_t N = live.size(), positions = N ? live[0].chunks : 0;
  std::vector<int64_t> reach(positions, 0);  // documents with a chunk at each position
  for (const Live& d : live) for (int64_t c = 0; c < d.chunks; ++c) ++reach[c];
  const int64_t chunks = std::accumulate(reach.begin(), reach.end(), int64_t{0});
  std::vector<int64_t> gather(chunks * kChunk, T);  // the token of each chunk slot; T: padding
  std::vector<int64_t> scatter(T, 0);               // the slot of each token
  int64_t slot = 0;
  for (int64_t c = 0; c < positions; ++c) {
    for (int64_t i = 0; i < reach[c]; ++i, slot += kChunk) {
      for (int64_t t = live[i].start + c * kChunk, s = 0; s < kChunk && t < live[i].end; ++s, ++t) {
        gather[slot + s] = t;
        scatter[t] = slot + s;
      }
    }
  }
  if (N == 0) {  // no tokens: an empty result that is still a function of every input
    return (v.to(compute) * 0 + (q.sum() + k.sum() + g.sum() + beta.sum()).to(compute) * 0).to(q.scalar_type());
  }
  const at::Tensor gather_idx = at::tensor(gather, longs), scatter_idx = at::tensor(scatter, longs);

  // Per token, fp32 (or fp64), key heads repeated to value heads; then into chunk slots
  // [chunks, Hv, 64, D] with zero padding (k = v = beta = g = 0: the state passes unchanged).
  const int64_t rep = Hv / Hk;
  at::Tensor qf = l2_normalised(q.to(compute).repeat_interleave(rep, 1)) * std::pow(Dk, -0.5);
  at::Tensor kf = l2_normalised(k.to(compute).repeat_interleave(rep, 1));
  const auto chunked = [&](const at::Tensor& x) {  // [T, Hv(, D)] -> [chunks, Hv, 64(, D)]
    const at::Tensor padded = at::cat({x, at::zeros_like(x.slice(0, 0, 1))}).index_select(0, gather_idx);
    const at::Tensor c = padded.view({chunks, kChunk, Hv, -1}).transpose(1, 2);
    return x.dim() == 2 ? c.squeeze(-1) : c;
  };
  const at::Tensor qc = chunked(qf), kc = chunked(kf), vc = chunked(v.to(compute));
  const at::Tensor bc = chunked(beta.to(compute)), gc = chunked(g.to(compute)).cumsum(-1);  // cumulative log decay
  const at::Tensor k_beta = kc * bc.unsqueeze(-1), v_beta = vc * bc.unsqueeze(-1);
  const at::Tensor upper = at::ones({kChunk, kChunk}, longs.dtype(at::kBool)).triu(1);
  const at::Tensor decay =
      (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(upper, -std::numeric_limits<double>::infinity()).exp();
  // The UT transform: (I + strictly lower (diag(beta) K K^T * decay)) solved once per chunk.
  const at::Tensor system = at::matmul(k_beta, kc.transpose(-1, -2)) * decay;
  const at::Tensor intra = at::matmul(qc, kc.transpose(-1, -2)) * decay;
  // u (values) and w (decayed keys) share the system: one solve over both right-hand sides.
  const at::Tensor uw = at::linalg_solve_triangular(system, at::cat({v_beta, k_beta * gc.exp().unsqueeze(-1)}, -1),
                                                    /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
  const at::Tensor u = uw.slice(-1, 0, Dv), w = uw.slice(-1, Dv);
  const at::Tensor q_in = qc * gc.exp().unsqueeze(-1);
  const at::Tensor k_out = kc * (gc.slice(-1, kChunk - 1) - gc).exp().unsqueeze(-1);
  const at::Tensor chunk_decay = gc.select(-1, kChunk - 1).exp().unsqueeze(-1).unsqueeze(-1);

  // The scan: one step per chunk position, for the documents that reach it (a prefix).
  at::Tensor state = at::zeros({N, Hv, Dk, Dv}, qc.options());
  std::vector<at::Tensor> outs;
  int64_t at_chunk = 0;
  for (int64_t c = 0; c < positions; ++c) {
    const int64_t a = reach[c], next = at_chunk + a;
    state = state.slice(0, 0, a);
    const at::Tensor v_new = u.slice(0, at_chunk, next) - at::matmul(w.slice(0, at_chunk, next), state);
    outs.push_back(at::matmul(q_in.slice(0, at_chunk, next), state) + at::matmul(intra.slice(0, at_chunk, next), v_new));
    state = state * chunk_decay.slice(0, at_chunk, next) + at::matmul(k_out.slice(0, at_chunk, next).transpose(-1, -2), v_new);
    at_chunk = next;
  }
  const at::Tensor o = at::cat(outs).transpose(1, 2).reshape({chunks * kChunk, Hv, Dv});  // slot-major
  return o.index_select(0, scatter_idx).to(q.scalar_type());
}
