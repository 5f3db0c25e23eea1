"""The routed experts of a MoE block, as both families compute them (their routers and MoE ops:
models/glm5/moe.py, models/qwen3_5/moe.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from v4train.reference.lora import Lora, adapter_names, linear


def experts(x: torch.Tensor, idx: torch.Tensor, rw: torch.Tensor, w: dict, lora: Lora,
            prefix: str = "mlp.experts.") -> torch.Tensor:
    """sum_k rw[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = idx[t, k].

    w[prefix + "gate_up_proj"] [E, 2I, H] (gate rows first, then up: transformers' fused
    layout), w[prefix + "down_proj"] [E, H, I], each with its optional per-expert LoRA.
    The routed rows are grouped by expert (a stable sort), one matmul pair per expert that got
    tokens; the LoRA dropout draws one mask over all routed rows per projection (the C++ op's
    order of random draws, so that both drop the same elements). x [T, H] -> [T, H] in x's dtype.
    """
    T, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w[prefix + "gate_up_proj"].shape[0]).tolist()
    token = order // k
    gate, up = _grouped(x[token], w, prefix + "gate_up_proj", counts, lora).chunk(2, dim=-1)
    y = _grouped(F.silu(gate) * up, w, prefix + "down_proj", counts, lora) * rw.reshape(-1)[order][:, None]
    return torch.zeros_like(x).index_add(0, token, y.to(x.dtype))


def _grouped(rows: torch.Tensor, w: dict, name: str, counts: list[int], lora: Lora) -> torch.Tensor:
    """Rows grouped by expert (counts[e] rows for expert e, in order) through expert e of the fused
    tensor `name`, with its LoRA update (dropout: one mask over all rows)."""
    a_name, b_name = adapter_names(name)
    adapted = a_name in w
    dropped = F.dropout(rows, p=lora.dropout, training=True) if adapted and lora.dropout else rows
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        y = F.linear(rows[start:start + n], w[name][e])
        if adapted:
            y = y + F.linear(F.linear(dropped[start:start + n], w[a_name][e]), w[b_name][e]) * lora.scaling
        outs.append(y)
        start += n
    return torch.cat(outs) if outs else rows.new_zeros(0, w[name].shape[1])
