"""Qwen3.5-MoE's MoE block (v4_qwen3_5_moe): the softmax router, the routed experts, the gated shared expert."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from v4train.layer_call import ExpertParallel
from v4train.reference.lora import Lora, part, tensor
from v4train.reference.mlp import MlpWeights
from v4train.reference.moe import ExpertsWeights, experts


@dataclasses.dataclass(frozen=True)
class Qwen35MoeWeights:
    """Qwen3.5-MoE's MoE weights (transformers' mlp.*): the router gate [E, H], the routed
    experts, the shared expert and its gate [1, H]."""

    gate: torch.Tensor = tensor("gate.weight")
    experts: ExpertsWeights = part(ExpertsWeights, "experts.")
    shared_expert: MlpWeights = part(MlpWeights, "shared_expert.")
    shared_expert_gate: torch.Tensor = tensor("shared_expert_gate.weight")


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


def v4_qwen3_5_moe(x: torch.Tensor, weights: Qwen35MoeWeights, top_k: int, norm_topk_prob: bool = True,
                   lora_scaling: float = 0.0, lora_dropout: float = 0.0, routing: torch.Tensor | None = None,
                   expert_parallel: ExpertParallel | None = None, *, ops) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5-MoE's sparse MoE block (transformers' Qwen3_5MoeSparseMoeBlock): the softmax router
    (route_softmax), the routed experts weighted by it, plus sigmoid(x . shared_expert_gate) times
    the shared expert (ops.v4_mlp).

    x [T, H]; weights: Qwen35MoeWeights. Returns (out [T, H] in x's dtype, the routing [T, top_k]
    int64).
    """
    lora = Lora(lora_scaling, lora_dropout)
    rw, idx = route_softmax(x, weights.gate, top_k, norm_topk_prob, routing)
    shared = ops.v4_mlp(x, weights.shared_expert, lora_scaling, lora_dropout)
    gate = torch.sigmoid(F.linear(x, weights.shared_expert_gate))
    return experts(x, idx, rw, weights.experts, lora, expert_parallel or ExpertParallel()) + gate * shared, idx
