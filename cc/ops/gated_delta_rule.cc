#include "cc/ops/gated_delta_rule.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <utility>

#include "cc/common/backend.h"
#include "cc/common/checks.h"

// Named (not anonymous) so that autograd shows the nodes as CppNode<v4::gdr::...>.
namespace v4::gdr {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

at::Tensor l2_normalised(const at::Tensor& x) { return x * at::rsqrt(x.square().sum(-1, /*keepdim=*/true) + 1e-6); }

// The recurrence of gated_delta_rule.h on the host: one step per chunk position, for the
// documents that reach it (a prefix), each step batched over them.
void recurrence_aten(Recurrence& r, const Plan& plan) {
  const int64_t positions = plan.reach.size();
  const int64_t H = r.base.size(1), Dk = r.a.size(-1), Dv = r.base.size(-1);
  at::Tensor state = at::zeros({plan.documents, H, Dk, Dv}, r.base.options());
  for (int64_t step = 0; step < positions; ++step) {
    const int64_t c = r.reverse ? positions - 1 - step : step;
    const int64_t n = plan.reach[c], from = plan.offset[c], to = from + n;
    at::Tensor s = state.slice(0, 0, n);  // a view: the updates below write `state`
    r.state_out.slice(0, from, to).copy_(s);
    at::Tensor x = r.x_out.slice(0, from, to);
    at::add_out(x, r.base.slice(0, from, to), at::matmul(r.a.slice(0, from, to), s), r.sign_a);
    s.mul_(r.decay.slice(0, from, to).view({n, H, 1, 1}));
    if (r.add.defined()) s.add_(r.add.slice(0, from, to));
    s.add_(at::matmul(r.b.slice(0, from, to).transpose(-1, -2), x), r.sign_b);
  }
}

void run(Recurrence& r, const Plan& plan) {
  r.state_out = at::empty({r.base.size(0), r.base.size(1), r.a.size(-1), r.base.size(-1)}, r.base.options());
  r.x_out = at::empty_like(r.base);
  if (r.base.size(0) > 0) recurrence_aten(r, plan);
}

Plan plan_from(const at::IValue& reach, const at::IValue& offset, const at::Tensor& chunks_of,
               const at::Tensor& offset_device, int64_t documents) {
  return {documents, reach.toIntVector(), offset.toIntVector(), chunks_of, offset_device};
}

}  // namespace

// exp(G_i - G_j) for j <= i, 0 above the diagonal: the decay between the positions of a chunk,
// from the cumulative log decay G [.., 64] in float64. Forward in the compute dtype from G split
// into two compute-dtype parts (hi + lo, so the difference keeps G's digits); backward
// accumulates dG in float64: dG_i = sum_j M_ij - sum_j M_ji with M = dD * D.
struct DecayMatrix : public torch::autograd::Function<DecayMatrix> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& G, int64_t compute) {
    const auto dtype = static_cast<at::ScalarType>(compute);
    const at::Tensor hi = G.to(dtype), lo = (G - hi.to(at::kDouble)).to(dtype);
    const at::Tensor upper = at::ones({kChunk, kChunk}, G.options().dtype(at::kBool)).triu(1);
    const at::Tensor diff = (hi.unsqueeze(-1) - hi.unsqueeze(-2)) + (lo.unsqueeze(-1) - lo.unsqueeze(-2));
    const at::Tensor decay = diff.masked_fill_(upper, -std::numeric_limits<double>::infinity()).exp_();
    ctx->save_for_backward({decay});
    return decay;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor m = grads[0] * ctx->get_saved_variables()[0];
    return {m.sum(-1, false, at::kDouble) - m.sum(-2, false, at::kDouble), at::Tensor()};
  }
};

