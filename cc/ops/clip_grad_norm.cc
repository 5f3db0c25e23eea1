#include "cc/ops/clip_grad_norm.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <map>
#include <string>

#include "cc/common/checks.h"
#include "cc/common/collectives.h"

at::Tensor v4_clip_grad_norm(const std::vector<at::Tensor>& grads, double max_norm,
                             const std::optional<std::string>& group, const std::optional<std::vector<int64_t>>& copies) {
  constexpr const char* op = "v4_clip_grad_norm";
  TORCH_CHECK_VALUE(std::isfinite(max_norm) && max_norm >= 0, op, ": max_norm must be a finite number >= 0, got ",
                    max_norm);
  for (size_t i = 0; i < grads.size(); ++i) {
    v4::check_floating(op, "grads[i]", grads[i]);
    if (max_norm > 0) v4::check_writable(op, "grads", grads[i], i);
  }
  if (copies) {
    TORCH_CHECK_VALUE(group && copies->size() == grads.size(), op, ": copies needs a group and one count per gradient, "
                      "got ", copies->size(), " for ", grads.size());
    for (const int64_t c : *copies) TORCH_CHECK_VALUE(c >= 1, op, ": copies must be >= 1, got ", c);
  }
  at::NoGradGuard no_grad;
  if (grads.empty()) return group ? at::sqrt(v4::all_reduce_sum(at::zeros({}, at::kFloat), *group)) : at::zeros({}, at::kFloat);
  std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2, at::kFloat);
  for (auto& t : norms) t = t.to(grads[0].device());
  at::Tensor squares = at::stack(norms).square();
  if (copies) squares = squares / at::tensor(*copies, squares.options().dtype(at::kLong)).to(at::kFloat);
  const at::Tensor total = group ? at::sqrt(v4::all_reduce_sum(squares.sum(), *group))
                                 : at::linalg_vector_norm(at::stack(norms), 2);
  if (max_norm > 0) {
    const at::Tensor coef = at::clamp_max(max_norm / (total + 1e-6), 1.0);
    std::map<std::pair<at::ScalarType, std::string>, std::vector<at::Tensor>> groups;  // foreach wants one dtype
    for (const auto& g : grads) groups[{g.scalar_type(), g.device().str()}].push_back(g);
    for (auto& [key, group] : groups) at::_foreach_mul_(group, coef.to(group[0].device(), key.first));
  }
  return total;
}
