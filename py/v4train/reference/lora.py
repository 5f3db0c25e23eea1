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


def linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    """x W^T (+ the LoRA update when the dict holds an adapter for `name`)."""
    y = F.linear(x, w[name])
    a_name, b_name = adapter_names(name)
    if a_name in w:
        xd = F.dropout(x, p=w.get("lora_dropout", 0.0), training=True) if w.get("lora_dropout", 0.0) else x
        y = y + F.linear(F.linear(xd, w[a_name]), w[b_name]) * w["lora_scaling"]
    return y


def expert_linear(x: torch.Tensor, w: dict, name: str, e: int) -> torch.Tensor:
    """x W_e^T for expert e of the fused tensor `name` (+ expert e's LoRA update)."""
    y = F.linear(x, w[name][e])
    a_name, b_name = name + ".lora_A", name + ".lora_B"
    if a_name in w:
        xd = F.dropout(x, p=w.get("lora_dropout", 0.0), training=True) if w.get("lora_dropout", 0.0) else x
        y = y + F.linear(F.linear(xd, w[a_name][e]), w[b_name][e]) * w["lora_scaling"]
    return y
