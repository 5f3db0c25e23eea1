#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "cc/common/lora.h"

// The SwiGLU MLP: down(silu(gate(x)) * up(x)) with weights[prefix + "{gate,up,down}_proj.weight"]
// ([I, H], [I, H], [H, I]) and their LoRA adapters. x: [T, H]; returns [T, H] in x's dtype.
at::Tensor v4_mlp(const at::Tensor& x, const v4::Weights& weights, const std::string& prefix, double lora_scaling,
                  double lora_dropout);
