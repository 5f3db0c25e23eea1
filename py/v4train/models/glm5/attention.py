"""GLM-5's attention: MLA with the DeepSeek Sparse Attention indexer (transformers'
GlmMoeDsaAttention and GlmMoeDsaIndexer), for training: no KV cache."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from v4train.reference import rope as rope_ref
from v4train.reference.attention import causal_attention, documents
from v4train.reference.lora import Linear, Lora, dense_weight, linear, linear_map, part, tensor

# transformers builds q_a_layernorm, kv_a_layernorm and the indexer's k_norm with eps 1e-6,
# whatever rms_norm_eps says.
LATENT_EPS = 1e-6
# transformers scores the indexer in fp32 (a test scores in float64 to judge a selection).
SCORE_DTYPE = torch.float32


@dataclasses.dataclass(frozen=True)
class IndexerWeights:
    """The DSA indexer's weights (transformers' self_attn.indexer.*): wq_b [n d, q_lora_rank], wk
    [d, H], the key LayerNorm's weight and bias [d], weights_proj [n, H] (fp32). Never adapted."""

    wq_b: Linear = linear_map("wq_b.weight")
    wk: Linear = linear_map("wk.weight")
    k_norm: torch.Tensor = tensor("k_norm.weight")
    k_norm_bias: torch.Tensor = tensor("k_norm.bias")
    weights_proj: Linear = linear_map("weights_proj.weight")


@dataclasses.dataclass(frozen=True)
class MlaWeights:
    """MLA's weights (transformers' self_attn.*): q_a_proj [q_lora_rank, H] and its norm, q_b_proj
    [nh (nope + rope), q_lora_rank], kv_a_proj_with_mqa [kv_lora_rank + rope, H] and the latent's
    norm, kv_b_proj [nh (nope + v), kv_lora_rank], o_proj [H, nh v]; the indexer on a 'full' layer."""

    q_a_proj: Linear = linear_map("q_a_proj.weight")
    q_a_layernorm: torch.Tensor = tensor("q_a_layernorm.weight")
    q_b_proj: Linear = linear_map("q_b_proj.weight")
    kv_a_proj_with_mqa: Linear = linear_map("kv_a_proj_with_mqa.weight")
    kv_a_layernorm: torch.Tensor = tensor("kv_a_layernorm.weight")
    kv_b_proj: Linear = linear_map("kv_b_proj.weight")
    o_proj: Linear = linear_map("o_proj.weight")
    indexer: IndexerWeights | None = part(IndexerWeights, "indexer.", optional=True)


def canonical_selection(keys: torch.Tensor, first_query: int) -> torch.Tensor:
    """Each row's selected key positions ascending, the unused slots (-1) last; rows are the
    queries from first_query on. A key after its query is unused: top-k picks one only where
    fewer than k causal keys score above the masked future's -inf (-inf or NaN scores from
    non-finite weights), and no query attends ahead of itself whatever its scores."""
    big = torch.iinfo(torch.int64).max
    query = torch.arange(first_query, first_query + len(keys), device=keys.device)[:, None]
    ordered = torch.where((keys < 0) | (keys > query), big, keys).sort(dim=-1).values
    return torch.where(ordered == big, -1, ordered)


def select_keys(h, q_resid, weights: MlaWeights, cfg, cos, sin, docs) -> torch.Tensor:
    """DSA selection: the keys each query attends to, [T, index_topk] int64 positions local to
    the query's document, ascending, -1 in unused slots (canonical_selection).

    A query with at most index_topk causal keys selects all of them. Otherwise the indexer ranks
    its causal keys and the top index_topk are kept: q = wq_b(q_resid), k = LayerNorm(wk(h)),
    interleaved RoPE on their first rope dims; score[s, t] = sum_h weights_proj(h)[s, h] *
    n_heads^-0.5 * relu(q[s, h] . k[t] * head_dim^-0.5), in fp32 (transformers' GlmMoeDsaIndexer).
    No gradient flows through the selection, as in transformers.
    """
    T, K = h.shape[0], cfg.index_topk
    n, d, r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    out = torch.full((T, K), -1, dtype=torch.int64, device=h.device)
    pos = torch.arange(K, device=h.device)
    if any(end - start > K for start, end in docs):
        if weights.indexer is None:
            raise ValueError("v4_mla_dsa_attention: a 'full' indexer layer needs weights.indexer")
        w = weights.indexer
        q = F.linear(q_resid, dense_weight(w.wq_b, q_resid.dtype)).view(T, n, d)
        q = torch.cat([rope_ref.apply_interleaved(q[..., :r], cos, sin), q[..., r:]], dim=-1)
        k = F.layer_norm(F.linear(h, dense_weight(w.wk, h.dtype)), (d,), w.k_norm, w.k_norm_bias, LATENT_EPS)
        k = torch.cat([rope_ref.apply_interleaved(k[:, None, :r], cos, sin)[:, 0], k[:, r:]], dim=-1)
        # transformers keeps weights_proj in fp32 (an FP8 one dequantises to fp32 on load)
        wp = dense_weight(w.weights_proj, torch.float32)
        head_weights = F.linear(h.to(wp.dtype), wp).to(SCORE_DTYPE) * n**-0.5
    for start, end in docs:
        L = end - start
        first = min(L, K)  # queries 0 .. K-1 have at most K causal keys: all of them
        p = torch.arange(first, device=h.device)
        out[start:start + first] = torch.where(pos[None, :] <= p[:, None], pos[None, :], -1)
        if L > K:
            scores = index_scores(q[start:end].to(SCORE_DTYPE), k[start:end].to(SCORE_DTYPE), head_weights[start:end], d)
            out[start + K:end] = canonical_selection(scores[K:].topk(K, dim=-1).indices, K)
    return out


