"""MoE: routing (GLM-5 sigmoid/grouped, Qwen3.5 softmax), the routed experts, and the GLM-5 MoE
block (v4_glm5_moe)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from v4train.reference.lora import Lora, adapter_names, linear


def route_sigmoid_grouped(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int,
                          n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float,
                          routing: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-5 / DeepSeek-V3 router (transformers' GlmMoeDsaTopkRouter).

    fp32 logits x W^T, scores = sigmoid; the correction bias is added for the choice only:
    groups are ranked by the sum of their two best biased scores, the best topk_group groups
    kept, then the top_k experts among them (given as `routing` instead, when a recomputation
    must route as the first pass did). Weights are the unbiased scores of the chosen experts,
    normalised by their sum (+1e-20) when norm_topk_prob, times `scaling`.
    x [T, H] -> (weights [T, top_k] fp32, indices [T, top_k] int64, ascending per token).
    """
    scores = F.linear(x.float(), weight.float()).sigmoid()
    if routing is None:
        with torch.no_grad():  # a choice: no gradient flows through it
            choice = scores + bias.float()
            n_exp = choice.shape[-1]
            group_scores = choice.view(-1, n_group, n_exp // n_group).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, n_exp // n_group).reshape(-1, n_exp)
            choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
            routing = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1].sort(dim=-1).values
    w = scores.gather(1, routing)
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scaling, routing


def route_softmax(x: torch.Tensor, weight: torch.Tensor, top_k: int, norm_topk_prob: bool = True,
                  routing: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5-MoE router (transformers' Qwen3_5MoeTopKRouter): softmax over x W^T (logits in x's
    dtype, softmax in fp32), top_k (or `routing` as given), renormalised when norm_topk_prob, in
    x's dtype. Returns (weights [T, top_k], indices [T, top_k] int64, by descending probability)."""
    logits = F.linear(x, weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if routing is None:
        w, idx = torch.topk(probs, top_k, dim=-1)
    else:
        w, idx = probs.gather(1, routing), routing
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype), idx


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


def v4_glm5_moe(x: torch.Tensor, weights: dict[str, torch.Tensor], prefix: str, top_k: int, n_group: int,
           topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float, lora_scaling: float = 0.0,
           lora_dropout: float = 0.0, routing: torch.Tensor | None = None, *, ops) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-5's MoE block (transformers' GlmMoeDsaMoE): the sigmoid group-limited router
    (route_sigmoid_grouped), the routed experts weighted by it, plus the shared expert
    (ops.v4_mlp with prefix + "shared_experts."), unweighted.

    x [T, H]; weights[prefix + "gate.weight"] [E, H], prefix + "gate.e_score_correction_bias" [E],
    prefix + "experts.gate_up_proj" [E, 2I, H], prefix + "experts.down_proj" [E, H, I], and the
    shared expert's. `routing` [T, top_k]: route as given (a recomputation). Returns (out [T, H]
    in x's dtype, the routing [T, top_k] int64).
    """
    lora = Lora(lora_scaling, lora_dropout)
    rw, idx = route_sigmoid_grouped(x, weights[prefix + "gate.weight"], weights[prefix + "gate.e_score_correction_bias"],
                                    top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor, routing)
    shared = ops.v4_mlp(x, weights, prefix + "shared_experts.", lora_scaling, lora_dropout)
    return experts(x, idx, rw, weights, lora, prefix + "experts.") + shared, idx


def v4_qwen3_5_moe(x: torch.Tensor, weights: dict[str, torch.Tensor], prefix: str, top_k: int, norm_topk_prob: bool = True,
                lora_scaling: float = 0.0, lora_dropout: float = 0.0, routing: torch.Tensor | None = None, *,
                ops) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5-MoE's sparse MoE block (transformers' Qwen3_5MoeSparseMoeBlock): the softmax router
    (route_softmax), the routed experts weighted by it, plus sigmoid(x . shared_expert_gate) times
    the shared expert (ops.v4_mlp with prefix + "shared_expert.").

    x [T, H]; weights[prefix + "gate.weight"] [E, H], prefix + "experts.gate_up_proj" [E, 2I, H],
    prefix + "experts.down_proj" [E, H, I], prefix + "shared_expert_gate.weight" [1, H] and the
    shared expert's. Returns (out [T, H] in x's dtype, the routing [T, top_k] int64).
    """
    lora = Lora(lora_scaling, lora_dropout)
    rw, idx = route_softmax(x, weights[prefix + "gate.weight"], top_k, norm_topk_prob, routing)
    shared = ops.v4_mlp(x, weights, prefix + "shared_expert.", lora_scaling, lora_dropout)
    gate = torch.sigmoid(F.linear(x, weights[prefix + "shared_expert_gate.weight"]))
    return experts(x, idx, rw, weights, lora, prefix + "experts.") + gate * shared, idx
