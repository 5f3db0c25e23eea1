#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

// The global L2 norm of all gradients (a float32 scalar on the first gradient's device); when
// max_norm > 0 the gradients are scaled in place by min(1, max_norm / (norm + 1e-6))
// (torch.nn.utils.clip_grad_norm_). With `group` (a torch.distributed group's name) the gradients
// are each rank's shards of one model's (FSDP2's, each element on one rank): the norm is that of
// all of them, sqrt of the sum over the ranks of each rank's sum of squares, every rank taking
// part (one with no gradient adds 0). copies[i] (default 1): how many ranks of the group hold the
// same grads[i] (a weight replicated over data-parallel ranks, as the experts of expert
// parallelism are): counted once.
at::Tensor v4_clip_grad_norm(const std::vector<at::Tensor>& grads, double max_norm,
                             const std::optional<std::string>& group = std::nullopt,
                             const std::optional<std::vector<int64_t>>& copies = std::nullopt);
