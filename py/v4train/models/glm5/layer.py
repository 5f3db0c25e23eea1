"""One GLM-5 decoder layer (transformers' GlmMoeDsaDecoderLayer), for training: no KV cache."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.checkpoint import checkpoint as recompute

from v4train.layer_call import Batch, LayerOptions
from v4train.models.glm5.attention import MlaWeights
from v4train.models.glm5.moe import Glm5MoeWeights
from v4train.reference.lora import part, tensor
from v4train.reference.mlp import MlpWeights


@dataclasses.dataclass(frozen=True)
class Glm5LayerWeights:
    """A GLM-5 decoder layer's weights (its tensors by their transformers names, bound by
    v4train.reference.lora.bind): its two norms [H], the attention, and the dense MLP (mlp) or the
    MoE block (moe), as the config's mlp_layer_types say."""

    input_layernorm: torch.Tensor = tensor("input_layernorm.weight")
    post_attention_layernorm: torch.Tensor = tensor("post_attention_layernorm.weight")
    self_attn: MlaWeights = part(MlaWeights, "self_attn.")
    mlp: MlpWeights | None = part(MlpWeights, "mlp.", optional=True)
    moe: Glm5MoeWeights | None = part(Glm5MoeWeights, "mlp.", optional=True)


def v4_glm5_layer_forward(hidden: torch.Tensor, weights: Glm5LayerWeights, cfg, layer: int, batch: Batch,
                          options: LayerOptions, carry: torch.Tensor | None = None, *,
                          ops) -> tuple[torch.Tensor, torch.Tensor]:
    """One GLM-5 decoder layer over packed tokens.

    hidden [T, H]: the tokens of all documents back to back; batch: their positions (restarting
    at each document) and cu_seqlens, the document boundaries (attention never crosses them).
    weights: Glm5LayerWeights, experts fused as mlp.experts.gate_up_proj [E, 2I, H] and
    mlp.experts.down_proj [E, H, I], with LoRA adapters on the linear maps they adapt
    (v4train.reference.lora), scaled by options.lora_scaling, their input dropped with
    probability options.lora_dropout.
    carry: the DSA selection of the last 'full' indexer layer, for 'shared' layers.
    options.checkpoint: keep only the layer's input for backward and recompute the layer there;
    the recomputation routes the MoE and selects the DSA keys as the first pass did.
    ops: the OpTable the building blocks are called through.
    Returns (hidden [T, H], this layer's DSA selection [T, index_topk]: the next layer's carry).

    x = x + v4_mla_dsa_attention(RMSNorm(x)); x = x + v4_mlp or v4_glm5_moe(RMSNorm(x)).
    """
    w, eps = weights, cfg.rms_norm_eps
    positions, cu_seqlens = batch.positions, batch.cu_seqlens
    lora_scaling, lora_dropout = options.lora_scaling, options.lora_dropout
    first = {}  # the first pass's selection and routing, which a recomputation reuses

    def forward(hidden):
        given = carry if cfg.indexer_types[layer] == "shared" else first.get("selection")
        attn, selection = ops.v4_mla_dsa_attention(ops.v4_rms_norm(hidden, w.input_layernorm, eps), w.self_attn, cfg,
                                                   layer, positions, cu_seqlens, given, lora_scaling, lora_dropout)
        hidden = hidden + attn
        h = ops.v4_rms_norm(hidden, w.post_attention_layernorm, eps)
        if cfg.mlp_layer_types[layer] == "dense":
            out = ops.v4_mlp(h, w.mlp, lora_scaling, lora_dropout)
        else:
            out, first["routing"] = ops.v4_glm5_moe(
                x=h, weights=w.moe, top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
                topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                routed_scaling_factor=cfg.routed_scaling_factor, lora_scaling=lora_scaling,
                lora_dropout=lora_dropout, routing=first.get("routing"), expert_parallel=options.expert_parallel)
        first["selection"] = selection
        return hidden + out, selection

    if options.checkpoint and torch.is_grad_enabled():
        return recompute(forward, hidden, use_reentrant=False)
    return forward(hidden)
