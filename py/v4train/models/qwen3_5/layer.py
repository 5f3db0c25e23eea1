"""One Qwen3.5 / Qwen3.6 decoder layer (transformers' Qwen3_5MoeDecoderLayer and Qwen3_5DecoderLayer)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint as recompute

from v4train.layer_call import Batch, LayerOptions


def v4_qwen3_5_layer_forward(hidden: torch.Tensor, weights: dict[str, torch.Tensor], cfg, layer: int, batch: Batch,
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
        h = ops.v4_rms_norm(hidden, w["input_layernorm.weight"], eps, True)
        if cfg.layer_types[layer] == "linear_attention":
            hidden = hidden + ops.v4_gated_deltanet(h, w, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                                    cfg.linear_key_head_dim, cfg.linear_value_head_dim, eps,
                                                    cu_seqlens, lora_scaling, lora_dropout)
        else:
            hidden = hidden + ops.v4_gated_attention(h, w, cfg.num_attention_heads, cfg.num_key_value_heads,
                                                     cfg.head_dim, cfg.rope, eps, positions, cu_seqlens,
                                                     lora_scaling, lora_dropout)
        h = ops.v4_rms_norm(hidden, w["post_attention_layernorm.weight"], eps, True)
        if not cfg.is_moe:
            return hidden + ops.v4_mlp(h, w, "mlp.", lora_scaling, lora_dropout)
        return hidden + ops.v4_qwen3_5_moe(x=h, weights=w, prefix="mlp.", top_k=cfg.num_experts_per_tok,
                                           norm_topk_prob=True, lora_scaling=lora_scaling,
                                           lora_dropout=lora_dropout)[0]

    if options.checkpoint and torch.is_grad_enabled():
        return recompute(forward, hidden, use_reentrant=False)
    return forward(hidden)
