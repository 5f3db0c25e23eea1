// What a layer op is called with besides its input, weights and config: where the tokens sit in
// the packed batch (Batch) and how the layer runs (LayerOptions). Filled from the Python objects
// of v4train.layer_call by the casters of bridge.h; py/tests/test_config_fields.py checks that
// the two languages name the same fields.
#pragma once

#include <ATen/core/Tensor.h>

#include "cc/common/config.h"

namespace v4 {

// positions [T] int64, restarting at 0 at each document; cu_seqlens [N + 1] int64 on the CPU:
// the document boundaries (attention, the convolution and the delta rule never cross them).
#define V4_BATCH_FIELDS(X)           \
  X(at::Tensor, positions, {})       \
  X(at::Tensor, cu_seqlens, {})

// LoRA's scaling (alpha / r) and the dropout probability on an adapter's input (0 when not
// training); checkpoint: keep only the layer's input and recompute the layer in the backward pass.
#define V4_LAYER_OPTIONS_FIELDS(X) \
  X(double, lora_scaling, 0.0)     \
  X(double, lora_dropout, 0.0)     \
  X(bool, checkpoint, false)

struct Batch {
  V4_BATCH_FIELDS(V4_DECLARE_FIELD)
};

struct LayerOptions {
  V4_LAYER_OPTIONS_FIELDS(V4_DECLARE_FIELD)
};

}  // namespace v4
