// What a layer op is called with besides its input, weights and config: where the tokens sit in
// the packed batch (Batch) and how the layer runs (LayerOptions). Filled from the Python objects
// of v4train.layer_call by the casters of bridge.h; py/tests/test_config_fields.py checks that
// the two languages name the same fields.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "cc/common/config.h"

namespace v4 {

// positions [T] int64, restarting at 0 at each document; cu_seqlens [N + 1] int64 on the CPU:
// the document boundaries (attention, the convolution and the delta rule never cross them).
#define V4_BATCH_FIELDS(X)           \
  X(at::Tensor, positions, {})       \
  X(at::Tensor, cu_seqlens, {})

// LoRA's scaling (alpha / r) and the dropout probability on an adapter's input (0 when not
// training); checkpoint: keep only the layer's input and recompute the layer in the backward pass;
// checkpoint_block: the tokens of a block of its MLP or MoE (0: all at once in a plain call, as
// many as kTailBlockMiB of their activations hold in a checkpointed one; tests shrink it).
// The expert-parallel group of the MoE ops: `size` ranks of the torch.distributed group
// registered as `group` (its group_name), rank `rank` holding the E / size consecutive experts
// from rank * E / size. size 1: no group, every expert here.
#define V4_EXPERT_PARALLEL_FIELDS(X) \
  X(std::string, group, {})          \
  X(int64_t, rank, 0)                \
  X(int64_t, size, 1)

#define V4_LAYER_OPTIONS_FIELDS(X)      \
  X(double, lora_scaling, 0.0)          \
  X(double, lora_dropout, 0.0)          \
  X(bool, checkpoint, false)            \
  X(ExpertParallel, expert_parallel, {}) \
  X(int64_t, checkpoint_block, 0)

struct ExpertParallel {
  V4_EXPERT_PARALLEL_FIELDS(V4_DECLARE_FIELD)
};

struct Batch {
  V4_BATCH_FIELDS(V4_DECLARE_FIELD)
};

struct LayerOptions {
  V4_LAYER_OPTIONS_FIELDS(V4_DECLARE_FIELD)
};

}  // namespace v4
