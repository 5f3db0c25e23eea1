"""The SwiGLU MLP: GLM-5's dense layers and shared expert, Qwen3.5's dense MLP and shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from v4train.reference.lora import Lora, linear


def v4_mlp(x: torch.Tensor, weights: dict[str, torch.Tensor], prefix: str, lora_scaling: float = 0.0,
           lora_dropout: float = 0.0) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) (transformers' GlmMoeDsaMLP / Qwen3_5MoeMLP).

    x [T, H]; weights[prefix + "{gate,up,down}_proj.weight"] ([I, H], [I, H], [H, I]), each with
    its optional LoRA adapter beside it (v4train.reference.lora). Returns [T, H] in x's dtype.
    """
    lora = Lora(lora_scaling, lora_dropout)
    h = F.silu(linear(x, weights, prefix + "gate_proj.weight", lora)) * linear(x, weights, prefix + "up_proj.weight", lora)
    return linear(h, weights, prefix + "down_proj.weight", lora)
