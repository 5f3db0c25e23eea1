"""Linear maps with optional LoRA adapters, and the typed weights of the layer ops.

A block's weights are a dataclass whose fields name its tensors (cc/common/weights.h and each
op's header list the same fields for C++, checked by py/tests/test_config_fields.py); `bind`
fills one from a layer's tensors by their transformers names, once per layer (the decoder layer
keeps it). A linear map is a `Linear`: its weight and, beside it in the tensor dict, its adapter
(`adapter_names`, the one place that names the adapters) and, for an FP8 checkpoint's weight, its
block scales.

For a weight `X.weight` [out, in] the adapter is `X.lora_A` [r, in] and `X.lora_B` [out, r];
for a fused expert tensor `P` [E, out, in] (no `.weight`: a parameter, not a module), it is
`P_lora_A` [E, r, in] and `P_lora_B` [E, out, r]. `Lora` (the layer's scaling alpha / r and
dropout probability on the adapter's input, 0 when not training) applies to all of them:
    y = x W^T + scaling * dropout(x) A^T B^T
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, NamedTuple

import torch
import torch.nn.functional as F


class Lora(NamedTuple):
    scaling: float = 0.0
    dropout: float = 0.0


def adapter_names(weight_name: str) -> tuple[str, str]:
    """The (A, B) tensor names of the adapter of `weight_name` (see the module docstring)."""
    base = weight_name[: -len(".weight")] + "." if weight_name.endswith(".weight") else weight_name + "_"
    return base + "lora_A", base + "lora_B"


def scale_name(weight_name: str) -> str:
    """The name of an FP8 weight's block scales in a checkpoint (X.weight -> X.weight_scale_inv)."""
    return weight_name + "_scale_inv"


FP8_BLOCK = 128  # FP8 checkpoints (DeepSeek-V3, GLM-5, Qwen3.5) scale blocks of 128 x 128 weights
FP8_MAX = 448.0  # the largest float8_e4m3fn


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [..., out, in] (float8_e4m3fn in a checkpoint) with each 128 x 128 block times its
    scale, scale_inv [..., ceil(out/128), ceil(in/128)]: in fp32 (float64 for float64), then in
    `dtype`. The loader's --fp8=dequantize and the C++ ops' just-in-time FP8 path compute this."""
    out, inn = weight.shape[-2:]
    compute = torch.promote_types(dtype, torch.float32)
    s = scale_inv.to(compute).repeat_interleave(FP8_BLOCK, -2)[..., :out, :].repeat_interleave(FP8_BLOCK, -1)[..., :inn]
    return (weight.to(compute) * s).to(dtype)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 scale_inv) as FP8 checkpoints store a weight [..., out, in]:
    each 128 x 128 block scaled so that its largest magnitude is 448 (an all-zero block: scale 1)."""
    out, inn = weight.shape[-2:]
    rows, cols = -(-out // FP8_BLOCK), -(-inn // FP8_BLOCK)
    padded = weight.float().new_zeros(*weight.shape[:-2], rows * FP8_BLOCK, cols * FP8_BLOCK)
    padded[..., :out, :inn] = weight.float()
    blocks = padded.unflatten(-1, (cols, FP8_BLOCK)).unflatten(-3, (rows, FP8_BLOCK))  # [..., rows, 128, cols, 128]
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).flatten(-2).flatten(-3, -2)[..., :out, :inn]
    return q.to(torch.float8_e4m3fn), scale


@dataclasses.dataclass(frozen=True)
class Linear:
    """One linear map: weight [out, in] (a routed experts' [E, out, in]), its FP8 block scales
    where it is float8, its LoRA pair where it has an adapter."""

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor | None = None
    lora_A: torch.Tensor | None = None
    lora_B: torch.Tensor | None = None

    @staticmethod
    def bind(tensors: Mapping[str, torch.Tensor], name: str) -> "Linear":
        a, b = adapter_names(name)
        return Linear(_tensor(tensors, name), tensors.get(scale_name(name)), tensors.get(a), tensors.get(b))


def _tensor(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"weights lack the tensor {name}")
    return tensors[name]


def tensor(name: str):
    """A field holding the tensor `name` (relative to its struct's prefix)."""
    return dataclasses.field(metadata={"kind": "tensor", "name": name})


def linear_map(name: str):
    """A field holding the linear map of the weight `name`, with its adapter (a Linear)."""
    return dataclasses.field(metadata={"kind": "linear", "name": name})


def part(cls: type, prefix: str, optional: bool = False):
    """A field holding the weights `cls` of a part, its tensors under `prefix`; an optional part
    is None where the layer lacks its first tensor (a dense layer's router, say)."""
    return dataclasses.field(default=None if optional else dataclasses.MISSING,
                             metadata={"kind": "part", "cls": cls, "name": prefix, "optional": optional})


def _first_name(cls: type, prefix: str) -> str:
    first = dataclasses.fields(cls)[0]
    return prefix + first.metadata["name"] if first.metadata["kind"] != "part" else \
        _first_name(first.metadata["cls"], prefix + first.metadata["name"])


def linear_names(cls: type, prefix: str = "") -> set[str]:
    """The tensor names (under prefix) of every linear map of the weights dataclass `cls`, its
    optional parts' included: the weights that may be FP8 (the others are plain tensors, which
    take no scales)."""
    out = set()
    for f in dataclasses.fields(cls):
        name = prefix + f.metadata["name"]
        if f.metadata["kind"] == "linear":
            out.add(name)
        elif f.metadata["kind"] == "part":
            out |= linear_names(f.metadata["cls"], name)
    return out


def bind(cls: type, tensors: Mapping[str, torch.Tensor], prefix: str = ""):
    """The weights dataclass `cls` filled from tensors by their transformers names (under prefix);
    a missing tensor is a ValueError naming it."""
    values = {}
    for f in dataclasses.fields(cls):
        kind, name = f.metadata["kind"], prefix + f.metadata["name"]
        if kind == "tensor":
            values[f.name] = _tensor(tensors, name)
        elif kind == "linear":
            values[f.name] = Linear.bind(tensors, name)
        elif f.metadata["optional"] and _first_name(f.metadata["cls"], name) not in tensors:
            values[f.name] = None
        else:
            values[f.name] = bind(f.metadata["cls"], tensors, name)
    return cls(**values)


def _update(x: torch.Tensor, lora: Lora, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    x = F.dropout(x, p=lora.dropout, training=True) if lora.dropout else x
    return F.linear(F.linear(x, a), b) * lora.scaling


def dense_weight(w: Linear, dtype: torch.dtype) -> torch.Tensor:
    """w's weight as the products take it: an FP8 one dequantised (a frozen base: it takes no
    gradient, so one that asks for it is refused), else the weight itself."""
    if w.weight_scale_inv is None:
        return w.weight
    if w.weight.requires_grad or w.weight_scale_inv.requires_grad:
        raise ValueError("an FP8 weight that requires a gradient; an FP8 base is frozen (train LoRA adapters on it, "
                         "or dequantise it on load)")
    return dequantize_fp8(w.weight, w.weight_scale_inv, dtype)


def linear(x: torch.Tensor, w: Linear, lora: Lora) -> torch.Tensor:
    """x W^T (+ the LoRA update where w has an adapter), W dequantised where it is FP8."""
    y = F.linear(x, dense_weight(w, x.dtype))
    return y + _update(x, lora, w.lora_A, w.lora_B) if w.lora_A is not None else y
