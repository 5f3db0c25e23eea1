#include "cc/ops/cross_entropy_loss.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>

#include "cc/common/checks.h"

namespace v4 {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kIgnore = -100;

struct CrossEntropyLoss : public torch::autograd::Function<CrossEntropyLoss> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& targets, double normalizer, int64_t chunk) {
    const int64_t T = hidden.size(0);
    at::Tensor total = at::zeros({}, hidden.options().dtype(at::kFloat));
    for (int64_t s = 0; s < T; s += chunk) {
      const int64_t e = std::min(T, s + chunk);
      const at::Tensor logits = at::linear(hidden.slice(0, s, e), weight).to(at::kFloat);
      const at::Tensor t = targets.slice(0, s, e);
      const at::Tensor valid = t.ne(kIgnore);
      const at::Tensor chunk_lse = at::logsumexp(logits, -1);
      const at::Tensor picked = logits.gather(1, at::where(valid, t, 0).unsqueeze(1)).squeeze(1);
      // where, not a product with the mask: an ignored token's NaN or inf must not reach the sum.
      total.add_(at::where(valid, chunk_lse - picked, 0).sum());
    }
    ctx->save_for_backward({hidden, weight, targets});
    ctx->saved_data["normalizer"] = normalizer;
    ctx->saved_data["chunk"] = chunk;
    return total / normalizer;
  }

  // d loss / d logits = (softmax(logits) - onehot(target)) * valid * g / normalizer, cast to the
  // model dtype, then the two matmuls of the linear map, chunk by chunk. The weight gradient sums
  // the chunks' products in the weight's dtype, last chunk first: the order and precision in which
  // autograd accumulates them on the reference path, so that both round alike.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& hidden = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& targets = saved[2];
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const at::Tensor scale = grads[0].to(at::kFloat) / ctx->saved_data["normalizer"].toDouble();
    const bool want_h = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    const int64_t T = hidden.size(0);
    at::Tensor grad_h = want_h ? at::empty_like(hidden) : at::Tensor();
    at::Tensor grad_w;
    for (int64_t s = (T - 1) / chunk * chunk; s >= 0; s -= chunk) {
      const int64_t e = std::min(T, s + chunk);
      const at::Tensor h = hidden.slice(0, s, e);
      const at::Tensor t = targets.slice(0, s, e);
      const at::Tensor valid = t.ne(kIgnore);
      // As log_softmax's and nll_loss's backward compute it: exp(log_softmax) * g', then -g' at the
      // target, with g' the incoming gradient per valid token.
      const at::Tensor g = valid.unsqueeze(1).to(at::kFloat) * scale;  // [c, 1]
      at::Tensor p = at::log_softmax(at::linear(h, weight).to(at::kFloat), -1).exp_().mul_(g);
      p.scatter_add_(1, at::where(valid, t, 0).unsqueeze(1), g.neg());
      const at::Tensor dlogits = p.to(hidden.scalar_type());
      if (want_h) grad_h.slice(0, s, e).copy_(at::matmul(dlogits, weight));
      if (want_w) {
        const at::Tensor part = at::matmul(dlogits.t(), h);
        if (grad_w.defined()) {
          grad_w.add_(part);  // rounds as grad_w + part does, without a second weight-sized buffer
        } else {
          grad_w = part;
        }
      }
    }
    if (want_w && !grad_w.defined()) grad_w = at::zeros_like(weight);  // no tokens
    return {grad_h, grad_w, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace v4

at::Tensor v4_cross_entropy_loss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                 double normalizer, int64_t chunk_tokens) {
  constexpr const char* op = "v4_cross_entropy_loss";
  v4::check_floating(op, "hidden", hidden);
  v4::check_dim(op, "hidden", hidden, 2);
  v4::check_floating(op, "weight", weight);
  v4::check_dim(op, "weight", weight, 2);
  v4::check_size(op, "weight", weight, 1, hidden.size(1), "hidden.size(1)");
  TORCH_CHECK_VALUE(weight.scalar_type() == hidden.scalar_type(), op, ": weight is ", weight.scalar_type(),
                    " but hidden is ", hidden.scalar_type());
  TORCH_CHECK_VALUE(targets.defined() && targets.scalar_type() == at::kLong, op, ": targets must be int64");
  v4::check_dim(op, "targets", targets, 1);
  v4::check_size(op, "targets", targets, 0, hidden.size(0), "hidden.size(0)");
  v4::check_same_device(op, "weight", weight, "hidden", hidden);
  v4::check_same_device(op, "targets", targets, "hidden", hidden);
  TORCH_CHECK_VALUE(std::isfinite(normalizer) && normalizer > 0, op, ": normalizer must be a finite number > 0, got ",
                    normalizer);
  TORCH_CHECK_VALUE(chunk_tokens > 0, op, ": chunk_tokens must be > 0, got ", chunk_tokens);
  const int64_t V = weight.size(0);
  TORCH_CHECK_VALUE(V > 0, op, ": weight.size(0) (the vocabulary) must be > 0, got shape ", weight.sizes());
  TORCH_CHECK_VALUE(((targets == v4::kIgnore) | ((targets >= 0) & (targets < V))).all().item<bool>(), op,
                    ": targets must be -100 or lie in [0, ", V, ")");
  return v4::CrossEntropyLoss::apply(hidden, weight, targets, normalizer, chunk_tokens);
}
