"""One GLM-5 decoder layer (transformers' GlmMoeDsaDecoderLayer), for training: no KV cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from v4train.reference import rope as rope_ref
from v4train.reference.attention import causal_attention, documents
from v4train.reference.lora import Lora, linear
from v4train.reference.moe import experts, route_sigmoid_grouped, swiglu_mlp

# transformers builds q_a_layernorm, kv_a_layernorm and the indexer's k_norm with eps 1e-6,
# whatever rms_norm_eps says.
_LATENT_EPS = 1e-6


def _indexer_topk(h, q_resid, w, cfg, cos, sin, docs) -> torch.Tensor:
    """DSA indexer: per query, the top index_topk keys of its document (transformers' GlmMoeDsaIndexer).

    q = wq_b(q_resid), k = LayerNorm(wk(h)), interleaved RoPE on the first rope dims of both;
    score[s, t] = sum_h weights_proj(h)[s, h] * n_heads^-0.5 * relu(q[s, h] . k[t] * head_dim^-0.5),
    causal. Returns [T, index_topk] int64 key positions local to each document, -1 where a
    document has fewer keys than index_topk. Runs without gradient, as in transformers.
    """
    T = h.shape[0]
    n, d, r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q = F.linear(q_resid, w["self_attn.indexer.wq_b.weight"]).view(T, n, d)
    q = torch.cat([rope_ref.apply_interleaved(q[..., :r], cos, sin), q[..., r:]], dim=-1)
    k = F.layer_norm(F.linear(h, w["self_attn.indexer.wk.weight"]), (d,), w["self_attn.indexer.k_norm.weight"], w["self_attn.indexer.k_norm.bias"], _LATENT_EPS)
    k = torch.cat([rope_ref.apply_interleaved(k[:, None, :r], cos, sin)[:, 0], k[:, r:]], dim=-1)
    head_weights = F.linear(h.to(w["self_attn.indexer.weights_proj.weight"].dtype), w["self_attn.indexer.weights_proj.weight"]).float() * n**-0.5
    out = torch.full((T, cfg.index_topk), -1, dtype=torch.int64, device=h.device)
    for start, end in docs:
        L = end - start
        scores = torch.relu(torch.matmul(q[start:end].float(), k[start:end].float().T) * d**-0.5)  # [L, n, L]
        index_scores = torch.matmul(head_weights[start:end].unsqueeze(-2), scores).squeeze(-2)  # [L, L]
        causal = torch.ones(L, L, dtype=torch.bool, device=h.device).tril()
        index_scores = index_scores.masked_fill(~causal, float("-inf"))
        kk = min(cfg.index_topk, L)
        out[start:end, :kk] = index_scores.topk(kk, dim=-1).indices
    return out


def _attention(h, w, cfg, layer, positions, docs, prev_topk, lora, ops):
    """MLA with DSA (transformers' GlmMoeDsaAttention). Returns (output [T, H], topk)."""
    T = h.shape[0]
    nh, nope, r, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q_resid = ops.v4_rms_norm(linear(h, w, "self_attn.q_a_proj.weight", lora), w["self_attn.q_a_layernorm.weight"],
                              _LATENT_EPS)
    q = linear(q_resid, w, "self_attn.q_b_proj.weight", lora).view(T, nh, nope + r)
    kv_a = linear(h, w, "self_attn.kv_a_proj_with_mqa.weight", lora)
    k_pass = ops.v4_rms_norm(kv_a[:, : cfg.kv_lora_rank], w["self_attn.kv_a_layernorm.weight"], _LATENT_EPS)
    cos, sin = rope_ref.cos_sin(cfg.rope, positions, h.dtype)
    q = torch.cat([q[..., :nope], rope_ref.apply_interleaved(q[..., nope:], cos, sin)], dim=-1)
    k_rot = rope_ref.apply_interleaved(kv_a[:, None, cfg.kv_lora_rank:], cos, sin)  # [T, 1, r]
    kv = linear(k_pass, w, "self_attn.kv_b_proj.weight", lora).view(T, nh, nope + dv)
    k = torch.cat([kv[..., :nope], k_rot.expand(T, nh, r)], dim=-1)
    v = kv[..., nope:]

    if cfg.indexer_types[layer] == "full":
        with torch.no_grad():
            topk = _indexer_topk(h, q_resid, w, cfg, cos, sin, docs)
    elif prev_topk is None:
        raise ValueError(f"GLM-5 layer {layer} is a 'shared' indexer layer but no earlier layer's top-k was given")
    else:
        topk = prev_topk

    scale = (nope + r) ** -0.5 * rope_ref.softmax_scale_factor(cfg.rope)
    outs = []
    for start, end in docs:
        L = end - start
        sel = topk[start:end]
        allowed = torch.zeros(L, L + 1, dtype=torch.bool, device=h.device)
        allowed.scatter_(1, torch.where(sel >= 0, sel, L), True)  # -1 padding lands in the spare column
        outs.append(causal_attention(q[start:end], k[start:end], v[start:end], scale, allowed[:, :L]))
    attn = torch.cat(outs, dim=0).reshape(T, nh * dv)
    return linear(attn, w, "self_attn.o_proj.weight", lora), topk


def v4_glm5_layer_forward(hidden: torch.Tensor, weights: dict[str, torch.Tensor], cfg, layer: int,
                          positions: torch.Tensor, cu_seqlens: torch.Tensor, carry: torch.Tensor | None = None,
                          lora_scaling: float = 0.0, lora_dropout: float = 0.0, *,
                          ops) -> tuple[torch.Tensor, torch.Tensor]:
    """One GLM-5 decoder layer over packed tokens.

    hidden [T, H]: the tokens of all documents back to back; positions [T] (restarting at each
    document); cu_seqlens [N + 1] int64 document boundaries (attention never crosses them).
    weights: this layer's tensors by their transformers names (the Glm5 weight table), experts
    fused as mlp.experts.gate_up_proj [E, 2I, H] and mlp.experts.down_proj [E, H, I], with LoRA
    adapters beside the weights they adapt (v4train.reference.lora), scaled by lora_scaling,
    their input dropped with probability lora_dropout.
    carry: the DSA selection of the last 'full' indexer layer, for 'shared' layers.
    ops: the OpTable the building blocks (v4_rms_norm, ...) are called through.
    Returns (hidden [T, H], this layer's top-k selection [T, index_topk]: the next layer's carry).

    x = x + MLA_DSA(RMSNorm(x)); x = x + MLP_or_MoE(RMSNorm(x)). MoE: sigmoid router with
    correction bias and group-limited top-k, routed experts times routed_scaling_factor plus
    the shared expert, unweighted.
    """
    w, eps, lora = weights, cfg.rms_norm_eps, Lora(lora_scaling, lora_dropout)
    docs = documents(cu_seqlens)
    attn, topk = _attention(ops.v4_rms_norm(hidden, w["input_layernorm.weight"], eps), w, cfg, layer, positions, docs,
                            carry, lora, ops)
    hidden = hidden + attn
    h = ops.v4_rms_norm(hidden, w["post_attention_layernorm.weight"], eps)
    if cfg.mlp_layer_types[layer] == "dense":
        mlp = swiglu_mlp(h, w, "mlp.", lora)
    else:
        rw, idx = route_sigmoid_grouped(h, w["mlp.gate.weight"], w["mlp.gate.e_score_correction_bias"],
                                        cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                                        cfg.routed_scaling_factor)
        mlp = experts(h, idx, rw, w, lora) + swiglu_mlp(h, w, "mlp.shared_experts.", lora)
    return hidden + mlp, topk
