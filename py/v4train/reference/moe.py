"""The routed experts of a MoE block, as both families compute them (their routers and MoE ops:
models/glm5/moe.py, models/qwen3_5/moe.py)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from v4train.reference.lora import Linear, Lora, dense_weight, linear_map


@dataclasses.dataclass(frozen=True)
class ExpertsWeights:
    """The routed experts, fused as transformers keeps them (mlp.experts.*): gate_up_proj
    [E, 2I, H] (gate rows first, then up), down_proj [E, H, I], each with its per-expert LoRA."""

    gate_up_proj: Linear = linear_map("gate_up_proj")
    down_proj: Linear = linear_map("down_proj")


def experts(x: torch.Tensor, idx: torch.Tensor, rw: torch.Tensor, w: ExpertsWeights, lora: Lora) -> torch.Tensor:
    """sum_k rw[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = idx[t, k].

    w: the fused experts (ExpertsWeights), each with its optional per-expert LoRA.
    The routed rows are grouped by expert (a stable sort), one matmul pair per expert that got
    tokens; the LoRA dropout draws one mask over all routed rows per projection (the C++ op's
    order of random draws, so that both drop the same elements). x [T, H] -> [T, H] in x's dtype.
    """
    T, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w.gate_up_proj.weight.shape[0]).tolist()
    token = order // k
    gate, up = _grouped(x[token], w.gate_up_proj, counts, lora).chunk(2, dim=-1)
    y = _grouped(F.silu(gate) * up, w.down_proj, counts, lora) * rw.reshape(-1)[order][:, None]
    return torch.zeros_like(x).index_add(0, token, y.to(x.dtype))


def _grouped(rows: torch.Tensor, w: Linear, counts: list[int], lora: Lora) -> torch.Tensor:
    """Rows grouped by expert (counts[e] rows for expert e, in order) through expert e of the fused
    map w, with its LoRA update (dropout: one mask over all rows)."""
    adapted = w.lora_A is not None
    weight = dense_weight(w, rows.dtype)
    dropped = F.dropout(rows, p=lora.dropout, training=True) if adapted and lora.dropout else rows
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        y = F.linear(rows[start:start + n], weight[e])
        if adapted:
            y = y + F.linear(F.linear(dropped[start:start + n], w.lora_A[e]), w.lora_B[e]) * lora.scaling
        outs.append(y)
        start += n
    return torch.cat(outs) if outs else rows.new_zeros(0, weight.shape[1])