def index_scores(q: torch.Tensor, k: torch.Tensor, head_weights: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The indexer's scores of one document [L, L] in q's dtype (SCORE_DTYPE), -inf after each query:
    sum_h head_weights[s, h] * relu(q[s, h] . k[t] * head_dim^-0.5)."""
    L = q.shape[0]
    scores = torch.relu(torch.matmul(q, k.T) * head_dim**-0.5)  # [L, n, L]
    scores = torch.matmul(head_weights.to(q.dtype).unsqueeze(-2), scores).squeeze(-2)  # [L, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, float("-inf"))


def v4_mla_dsa_attention(h: torch.Tensor, weights: MlaWeights, cfg, layer: int, positions: torch.Tensor,
                         cu_seqlens: torch.Tensor, carry: torch.Tensor | None = None, lora_scaling: float = 0.0,
                         lora_dropout: float = 0.0, masked_max_len: int = 8192, *,
                         ops) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA attention over the keys the DSA selection keeps, over packed documents.

    h [T, H] (the normed hidden states); weights: MlaWeights (self_attn.*); positions
    [T]; cu_seqlens [N + 1] document boundaries (no attention across them); carry: the selection
    of the last 'full' indexer layer, used by a 'shared' layer. Query: q_a_proj -> RMSNorm (eps
    1e-6, ops.v4_rms_norm) -> q_b_proj, per head [nope | rope]; key/value: kv_a_proj_with_mqa ->
    [latent | k_rope], RMSNorm on the latent -> kv_b_proj, per head [k_nope | v], the one k_rope
    shared by all heads; interleaved RoPE (with YaRN) on q_rope and k_rope; softmax over the
    selected causal keys with scale qk_head_dim^-0.5 (times YaRN's mscale^2); o_proj. LoRA
    adapters with the projections apply. Returns (out [T, H], the selection [T, index_topk]:
    the next layer's carry). masked_max_len picks among the C++ op's algorithms (documents up to
    it attend under a dense mask, longer ones through the latent space); the math is this.
    """
    w, lora = weights, Lora(lora_scaling, lora_dropout)
    T = h.shape[0]
    nh, nope, r, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    docs = documents(cu_seqlens)
    q_resid = ops.v4_rms_norm(linear(h, w.q_a_proj, lora), w.q_a_layernorm, LATENT_EPS)
    q = linear(q_resid, w.q_b_proj, lora).view(T, nh, nope + r)
    kv_a = linear(h, w.kv_a_proj_with_mqa, lora)
    k_pass = ops.v4_rms_norm(kv_a[:, : cfg.kv_lora_rank], w.kv_a_layernorm, LATENT_EPS)
    cos, sin = rope_ref.cos_sin(cfg.rope, positions, h.dtype)
    q = torch.cat([q[..., :nope], rope_ref.apply_interleaved(q[..., nope:], cos, sin)], dim=-1)
    k_rot = rope_ref.apply_interleaved(kv_a[:, None, cfg.kv_lora_rank:], cos, sin)  # [T, 1, r]
    kv = linear(k_pass, w.kv_b_proj, lora).view(T, nh, nope + dv)
    k = torch.cat([kv[..., :nope], k_rot.expand(T, nh, r)], dim=-1)
    v = kv[..., nope:]

    if carry is not None:
        selection = carry
    elif cfg.indexer_types[layer] == "full":
        with torch.no_grad():
            selection = select_keys(h, q_resid, w, cfg, cos, sin, docs)
    else:
        raise ValueError(f"GLM-5 layer {layer} is a 'shared' indexer layer but no earlier layer's selection was given")

    scale = (nope + r) ** -0.5 * rope_ref.softmax_scale_factor(cfg.rope)
    outs = []
    for start, end in docs:
        L = end - start
        sel = selection[start:end]
        allowed = torch.zeros(L, L + 1, dtype=torch.bool, device=h.device)
        allowed.scatter_(1, torch.where(sel >= 0, sel, L), True)  # -1 lands in the spare column
        outs.append(causal_attention(q[start:end], k[start:end], v[start:end], scale, allowed[:, :L]))
    attn = torch.cat(outs, dim=0).reshape(T, nh * dv)
    return linear(attn, w.o_proj, lora), selection
