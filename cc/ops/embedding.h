#pragma once

#include <ATen/core/Tensor.h>

// weight[input_ids]: input_ids int64 of any shape, weight [V, H] -> [..., H] (nn.Embedding
// without padding_idx). Ids outside [0, V) are an error here, not a device-side assert later.
at::Tensor v4_embedding(const at::Tensor& input_ids, const at::Tensor& weight);
