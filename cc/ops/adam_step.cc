#include "cc/ops/adam_step.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>

#include "cc/common/checks.h"

namespace {

void check_same_size(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                     const at::Tensor& ref, size_t i) {
  TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), op, ": ", name, "[", i, "] has shape ", t.sizes(), " but ",
                    ref_name, "[", i, "] has shape ", ref.sizes());
  v4::check_same_device(op, name, t, ref_name, ref);
}

}  // namespace

void v4_adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                  const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                  int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay) {
  constexpr const char* op = "v4_adam_step";
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n, op,
                    ": params, grads, exp_avgs and exp_avg_sqs must be lists of one length, got ", n, ", ",
                    grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size());
  TORCH_CHECK_VALUE(step >= 1, op, ": step must be >= 1, got ", step);
  TORCH_CHECK_VALUE(lr >= 0 && eps > 0 && weight_decay >= 0, op,
                    ": lr and weight_decay must be >= 0 and eps > 0, got lr=", lr, ", eps=", eps,
                    ", weight_decay=", weight_decay);
  TORCH_CHECK_VALUE(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, op,
                    ": betas must lie in [0, 1), got ", beta1, ", ", beta2);
  for (size_t i = 0; i < n; ++i) {
    v4::check_floating(op, "params[i]", params[i]);
    v4::check_floating(op, "grads[i]", grads[i]);
    check_same_size(op, "grads", grads[i], "params", params[i], i);
    check_same_size(op, "exp_avgs", exp_avgs[i], "params", params[i], i);
    check_same_size(op, "exp_avg_sqs", exp_avg_sqs[i], "params", params[i], i);
    TORCH_CHECK_VALUE(exp_avgs[i].scalar_type() == at::kFloat && exp_avg_sqs[i].scalar_type() == at::kFloat, op,
                      ": exp_avgs[", i, "] and exp_avg_sqs[", i, "] must be float32");
  }
  if (n == 0) return;
  at::NoGradGuard no_grad;
  bool all_fp32 = true;
  for (size_t i = 0; i < n; ++i) {
    all_fp32 = all_fp32 && params[i].scalar_type() == at::kFloat && grads[i].scalar_type() == at::kFloat &&
               params[i].device() == params[0].device();
  }
  if (all_fp32) {  // one fused kernel (ATen's own AdamW), which reads each tensor once
    std::vector<at::Tensor> steps(n, at::full({}, static_cast<double>(step), params[0].options()));
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr, beta1, beta2,
                      weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false);
    return;
  }
  const double bc1 = 1 - std::pow(beta1, step), bc2 = 1 - std::pow(beta2, step);
  // Mixed precision (bf16 params, fp32 moments): multi-tensor ops in fp32, then written back.
  std::vector<at::Tensor> g(n), p(n);
  for (size_t i = 0; i < n; ++i) {
    g[i] = grads[i].to(at::kFloat);
    p[i] = params[i].to(at::kFloat);  // the parameter itself when it is float32
  }
  std::vector<at::Tensor> m(exp_avgs), v(exp_avg_sqs);
  at::_foreach_mul_(m, beta1);
  at::_foreach_add_(m, g, 1 - beta1);
  at::_foreach_mul_(v, beta2);
  at::_foreach_addcmul_(v, g, g, 1 - beta2);
  at::_foreach_mul_(p, 1 - lr * weight_decay);
  std::vector<at::Tensor> denom = at::_foreach_sqrt(v);
  at::_foreach_div_(denom, std::sqrt(bc2));
  at::_foreach_add_(denom, eps);
  at::_foreach_addcdiv_(p, m, denom, -lr / bc1);
  for (size_t i = 0; i < n; ++i) {
    if (!p[i].is_same(params[i])) params[i].copy_(p[i]);
  }
}
