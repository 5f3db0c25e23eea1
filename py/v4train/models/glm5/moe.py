"""GLM-5's MoE block (v4_glm5_moe): the sigmoid group-limited router and the routed and shared experts."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from v4train.layer_call import ExpertParallel
from v4train.reference.lora import Lora, part, tensor
from v4train.reference.mlp import MlpWeights
from v4train.reference.moe import ExpertsWeights, experts


@dataclasses.dataclass(frozen=True)
class Glm5MoeWeights:
    """GLM-5's MoE weights (transformers' mlp.*): the router gate [E, H] and its correction bias
    [E] (both fp32), the routed experts, the shared expert."""

    gate: torch.Tensor = tensor("gate.weight")
    e_score_correction_bias: torch.Tensor = tensor("gate.e_score_correction_bias")
    experts: ExpertsWeights = part(ExpertsWeights, "experts.")
    shared_experts: MlpWeights = part(MlpWeights, "shared_experts.")


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


def v4_glm5_moe(x: torch.Tensor, weights: Glm5MoeWeights, top_k: int, n_group: int, topk_group: int,
                norm_topk_prob: bool, routed_scaling_factor: float, lora_scaling: float = 0.0, lora_dropout: float = 0.0,
                routing: torch.Tensor | None = None, expert_parallel: ExpertParallel | None = None, *,
                ops) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-5's MoE block (transformers' GlmMoeDsaMoE): the sigmoid group-limited router
    (route_sigmoid_grouped), the routed experts weighted by it, plus the shared expert
    (ops.v4_mlp), unweighted.

    x [T, H]; weights: Glm5MoeWeights (with `expert_parallel`, this rank's experts of them; the
    routed rows go to the ranks that own their experts). `routing` [T, top_k]: route as given (a
    recomputation).
    Returns (out [T, H] in x's dtype, the routing [T, top_k] int64).
    """
    lora = Lora(lora_scaling, lora_dropout)
    rw, idx = route_sigmoid_grouped(x, weights.gate, weights.e_score_correction_bias, top_k, n_group, topk_group,
                                    norm_topk_prob, routed_scaling_factor, routing)
    shared = ops.v4_mlp(x, weights.shared_experts, lora_scaling, lora_dropout)
    return experts(x, idx, rw, weights.experts, lora, expert_parallel or ExpertParallel()) + shared, idx
