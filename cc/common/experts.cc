#include "cc/common/experts.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "cc/common/backend.h"
#include "cc/common/checks.h"
#include "cc/common/collectives.h"

namespace v4 {

Dispatch dispatch(const at::Tensor& idx, int64_t num_experts) {
  const at::Tensor flat = idx.reshape(-1);
  Dispatch d;
  d.order = at::argsort(flat, /*stable=*/true);
  d.token = at::floor_divide(d.order, idx.size(1));
  d.counts = at::bincount(flat, /*weights=*/{}, num_experts);
  d.offsets = at::cumsum(d.counts, 0).to(at::kInt);
  d.inverse = at::empty_like(d.order).scatter_(0, d.order, at::arange(d.order.size(0), d.order.options()));
  return d;
}

namespace {

// y = x[perm], whose gradient is grad[inverse]: a gather both ways (index_select's own backward
// scatters with atomics, slow in bf16 on the GPU).
struct PermuteRows : public torch::autograd::Function<PermuteRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& perm,
                            const at::Tensor& inverse) {
    ctx->save_for_backward({inverse});
    return x.index_select(0, perm);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {grads[0].index_select(0, ctx->get_saved_variables()[0]), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor dispatch_rows(const at::Tensor& x, const Dispatch& d) {
  const int64_t k = d.order.size(0) / std::max<int64_t>(x.size(0), 1);
  return PermuteRows::apply(x.unsqueeze(1).expand({x.size(0), k, x.size(1)}).reshape({-1, x.size(1)}), d.order,
                            d.inverse);
}

namespace {

// at::_grouped_mm serves bf16 on CUDA when every row is 16-byte aligned; elsewhere (the CPU, fp32,
// odd widths) the rows are laid out per expert in a padded [E, max rows, in] batch for one bmm.
bool grouped_mm_applies(const at::Tensor& x, const at::Tensor& w) {
  return x.is_cuda() && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
         x.size(1) % 8 == 0 && w.size(1) % 8 == 0;
}

}  // namespace

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& w, const Dispatch& d) {
  const int64_t E = w.size(0), out = w.size(1), rows = x.size(0);
  if (grouped_mm_applies(x, w)) return at::_grouped_mm(x.contiguous(), w.transpose(1, 2), d.offsets);
  const int64_t capacity = rows == 0 ? 0 : d.counts.max().item<int64_t>();
  // No row: an empty product, not zeros, so that x and w stay in the graph (an expert-parallel
  // rank that receives no row must still run the exchange's backward, which the others wait for).
  if (capacity == 0) return at::matmul(x, w.select(0, 0).transpose(0, 1));
  const at::Tensor expert = at::repeat_interleave(at::arange(E, d.counts.options()), d.counts);
  const at::Tensor start = d.offsets.to(at::kLong) - d.counts;
  const at::Tensor slot = expert * capacity + at::arange(rows, d.counts.options()) - start.index_select(0, expert);
  const at::Tensor padded = at::zeros({E * capacity, x.size(1)}, x.options()).index_copy(0, slot, x);
  return at::bmm(padded.view({E, capacity, x.size(1)}), w.transpose(1, 2)).view({E * capacity, out}).index_select(0, slot);
}

namespace {

at::Tensor expert_linear(const at::Tensor& x, const Linear& w, const Lora& lora, const Dispatch& d, const char* op,
                         const char* name) {
  at::Tensor y = w.weight_scale_inv ? fp8_product(x, w, &d, op, name) : grouped_linear(x, w.weight, d);
  if (!has_adapter(w, op, name)) return y;
  return y + grouped_linear(grouped_linear(adapter_input(x, lora), *w.lora_A, d), *w.lora_B, d) * lora.scaling;
}

// The device kernels as one autograd node; it keeps gate_up alone (autograd of the ATen
// expression also kept silu(gate)).
struct FusedSwiglu : public torch::autograd::Function<FusedSwiglu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate_up) {
    SwigluRows s{dense16(gate_up)};
    Backend<SwigluKernel>::find(gate_up.device().type())(s, false);
    ctx->save_for_backward({s.gate_up});
    return s.act;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "swiglu: no second derivative on the GPU (create_graph=True)");
    SwigluRows s{ctx->get_saved_variables()[0]};
    s.dact = dense16(grads[0].to(s.gate_up.scalar_type()));
    Backend<SwigluKernel>::find(s.gate_up.device().type())(s, true);
    return {s.dgate_up};
  }
};

