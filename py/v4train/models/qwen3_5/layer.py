"""One Qwen3.5 / Qwen3.6 decoder layer (transformers' Qwen3_5MoeDecoderLayer and Qwen3_5DecoderLayer)."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.checkpoint import checkpoint as recompute

from v4train.layer_call import Batch, LayerOptions
from v4train.models.qwen3_5.attention import GatedAttentionWeights
from v4train.models.qwen3_5.deltanet import GatedDeltaNetWeights
from v4train.models.qwen3_5.moe import Qwen35MoeWeights
from v4train.reference.lora import part, tensor
from v4train.reference.mlp import MlpWeights


@dataclasses.dataclass(frozen=True)
class Qwen35LayerWeights:
    """A Qwen3.5 decoder layer's weights (bound by v4train.reference.lora.bind): its two norms [H];
    Gated DeltaNet (linear_attn) or gated attention (self_attn), as the config's layer_types say;
    the MoE block (moe, qwen3_5_moe) or the dense MLP (mlp, qwen3_5)."""

    input_layernorm: torch.Tensor = tensor("input_layernorm.weight")
    post_attention_layernorm: torch.Tensor = tensor("post_attention_layernorm.weight")
    linear_attn: GatedDeltaNetWeights | None = part(GatedDeltaNetWeights, "linear_attn.", optional=True)
    self_attn: GatedAttentionWeights | None = part(GatedAttentionWeights, "self_attn.", optional=True)
    mlp: MlpWeights | None = part(MlpWeights, "mlp.", optional=True)
    moe: Qwen35MoeWeights | None = part(Qwen35MoeWeights, "mlp.", optional=True)


def v4_qwen3_5_layer_forward(hidden: torch.Tensor, weights: Qwen35LayerWeights, cfg, layer: int, batch: Batch,
                             options: LayerOptions, *, ops) -> torch.Tensor:
    """One Qwen3.5 decoder layer over packed tokens (the conventions of v4_glm5_layer_forward;
    nothing is carried from layer to layer).

    x = x + Mixer(RMSNorm0(x)); x = x + MLP(RMSNorm0(x)), RMSNorm0 the zero-centred norm
    (scale 1 + w). Mixer: Gated DeltaNet on 'linear_attention' layers, gated full attention on
    'full_attention' ones. MLP: softmax top-k MoE plus sigmoid(shared_expert_gate(x)) times the
    shared expert (qwen3_5_moe), or a SwiGLU MLP (qwen3_5).
    """
    w, eps = weights, cfg.rms_norm_eps
    positions, cu_seqlens = batch.positions, batch.cu_seqlens
    lora_scaling, lora_dropout = options.lora_scaling, options.lora_dropout

    def forward(hidden):
        h = ops.v4_rms_norm(hidden, w.input_layernorm, eps, True)
        if cfg.layer_types[layer] == "linear_attention":
            hidden = hidden + ops.v4_gated_deltanet(h, w.linear_attn, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                                    cfg.linear_key_head_dim, cfg.linear_value_head_dim, eps,
                                                    cu_seqlens, lora_scaling, lora_dropout)
        else:
            hidden = hidden + ops.v4_gated_attention(h, w.self_attn, cfg.num_attention_heads, cfg.num_key_value_heads,
                                                     cfg.head_dim, cfg.rope, eps, positions, cu_seqlens,
                                                     lora_scaling, lora_dropout)
        h = ops.v4_rms_norm(hidden, w.post_attention_layernorm, eps, True)
        if not cfg.is_moe:
            return hidden + ops.v4_mlp(h, w.mlp, lora_scaling, lora_dropout)
        return hidden + ops.v4_qwen3_5_moe(x=h, weights=w.moe, top_k=cfg.num_experts_per_tok,
                                           norm_topk_prob=True, lora_scaling=lora_scaling,
                                           lora_dropout=lora_dropout, expert_parallel=options.expert_parallel)[0]

    if options.checkpoint and torch.is_grad_enabled():
        return recompute(forward, hidden, use_reentrant=False)
    return forward(hidden)