// The recurrence across chunks as one autograd node: (u, w, k_out, chunk decay) -> (the state
// at each chunk's start h [C, H, Dk, Dv], v_new = u - w h [C, H, 64, Dv]). Its backward runs the
// recurrence in reverse on the gradients, so no per-chunk slice of any tensor is ever tracked.
struct Scan : public torch::autograd::Function<Scan> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& u, const at::Tensor& w, const at::Tensor& k_out,
                               const at::Tensor& decay, const at::Tensor& chunks_of, const at::Tensor& offset_device,
                               std::vector<int64_t> reach, std::vector<int64_t> offset) {
    const Plan plan{chunks_of.size(0), reach, offset, chunks_of, offset_device};
    Recurrence r{u, w, k_out, at::Tensor(), decay, -1.0, 1.0, false};
    run(r, plan);
    ctx->save_for_backward({w, k_out, decay, r.state_out, r.x_out, chunks_of, offset_device});
    ctx->saved_data["reach"] = std::move(reach);
    ctx->saved_data["offset"] = std::move(offset);
    return {r.state_out, r.x_out};
  }

  // With Sigma_{c+1} the gradient of the state after chunk c: dv_c = V_c + k_out_c Sigma_{c+1};
  // Sigma_c = H_c + decay_c Sigma_{c+1} - w_c^T dv_c (the reverse recurrence); then
  // du = dv, dw = -dv h^T, dk_out = v_new Sigma_{c+1}^T, d decay_c = <h_c, Sigma_{c+1}>.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &w = saved[0], &k_out = saved[1], &decay = saved[2], &h = saved[3], &v_new = saved[4];
    const Plan plan = plan_from(ctx->saved_data["reach"], ctx->saved_data["offset"], saved[5], saved[6], saved[5].size(0));
    const at::Tensor dh = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(h);
    const at::Tensor dv = grads[1].defined() ? grads[1].contiguous() : at::zeros_like(v_new);
    Recurrence r{dv, k_out, w, dh, decay, 1.0, -1.0, true};
    run(r, plan);
    const at::Tensor& next = r.state_out;  // Sigma_{c+1}
    return {r.x_out,
            -at::matmul(r.x_out, h.transpose(-1, -2)),
            at::matmul(v_new, next.transpose(-1, -2)),
            (h * next).sum({-1, -2}),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The fused path as one autograd node: the device kernels' forward and backward passes
// (gdr::Fused); it keeps the inputs, the states at each chunk's start and v_new.
struct FusedRule : public torch::autograd::Function<FusedRule> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& g, const at::Tensor& beta, const at::Tensor& slots,
                            const at::Tensor& chunks_of, const at::Tensor& offset_device, std::vector<int64_t> reach,
                            std::vector<int64_t> offset) {
    Fused f{q.contiguous(), k.contiguous(), v.contiguous(), g.to(at::kDouble).contiguous(),
            beta.to(at::kFloat).contiguous(), slots, Plan{chunks_of.size(0), reach, offset, chunks_of, offset_device}};
    Backend<FusedKernel>::find(q.device().type())(f, false);
    ctx->save_for_backward({f.q, f.k, f.v, f.g, f.beta, slots, chunks_of, offset_device, f.h, f.v_new});
    ctx->saved_data["reach"] = std::move(reach);
    ctx->saved_data["offset"] = std::move(offset);
    ctx->saved_data["g_dtype"] = static_cast<int64_t>(g.scalar_type());
    ctx->saved_data["beta_dtype"] = static_cast<int64_t>(beta.scalar_type());
    return f.o;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    Fused f{s[0], s[1], s[2], s[3], s[4], s[5],
            plan_from(ctx->saved_data["reach"], ctx->saved_data["offset"], s[6], s[7], s[6].size(0))};
    f.h = s[8];
    f.v_new = s[9];
    f.d_o = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(f.v);
    Backend<FusedKernel>::find(f.q.device().type())(f, true);
    const auto dtype = [&](const char* key) { return static_cast<at::ScalarType>(ctx->saved_data[key].toInt()); };
    return {f.dq, f.dk, f.dv, f.dg.to(dtype("g_dtype")), f.dbeta.to(dtype("beta_dtype")),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// g's largest positive value (0 where none is; NaN is not positive), for v4_gated_delta_rule's
// refusal of a growth. On CUDA it is copied to pinned memory behind an event, and read (deferred())
// after the rule's kernels are queued: read first, the host waited on the device before planning
// them (at 8K tokens the forward's wall time was 0.12 ms above its kernels' 0.57 on an H100, the
// read back and the planning before the first kernel; docs/gpu.md, forty-first entry).
class LargestGrowth {
 public:
  explicit LargestGrowth(const at::Tensor& g) {
    const at::Tensor d = g.detach();  // (no graph for a check)
    const at::Tensor largest = d.numel() == 0 ? at::zeros({}, d.options().dtype(at::kDouble))
                                              : at::where(d > 0, d, 0).amax().to(at::kDouble);
    if (!largest.is_cuda()) {
      host_ = largest;
      return;
    }
    host_ = at::empty({}, largest.options().device(at::kCPU).pinned_memory(true));
    host_.copy_(largest, /*non_blocking=*/true);
    copied_.emplace(c10::DeviceType::CUDA);
    copied_->record(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(largest.device()));
  }
  bool deferred() const { return copied_.has_value(); }
  double value() const {
    if (copied_) copied_->synchronize();
    return host_.item<double>();
  }

 private:
  at::Tensor host_;
  std::optional<c10::Event> copied_;
};

}  // namespace v4::gdr

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
  const int64_t T = q.size(0), Hk = q.size(1), Hv = v.size(1);
  TORCH_CHECK_VALUE(k.sizes() == q.sizes(), op, ": k has shape ", k.sizes(), ", expected q's ", q.sizes());
  TORCH_CHECK_VALUE(v.size(0) == T && Hk >= 1 && Hv % Hk == 0, op, ": v has shape ", v.sizes(), ", expected [T=", T,
                    ", a multiple of the ", Hk, " key heads, Dv]");
  TORCH_CHECK_VALUE(g.size(0) == T && g.size(1) == Hv && beta.sizes() == g.sizes(), op, ": g and beta must be [T=", T,
                    ", Hv=", Hv, "], got ", g.sizes(), " and ", beta.sizes());
  // A growth (g > 0) makes the chunked form take exp of sums of up to 64 of them: its result is
  // rounding noise in any precision but float64 (transformers' rule alike). One read back to the
  // host; the Gated DeltaNet block, whose g is <= 0 by construction, calls the rule without it.
  v4::gdr::LargestGrowth growth(g);
  const auto refuse_growth = [&] {
    const double largest = growth.value();
    TORCH_CHECK_VALUE(!(largest > 0), op, ": g is a log decay and must be <= 0 (Gated DeltaNet's -exp(A_log) "
                      "softplus(a + dt_bias)), got a largest value of ", largest);
  };
  if (!growth.deferred()) refuse_growth();
  at::Tensor o = v4::gdr::gated_delta_rule(q, k, v, g, beta, cu_seqlens);
  if (growth.deferred()) refuse_growth();  // (o, computed from a growth, is dropped)
  return o;
}

