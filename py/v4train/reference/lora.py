"""Linear maps with optional LoRA adapters riding in a layer's weight dict.

For a weight `<module>.weight`, an adapter is `<module>.lora_A` [r, in] and `<module>.lora_B`
[out, r]; for fused experts `<name>` [E, out, in], `<name>.lora_A` [E, r, in] and
`<name>.lora_B` [E, out, r]. The dict's `lora_scaling` (alpha / r) and `lora_dropout` (the
dropout probability on the adapter's input; 0 when not training) apply to all of them:
    y = x W^T + scaling * dropout(x) A^T B^T
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def adapter_names(weight_name: str) -> tuple[str, str]:
    base = weight_name.removesuffix(".weight")
    return base + ".lora_A", base + ".lora_B"


def _update(x: torch.Tensor, w: dict, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    p = w.get("lora_dropout", 0.0)
    return F.linear(F.linear(F.dropout(x, p=p, training=True) if p else x, a), b) * w["lora_scaling"]


def linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    """x W^T (+ the LoRA update when the dict holds an adapter for `name`)."""
    a_name, b_name = adapter_names(name)
    y = F.linear(x, w[name])
    return y + _update(x, w, w[a_name], w[b_name]) if a_name in w else y


def expert_linear(x: torch.Tensor, w: dict, name: str, e: int) -> torch.Tensor:
    """x W_e^T for expert e of the fused tensor `name` (+ expert e's LoRA update)."""
    y = F.linear(x, w[name][e])
    return y + _update(x, w, w[name + ".lora_A"][e], w[name + ".lora_B"][e]) if name + ".lora_A" in w else y
