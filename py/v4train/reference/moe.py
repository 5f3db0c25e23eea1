"""The routed experts of a MoE block, as both families compute them (their routers and MoE ops:
models/glm5/moe.py, models/qwen3_5/moe.py)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from v4train.layer_call import ExpertParallel
from v4train.reference.lora import Linear, Lora, dense_weight, linear_map


@dataclasses.dataclass(frozen=True)
class ExpertsWeights:
    """The routed experts, fused as transformers keeps them (mlp.experts.*): gate_up_proj
    [E, 2I, H] (gate rows first, then up), down_proj [E, H, I], each with its per-expert LoRA."""

    gate_up_proj: Linear = linear_map("gate_up_proj")
    down_proj: Linear = linear_map("down_proj")


def experts(x: torch.Tensor, idx: torch.Tensor, rw: torch.Tensor, w: ExpertsWeights, lora: Lora,
            ep: ExpertParallel = ExpertParallel()) -> torch.Tensor:
    """sum_k rw[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = idx[t, k].

    w: the fused experts (ExpertsWeights), each with its optional per-expert LoRA; with an
    expert-parallel group `ep`, this rank's E / size of them: the rows of every expert go to the
    rank that owns it and their results come back (all-to-all, _exchanged).
    The routed rows are grouped by expert (a stable sort), one matmul pair per expert that got
    tokens; the LoRA dropout draws one mask over all routed rows per projection (the C++ op's
    order of random draws, so that both drop the same elements). x [T, H] -> [T, H] in x's dtype.
    """
    T, k = idx.shape
    if ep.size < 1 or not 0 <= ep.rank < ep.size or (ep.size > 1 and not ep.group):
        raise ValueError(f"expert_parallel {ep}: rank must lie in [0, size) and a size above 1 name its group")
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    if ep.size == 1:
        counts = torch.bincount(flat, minlength=w.gate_up_proj.weight.shape[0]).tolist()
        y = _swiglu(x[token], w, counts, lora)
    else:
        y = _exchanged(x[token], flat[order], w, lora, ep)
    y = y * rw.reshape(-1)[order][:, None]
    return torch.zeros_like(x).index_add(0, token, y.to(x.dtype))


def _swiglu(rows: torch.Tensor, w: ExpertsWeights, counts: list[int], lora: Lora) -> torch.Tensor:
    gate, up = _grouped(rows, w.gate_up_proj, counts, lora).chunk(2, dim=-1)
    return _grouped(F.silu(gate) * up, w.down_proj, counts, lora)


def _exchanged(rows: torch.Tensor, expert: torch.Tensor, w: ExpertsWeights, lora: Lora,
               ep: ExpertParallel) -> torch.Tensor:
    """The SwiGLU of rows grouped by their (global) `expert`, on the ranks that own the experts:
    each rank learns how many rows of each of its experts every rank sends, the rows travel
    (the functional collectives' all-to-all with its autograd, as the C++ op calls it; its
    gradient travels back), are grouped by local expert here, and their results return."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(ep.group)
    local = w.gate_up_proj.weight.shape[0]
    if group.rank() != ep.rank or group.size() != ep.size:
        raise ValueError(f"expert_parallel says rank {ep.rank} of {ep.size}, but this process is rank {group.rank()} "
                         f"of {group.size()} in group {ep.group!r}")
    if expert.numel() and int(expert.max()) >= local * ep.size:
        raise ValueError(f"expert_parallel size {ep.size} with {local} experts here does not hold expert "
                         f"{int(expert.max())}")
    counts = torch.bincount(expert, minlength=local * ep.size).view(ep.size, local)
    received_counts = torch.empty_like(counts)  # [source, local expert]
    dist.all_to_all_single(received_counts, counts, group=group)
    sent, received = counts.sum(1).tolist(), received_counts.sum(1).tolist()
    arrived = all_to_all_single_autograd(rows.contiguous(), received, sent, group)
    here = torch.arange(local, device=rows.device).repeat(ep.size).repeat_interleave(received_counts.reshape(-1))
    order = torch.argsort(here, stable=True)
    y = _swiglu(arrived[order], w, received_counts.sum(0).tolist(), lora)[torch.argsort(order)]
    return all_to_all_single_autograd(y.contiguous(), sent, received, group)


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
    if outs:
        return torch.cat(outs)
    # No row: an empty product, not zeros, so that rows and the weights stay in the graph (an
    # expert-parallel rank that receives no row must still run the exchange's backward).
    y = F.linear(rows, weight[0])
    return y + F.linear(F.linear(dropped, w.lora_A[0]), w.lora_B[0]) * lora.scaling if adapted else y