namespace v4::gdr {

at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, const at::Tensor& cu_seqlens) {
  constexpr const char* op = "v4_gated_delta_rule";
  const int64_t T = q.size(0), Hk = q.size(1), Dk = q.size(2), Hv = v.size(1), Dv = v.size(2);
  const auto docs = v4::documents(op, cu_seqlens, T);
  const auto compute = v4::compute_dtype(q.scalar_type());

  // Chunks in scan order (gdr::Plan): documents longest first.
  struct Live {
    int64_t start, end, chunks;
  };
  std::vector<Live> live;  // the non-empty documents
  for (const auto& [start, end] : docs) {
    if (end > start) live.push_back({start, end, (end - start + kChunk - 1) / kChunk});
  }
  if (live.empty()) {  // no tokens: an empty result that is still a function of every input
    return (v.to(compute) * 0 + (q.sum() + k.sum() + g.sum() + beta.sum()).to(compute) * 0).to(q.scalar_type());
  }
  std::stable_sort(live.begin(), live.end(), [](const Live& a, const Live& b) { return a.chunks > b.chunks; });
  const int64_t N = live.size(), positions = live[0].chunks;
  std::vector<int64_t> reach(positions, 0), offset(positions, 0), chunks_of(N);
  for (int64_t d = 0; d < N; ++d) {
    chunks_of[d] = live[d].chunks;
    for (int64_t c = 0; c < live[d].chunks; ++c) ++reach[c];
  }
  std::exclusive_scan(reach.begin(), reach.end(), offset.begin(), int64_t{0});
  const int64_t chunks = offset.back() + reach.back();
  std::vector<int64_t> gather(chunks * kChunk, T);  // the token of each chunk slot; T: padding
  std::vector<int64_t> scatter(T, 0);               // the slot of each token
  for (int64_t c = 0; c < positions; ++c) {
    for (int64_t d = 0; d < reach[c]; ++d) {
      const int64_t slot = (offset[c] + d) * kChunk;
      for (int64_t t = live[d].start + c * kChunk, s = 0; s < kChunk && t < live[d].end; ++s, ++t) {
        gather[slot + s] = t;
        scatter[t] = slot + s;
      }
    }
  }
  // The three index arrays in one upload, as views of it (an upload each was three of the forward's
  // five host-to-device copies before its first kernel): gather's slots, chunks_of, offset.
  const int64_t slots = gather.size();
  gather.insert(gather.end(), chunks_of.begin(), chunks_of.end());
  gather.insert(gather.end(), offset.begin(), offset.end());
  const at::Tensor indices = v4::upload(gather, q.device());
  const at::Tensor gather_idx = indices.narrow(0, 0, slots), chunks_of_device = indices.narrow(0, slots, N),
                   offset_device = indices.narrow(0, slots + N, positions);
  const auto dtype = q.scalar_type();
  if (Backend<FusedKernel>::find(q.device().type()) != nullptr && k.scalar_type() == dtype &&
      v.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kBFloat16) && Dk <= kFusedMaxDim &&
      Dv <= kFusedMaxDim) {
    return FusedRule::apply(q, k, v, g, beta, gather_idx, chunks_of_device, offset_device, reach, offset);
  }
  const at::Tensor scatter_idx = v4::upload(scatter, q.device());

  // Per token, in the compute dtype, key heads repeated to value heads; then into chunk slots
  // [chunks, Hv, 64, D] with zero padding (k = v = beta = g = 0: the state passes unchanged).
  const int64_t rep = Hv / Hk;
  const at::Tensor qf = l2_normalised(q.to(compute).repeat_interleave(rep, 1)) * std::pow(Dk, -0.5);
  const at::Tensor kf = l2_normalised(k.to(compute).repeat_interleave(rep, 1));
  const auto chunked = [&](const at::Tensor& x) {  // [T, Hv(, D)] -> [chunks, Hv, 64(, D)]
    const at::Tensor padded = at::cat({x, at::zeros_like(x.slice(0, 0, 1))}).index_select(0, gather_idx);
    const at::Tensor c = padded.view({chunks, kChunk, Hv, -1}).transpose(1, 2);
    return x.dim() == 2 ? c.squeeze(-1) : c;
  };
  const at::Tensor qc = chunked(qf), kc = chunked(kf), vc = chunked(v.to(compute));
  const at::Tensor bc = chunked(beta.to(compute));
  const at::Tensor G = chunked(g.to(at::kDouble)).cumsum(-1);  // the cumulative log decay, float64
  const at::Tensor G_last = G.slice(-1, kChunk - 1);
  const at::Tensor decay = DecayMatrix::apply(G, static_cast<int64_t>(compute));
  const at::Tensor k_beta = kc * bc.unsqueeze(-1), v_beta = vc * bc.unsqueeze(-1);
  const at::Tensor to_chunk_start = G.exp().to(compute).unsqueeze(-1);
  // The UT transform: (I + strictly lower (diag(beta) K K^T * decay)) solved once per chunk, for
  // the values (u) and the decayed keys (w) at once.
  const at::Tensor system = at::matmul(k_beta, kc.transpose(-1, -2)) * decay;
  const at::Tensor intra = at::matmul(qc, kc.transpose(-1, -2)) * decay;
  const at::Tensor uw = at::linalg_solve_triangular(system, at::cat({v_beta, k_beta * to_chunk_start}, -1),
                                                    /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
  const at::Tensor u = uw.slice(-1, 0, Dv).contiguous(), w = uw.slice(-1, Dv).contiguous();
  const at::Tensor k_out = (kc * (G_last - G).exp().to(compute).unsqueeze(-1)).contiguous();
  const at::Tensor chunk_decay = G_last.squeeze(-1).exp().to(compute).contiguous();

  const auto scanned = Scan::apply(u, w, k_out, chunk_decay, chunks_of_device, offset_device, reach, offset);
  const at::Tensor& h = scanned[0];
  const at::Tensor& v_new = scanned[1];
  const at::Tensor o = at::matmul(qc * to_chunk_start, h) + at::matmul(intra, v_new);  // [chunks, Hv, 64, Dv]
  return o.transpose(1, 2).reshape({chunks * kChunk, Hv, Dv}).index_select(0, scatter_idx).to(q.scalar_type());
}

}  // namespace v4::gdr
