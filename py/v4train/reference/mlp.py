"""The SwiGLU MLP: GLM-5's dense layers and shared expert, Qwen3.5's dense MLP and shared expert."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from v4train.reference.lora import Linear, Lora, linear, linear_map


@dataclasses.dataclass(frozen=True)
class MlpWeights:
    """gate_proj and up_proj [I, H], down_proj [H, I] (transformers' *.{gate,up,down}_proj.weight)."""

    gate_proj: Linear = linear_map("gate_proj.weight")
    up_proj: Linear = linear_map("up_proj.weight")
    down_proj: Linear = linear_map("down_proj.weight")


def v4_mlp(x: torch.Tensor, weights: MlpWeights, lora_scaling: float = 0.0, lora_dropout: float = 0.0) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) (transformers' GlmMoeDsaMLP / Qwen3_5MoeMLP).

    x [T, H]; weights: the three maps, each with its optional LoRA adapter
    (v4train.reference.lora). Returns [T, H] in x's dtype.
    """
    lora = Lora(lora_scaling, lora_dropout)
    h = F.silu(linear(x, weights.gate_proj, lora)) * linear(x, weights.up_proj, lora)
    return linear(h, weights.down_proj, lora)
