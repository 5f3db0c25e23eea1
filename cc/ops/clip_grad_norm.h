#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

// The global L2 norm of all gradients (a float32 scalar on the first gradient's device); when
// max_norm > 0 the gradients are scaled in place by min(1, max_norm / (norm + 1e-6))
// (torch.nn.utils.clip_grad_norm_).
at::Tensor v4_clip_grad_norm(const std::vector<at::Tensor>& grads, double max_norm);
