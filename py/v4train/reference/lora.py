"""Linear maps with optional LoRA adapters found beside their weight in a layer's tensor dict.

For a weight `X.weight` [out, in] the adapter is `X.lora_A` [r, in] and `X.lora_B` [out, r];
for a fused expert tensor `P` [E, out, in] (no `.weight`: a parameter, not a module), it is
`P_lora_A` [E, r, in] and `P_lora_B` [E, out, r]. `Lora` (the layer's scaling alpha / r and
dropout probability on the adapter's input, 0 when not training) applies to all of them:
    y = x W^T + scaling * dropout(x) A^T B^T
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class Lora(NamedTuple):
    scaling: float = 0.0
    dropout: float = 0.0


def adapter_names(weight_name: str) -> tuple[str, str]:
    """The (A, B) tensor names of the adapter of `weight_name` (see the module docstring)."""
    base = weight_name[: -len(".weight")] + "." if weight_name.endswith(".weight") else weight_name + "_"
    return base + "lora_A", base + "lora_B"


def _update(x: torch.Tensor, lora: Lora, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    x = F.dropout(x, p=lora.dropout, training=True) if lora.dropout else x
    return F.linear(F.linear(x, a), b) * lora.scaling


def linear(x: torch.Tensor, w: dict, name: str, lora: Lora) -> torch.Tensor:
    """x W^T (+ the LoRA update when the dict holds an adapter for `name`)."""
    a_name, b_name = adapter_names(name)
    y = F.linear(x, w[name])
    return y + _update(x, lora, w[a_name], w[b_name]) if a_name in w else y