// silu(gate) * up of gate_up = [gate | up]: by the device kernels where they take it.
at::Tensor swiglu(const at::Tensor& gate_up) {
  const auto dtype = gate_up.scalar_type();
  if (Backend<SwigluKernel>::find(gate_up.device().type()) != nullptr &&
      (dtype == at::kFloat || dtype == at::kBFloat16) && gate_up.dim() == 2 && gate_up.size(1) % 16 == 0) {
    return FusedSwiglu::apply(gate_up);
  }
  const auto parts = gate_up.chunk(2, -1);
  return at::silu(parts[0]) * parts[1];
}

}  // namespace

at::Tensor experts(const at::Tensor& x_rows, const ExpertsWeights& weights, const Lora& lora, const Dispatch& d,
                   const char* op) {
  const at::Tensor gate_up = expert_linear(x_rows, weights.gate_up_proj, lora, d, op, "gate_up_proj");
  return expert_linear(swiglu(gate_up), weights.down_proj, lora, d, op, "down_proj");
}

namespace {

// all_to_all with its gradient: the rows' gradients go back to where the rows came from.
struct AllToAllRows : public torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const std::vector<int64_t>& out_splits, const std::vector<int64_t>& in_splits,
                            const std::string& group) {
    ctx->saved_data["out_splits"] = out_splits;
    ctx->saved_data["in_splits"] = in_splits;
    ctx->saved_data["group"] = group;
    return all_to_all(x, out_splits, in_splits, group);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor dx = all_to_all(grads[0], ctx->saved_data["in_splits"].toIntVector(),
                                     ctx->saved_data["out_splits"].toIntVector(), ctx->saved_data["group"].toStringRef());
    return {dx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::vector<int64_t> host_ints(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(c.const_data_ptr<int64_t>(), c.const_data_ptr<int64_t>() + c.numel());
}

}  // namespace

at::Tensor routed_experts(const at::Tensor& x, const ExpertsWeights& weights, const Lora& lora, const Dispatch& d,
                          const ExpertParallel& ep, const char* op) {
  const at::Tensor rows = dispatch_rows(x, d);
  if (ep.size == 1) return experts(rows, weights, lora, d, op);
  // Rows are grouped by expert, so by the rank that owns it. Each rank learns how many rows of
  // each of its experts every rank sends (an all-to-all of the counts), then the rows travel.
  const int64_t local = weights.gate_up_proj.weight.size(0);
  const at::Tensor counts = d.counts.view({ep.size, local});
  const at::Tensor received_counts = all_to_all(counts, std::vector<int64_t>(ep.size, 1),
                                                std::vector<int64_t>(ep.size, 1), ep.group);  // [source, local expert]
  const std::vector<int64_t> sent = host_ints(counts.sum(1)), received = host_ints(received_counts.sum(1));
  const at::Tensor arrived = AllToAllRows::apply(rows, received, sent, ep.group);  // by source, then expert
  // Here grouped by local expert (stable: by source within an expert) for the grouped GEMMs: the
  // arrived rows dispatched as one slot each to their local expert.
  const at::Tensor expert = at::repeat_interleave(at::arange(local, counts.options()).repeat({ep.size}),
                                                  received_counts.reshape(-1), /*dim=*/0, arrived.size(0));
  const Dispatch here = dispatch(expert.unsqueeze(1), local);
  const at::Tensor y = experts(PermuteRows::apply(arrived, here.order, here.inverse), weights, lora, here, op);
  return AllToAllRows::apply(PermuteRows::apply(y, here.inverse, here.order), sent, received, ep.group);
}

namespace {

// Tokens a block of the combine takes: its float32 [tokens, k, H] temporary within kCombineBlockMiB.
constexpr int64_t kCombineBlockMiB = 256;
int64_t combine_block(int64_t k, int64_t H) {
  return std::max<int64_t>(1, (kCombineBlockMiB << 20) / (4 * std::max<int64_t>(k * H, 1)));
}

// out[t] = sum_j (w[t, j] y[t, j]) with each product in fp32 rounded to y's dtype (as the reference
// weighs), y[t, j] = y_rows[inverse[t k + j]]. Its backward gives y's gradient in y's dtype and
// routed order, dout[token[r]] w[order[r]] (fp32 products rounded once), and w's as fp32 (float64) sums over
// H of dout y, token block by token block: autograd of the same expression kept the incoming
// gradient in fp32, y's gradient in fp32 and its cast, and the products of w's gradient, each
// [T, k, H] (96 GiB at 131,072 tokens of the GLM-5 proxy by //py:plan); this keeps y_rows, and
// writes y's gradient over them.
struct Combine : public torch::autograd::Function<Combine> {
  // Whether the device kernels take these rows and weights (CombineRows in experts.h).
  static bool fused(const at::Tensor& y_rows, const at::Tensor& w) {
    const auto dtype = y_rows.scalar_type();
    const auto w_dtype = w.scalar_type();  // exact in float32, as the products are taken
    return Backend<CombineKernel>::find(y_rows.device().type()) != nullptr &&
           (dtype == at::kFloat || dtype == at::kBFloat16) &&
           (w_dtype == at::kFloat || w_dtype == at::kBFloat16 || w_dtype == at::kHalf) &&
           y_rows.size(1) % 8 == 0 && y_rows.size(1) * y_rows.element_size() <= kCombineMaxRowBytes &&
           w.size(1) <= kCombineMaxSlots;
  }

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& y_rows, const at::Tensor& w,
                            const at::Tensor& token, const at::Tensor& order, const at::Tensor& inverse) {
    if (fused(y_rows, w)) {  // the device kernels
      CombineRows c{dense16(y_rows), w.to(at::kFloat).contiguous(), inverse.contiguous()};
      Backend<CombineKernel>::find(y_rows.device().type())(c, false);
      ctx->save_for_backward({c.y_rows, c.w, token, order, c.inverse});
      ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
      return c.out;
    }
    ctx->save_for_backward({y_rows, w, token, order, inverse});
    const int64_t T = w.size(0), k = w.size(1), H = y_rows.size(1), block = combine_block(k, H);
    at::Tensor out = at::empty({T, H}, y_rows.options());
    for (int64_t t = 0; t < T; t += block) {
      const int64_t n = std::min(block, T - t);
      const at::Tensor y = y_rows.index_select(0, inverse.slice(0, t * k, (t + n) * k)).view({n, k, H});
      at::Tensor weighted = at::empty_like(y);
      at::mul_out(weighted, y, w.slice(0, t, t + n).unsqueeze(-1));  // fp32 products, rounded once
      at::Tensor rows = out.slice(0, t, t + n);
      at::sum_out(rows, weighted, 1);
    }
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor &y_rows = s[0], &w = s[1], &token = s[2], &order = s[3], &inverse = s[4];
    const at::Tensor dout = grads[0];
    if (fused(y_rows, w)) {  // y's gradient over y's rows, as below
      TORCH_CHECK(!at::GradMode::is_enabled(), "combine: no second derivative on the GPU (create_graph=True)");
      CombineRows c{y_rows, w, inverse};
      c.dout = dense16(dout.to(y_rows.scalar_type()));
      Backend<CombineKernel>::find(y_rows.device().type())(c, true);
      const auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
      return {y_rows, c.dw.to(w_dtype), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    const int64_t T = w.size(0), k = w.size(1), H = y_rows.size(1), block = combine_block(k, H);
    at::Tensor dw = at::empty_like(w);
    const auto acc = at::promote_types(y_rows.scalar_type(), at::kFloat);  // fp32, or float64
    for (int64_t t = 0; t < T; t += block) {
      const int64_t n = std::min(block, T - t);
      const at::Tensor y = y_rows.index_select(0, inverse.slice(0, t * k, (t + n) * k)).view({n, k, H});
      dw.slice(0, t, t + n).copy_((y.to(acc) * dout.slice(0, t, t + n).to(acc).unsqueeze(1)).sum(-1));
    }
    // y is done with: its gradient takes its rows (12 GiB of the GLM-5 proxy's peak at 131,072
    // tokens). Writing over a saved tensor bumps its version: a second backward through this node
    // (retain_graph) is refused by autograd, never run on the overwritten rows.
    at::Tensor dy_rows = y_rows.is_contiguous() && y_rows.scalar_type() == dout.scalar_type() ? y_rows : at::empty_like(y_rows);
    at::index_select_out(dy_rows, dout, 0, token);
    dy_rows.mul_(w.reshape(-1).index_select(0, order).unsqueeze(-1));
    return {dy_rows, dw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor combine(const at::Tensor& y_rows, const Dispatch& d, const at::Tensor& route_weights, int64_t tokens) {
  TORCH_CHECK(route_weights.size(0) == tokens && route_weights.size(1) * tokens == y_rows.size(0),
              "combine: route_weights ", route_weights.sizes(), " do not fit ", y_rows.size(0), " rows of ", tokens,
              " tokens");
  return Combine::apply(y_rows, route_weights, d.token, d.order, d.inverse);
}

void check_routing(const char* op, const at::Tensor& idx, const at::Tensor& x, int64_t top_k, int64_t E) {
  const int64_t T = x.size(0);
  TORCH_CHECK_VALUE(idx.scalar_type() == at::kLong && idx.dim() == 2 && idx.size(0) == T && idx.size(1) == top_k, op,
                    ": routing must be int64 [", T, ", ", top_k, "], got ", idx.scalar_type(), " ", idx.sizes());
  v4::check_same_device(op, "routing", idx, "x", x);
  TORCH_CHECK_VALUE(T == 0 || (idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < E), op,
                    ": routing must name experts in [0, ", E, ")");
}

void check_experts(const char* op, const ExpertsWeights& weights, const at::Tensor& x, int64_t E,
                   const ExpertParallel& ep) {
  TORCH_CHECK_VALUE(ep.size >= 1 && E % ep.size == 0, op, ": expert_parallel size ", ep.size, " does not divide the ",
                    E, " experts");
  TORCH_CHECK_VALUE(ep.rank >= 0 && ep.rank < ep.size, op, ": expert_parallel rank ", ep.rank, " is not in [0, ",
                    ep.size, ")");
  if (ep.size > 1) {
    // Rows go to the group's rank r for experts r E / size..: this rank's weights must be its own.
    TORCH_CHECK_VALUE(!ep.group.empty(), op, ": expert_parallel of size ", ep.size, " names no torch.distributed group");
    const auto group = c10d::resolve_process_group(ep.group);
    TORCH_CHECK_VALUE(group->getRank() == ep.rank && group->getSize() == ep.size, op, ": expert_parallel says rank ",
                      ep.rank, " of ", ep.size, ", but this process is rank ", group->getRank(), " of ",
                      group->getSize(), " in group '", ep.group, "'");
  }
  const int64_t here = E / ep.size;  // this rank's experts
  const at::Tensor& gate_up = weights.gate_up_proj.weight;
  const at::Tensor& down = weights.down_proj.weight;
  TORCH_CHECK_VALUE(gate_up.dim() == 3 && gate_up.size(0) == here && gate_up.size(2) == x.size(1) &&
                        gate_up.size(1) % 2 == 0,
                    op, ": experts.gate_up_proj has shape ", gate_up.sizes(), ", expected [", here, ", 2I, ", x.size(1),
                    "] (", E, " experts over ", ep.size, " rank(s))");
  TORCH_CHECK_VALUE(down.dim() == 3 && down.size(0) == here && down.size(1) == x.size(1) &&
                        down.size(2) == gate_up.size(1) / 2,
                    op, ": experts.down_proj has shape ", down.sizes(), ", expected [", here, ", ", x.size(1), ", ",
                    gate_up.size(1) / 2, "]");
}

}  // namespace v4
