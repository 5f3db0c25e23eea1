#include "cc/ops/cross_entropy_loss.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <vector>

#include "cc/common/backend.h"
#include "cc/common/checks.h"

namespace v4 {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// With `grads` (autograd will want a gradient), the forward pass also forms the gradients, as
// Liger-Kernel's fused linear cross-entropy does: d loss / d logits = (softmax(logits) -
// onehot(target)) * valid / normalizer per chunk, cast to the model dtype, then the linear map's
// two products. The loss ends the graph, so its incoming gradient is a scalar that the backward
// pass multiplies in (nothing when it is 1, as in training; otherwise after the products, one
// rounding more than the reference's). Three [chunk, V] products a chunk instead of four (the
// backward recomputed the logits): the largest products of a step at GLM-5's and Qwen3.5's
// vocabularies. The gradients are held from the forward pass to the backward: hidden's, and the
// weight's where the LM head trains (V x H in its dtype, the size its gradient has anyway).
struct CrossEntropyLoss : public torch::autograd::Function<CrossEntropyLoss> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& targets, double normalizer, int64_t chunk, bool grads) {
    const int64_t T = hidden.size(0), chunks = (T + chunk - 1) / chunk;
    const bool want_h = grads && hidden.requires_grad(), want_w = grads && weight.requires_grad();
    std::vector<at::Tensor> sums(chunks);  // each chunk's loss, added in token order at the end
    at::Tensor grad_h = want_h ? at::empty_like(hidden) : at::Tensor(), grad_w;
    // Last chunk first: the weight gradient sums the chunks' products in the weight's dtype in the
    // order and precision in which autograd accumulates them on the reference path.
    for (int64_t i = chunks - 1; i >= 0; --i) {
      const int64_t s = i * chunk, e = std::min(T, s + chunk);
      const at::Tensor h = hidden.slice(0, s, e);
      const at::Tensor t = targets.slice(0, s, e);
      const at::Tensor logits = at::linear(h, weight);
      at::Tensor dlogits;
      ce::Rows rows{logits, t, normalizer, want_h || want_w};
      if (const auto kernel = Backend<ce::Kernel>::find(logits.device().type()); kernel != nullptr && kernel(rows)) {
        sums[i] = rows.loss.sum();
        if (!rows.grad) continue;
        dlogits = logits;  // the kernel wrote the gradient over the logits
      } else {
        const at::Tensor valid = t.ne(ce::kIgnore);
        const at::Tensor target = at::where(valid, t, 0).unsqueeze(1);
        // As F.cross_entropy: nll of log_softmax (and its NaN where a row holds an inf).
        at::Tensor ls = at::log_softmax(logits.to(at::kFloat), -1);
        // where, not a product with the mask: an ignored token's NaN or inf must not reach the sum.
        sums[i] = at::where(valid, ls.gather(1, target).squeeze(1).neg(), 0).sum();
        if (!rows.grad) continue;
        // As log_softmax's and nll_loss's backward compute it: exp(log_softmax) * g, then -g at the
        // target, with g = 1 / normalizer per valid token.
        const at::Tensor g = valid.unsqueeze(1).to(at::kFloat) / normalizer;  // [c, 1]
        at::Tensor p = ls.exp_().mul_(g);
        p.scatter_add_(1, target, g.neg());
        dlogits = p.to(hidden.scalar_type());
      }
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
    at::Tensor total = at::zeros({}, hidden.options().dtype(at::kFloat));
    for (const at::Tensor& sum : sums) total.add_(sum);
    ctx->saved_data["grad_h"] = grad_h;
    ctx->saved_data["grad_w"] = grad_w;
    return total / normalizer;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "v4_cross_entropy_loss: no second derivative (create_graph=True): "
                "the gradients are formed in the forward pass, as constants");
    // Taken out of the context: autograd then owns the only reference and can keep the weight's
    // gradient as it is (no V x H copy); a second backward through the graph finds none.
    at::Tensor grad_h = ctx->saved_data["grad_h"].toOptional<at::Tensor>().value_or(at::Tensor());
    at::Tensor grad_w = ctx->saved_data["grad_w"].toOptional<at::Tensor>().value_or(at::Tensor());
    ctx->saved_data.clear();
    TORCH_CHECK(grad_h.defined() || grad_w.defined() || !(ctx->needs_input_grad(0) || ctx->needs_input_grad(1)),
                "v4_cross_entropy_loss: a second backward through the same graph (retain_graph=True): the "
                "gradients formed in the forward pass were handed out by the first");
    // The loss's incoming gradient, a scalar (one read to the host: the forward's products are done
    // by the time it is known).
    const double scale = grads[0].item<double>();
    if (scale != 1.0) {
      if (grad_h.defined()) grad_h.mul_(scale);
      if (grad_w.defined()) grad_w.mul_(scale);
    }
    return {grad_h, grad_w, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
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
  TORCH_CHECK_VALUE(((targets == v4::ce::kIgnore) | ((targets >= 0) & (targets < V))).all().item<bool>(), op,
                    ": targets must be -100 or lie in [0, ", V, ")");
  const bool grads = at::GradMode::is_enabled() && (hidden.requires_grad() || weight.requires_grad());
  return v4::CrossEntropyLoss::apply(hidden, weight, targets, normalizer, chunk_tokens, grads);
}
