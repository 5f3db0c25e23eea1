#pragma once

#include <ATen/core/Tensor.h>

#include "cc/common/lora.h"

// The SwiGLU MLP: down(silu(gate(x)) * up(x)) with weights gate_proj, up_proj ([I, H]) and
// down_proj ([H, I]) and their LoRA adapters. x: [T, H]; returns [T, H] in x's dtype.
at::Tensor v4_mlp(const at::Tensor& x, const v4::MlpWeights& weights, double lora_scaling, double lora_dropout);
