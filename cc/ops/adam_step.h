#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

// AdamW, in place (torch.optim.AdamW's update with decoupled weight decay): for each parameter
// p with gradient g and float32 moments m, v, at step t >= 1,
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
//   p = p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// computed in float32. With master_params (float32 copies of bf16/fp16 params, one per param),
// p is the master and params[i] receives its value rounded to the param's dtype; without, p is
// the param itself (an update below its precision is lost). Any strides; tensors whose
// elements overlap (expanded views) are refused. One call updates every tensor.
void v4_adam_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                  const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                  int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                  const std::vector<at::Tensor>& master_params);
