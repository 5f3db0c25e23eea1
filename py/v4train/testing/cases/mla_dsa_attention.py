"""v4_mla_dsa_attention: GLM-5's MLA attention over the keys the DSA indexer selects."""

import functools

import torch

from v4train.models import config_from_dict
from v4train.ops import OPS
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import RandomDraw, Sample, layout, make_leaf, seed, size, view_as_layout, weight_leaves, width
from v4train.models.glm5.attention import MlaWeights
from v4train.reference.lora import bind


def small_config(draw, dtype: torch.dtype, layers: int = 1, **fixed):
    """A GLM-5 config of drawn small dimensions (default or YaRN RoPE)."""
    rope_dim = draw.sampled_from([2, 4, 8])
    yarn = draw.booleans()
    w = lambda n: width(draw, n, dtype)  # noqa: E731
    d = dict(model_type="glm_moe_dsa", num_hidden_layers=layers, hidden_size=w(24),
             num_attention_heads=draw.integers(1, 4), num_key_value_heads=None, q_lora_rank=w(16),
             kv_lora_rank=w(16), qk_nope_head_dim=w(12), qk_rope_head_dim=rope_dim,
             v_head_dim=w(12), index_topk=draw.integers(1, 8), index_head_dim=rope_dim + size(draw, 8),
             index_n_heads=draw.integers(1, 4), max_position_embeddings=512,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                              "mscale": 1.0, "mscale_all_dim": 1.0} if yarn else {"rope_type": "default", "rope_theta": 10000.0})
    d.update(fixed)
    d["num_key_value_heads"] = d["num_attention_heads"]
    return config_from_dict(d)


def attention_shapes(cfg) -> dict[str, tuple[int, ...]]:
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    return {
        "self_attn.q_a_proj.weight": (cfg.q_lora_rank, H),
        "self_attn.q_b_proj.weight": (nh * cfg.qk_head_dim, cfg.q_lora_rank),
        "self_attn.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H),
        "self_attn.kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "self_attn.o_proj.weight": (H, nh * cfg.v_head_dim),
    }


def attention_leaves(draw, cfg, dtype, device, s, indexer: bool, scale: float = 0.3):
    """The attention's tensors (LoRA on a drawn subset; N(0, scale^2)), its latent norms and, for a
    'full' layer, the indexer's (fp32 weights_proj, as transformers keeps it)."""
    weights, scaling = weight_leaves(draw, attention_shapes(cfg), dtype, device, s, scale)
    weights["self_attn.q_a_layernorm.weight"] = make_leaf((cfg.q_lora_rank,), "contiguous", dtype, device, s + 40, 0.2, 1.0)
    weights["self_attn.kv_a_layernorm.weight"] = make_leaf((cfg.kv_lora_rank,), "contiguous", dtype, device, s + 41, 0.2, 1.0)
    if indexer:
        n, d = cfg.index_n_heads, cfg.index_head_dim
        weights["self_attn.indexer.wq_b.weight"] = make_leaf((n * d, cfg.q_lora_rank), "contiguous", dtype, device, s + 42)
        weights["self_attn.indexer.wk.weight"] = make_leaf((d, cfg.hidden_size), "contiguous", dtype, device, s + 43)
        weights["self_attn.indexer.k_norm.weight"] = make_leaf((d,), "contiguous", dtype, device, s + 44, 0.2, 1.0)
        weights["self_attn.indexer.k_norm.bias"] = make_leaf((d,), "contiguous", dtype, device, s + 45, 0.2)
        weights["self_attn.indexer.weights_proj.weight"] = make_leaf((n, cfg.hidden_size), "contiguous", torch.float32,
                                                                     device, s + 46)
    return weights, scaling


def documents(draw, top_k: int) -> list[int]:
    """Document lengths around index_topk: some within it (dense), some past it (selected keys)."""
    return [draw.sampled_from([1, top_k, top_k + 1, 2 * top_k + 3, size(draw, 40)]) for _ in range(draw.integers(1, 3))]


def random_selection(lengths: list[int], top_k: int, gen: torch.Generator) -> torch.Tensor:
    """A valid selection (what a 'shared' layer is handed): all causal keys up to top_k, else top_k
    of them, ascending, -1 in unused slots."""
    rows = []
    for L in lengths:
        for p in range(L):
            keys = torch.arange(p + 1) if p < top_k else torch.randperm(p + 1, generator=gen)[:top_k].sort().values
            rows.append(torch.cat([keys, torch.full((top_k - len(keys),), -1)]))
    return torch.stack(rows) if rows else torch.empty(0, top_k, dtype=torch.int64)


def packed(lengths: list[int], device):
    positions = torch.cat([torch.arange(L) for L in lengths]).to(device)
    cu = torch.tensor([0] + lengths).cumsum(0)
    return positions, cu


def samples(draw, dtype: torch.dtype, device) -> Sample:
    shared = draw.booleans()
    cfg = small_config(draw, dtype, layers=2, indexer_types=["full", "shared"])
    layer = 1 if shared else 0
    lengths = documents(draw, cfg.index_topk)
    masked_max_len = draw.sampled_from([0, 10**6])  # the C++ op's latent path, or its masked one
    h_layout, s = layout(draw), seed(draw)
    weights, scaling = attention_leaves(draw, cfg, dtype, device, s, indexer=not shared)
    T = sum(lengths)
    positions, cu = packed(lengths, device)
    carry = random_selection(lengths, cfg.index_topk, torch.Generator().manual_seed(s)).to(device) if shared else None
    leaves = {"h": make_leaf((T, cfg.hidden_size), h_layout, dtype, device, s + 100), **weights}

    def build(lv):
        return (view_as_layout(lv["h"], h_layout), bind(MlaWeights, lv, "self_attn."), cfg, layer, positions, cu, carry,
                scaling, 0.0, masked_max_len), {}

    return Sample(leaves, build, note=f"documents {lengths}, index_topk {cfg.index_topk}, shared {shared}, "
                                      f"rope {cfg.rope.type}, masked_max_len {masked_max_len}, cfg {cfg}")


def glm5_width_sample(dtype: torch.dtype, device, tokens: int, top_k: int, seed_: int = 0, heads: int = 64,
                      index_heads: int = 32) -> Sample:
    """One document of `tokens` through GLM-5's own attention widths (64 heads, 512 latent + 64
    rope dims, 32 indexer heads of 128, unless `heads` / `index_heads`) on a narrow hidden size,
    latent path (masked_max_len 0): the shapes the CUDA kernels specialise for, which the drawn
    samples are too small to reach."""
    cfg = config_from_dict(dict(model_type="glm_moe_dsa", num_hidden_layers=1, indexer_types=["full"],
                                hidden_size=256, q_lora_rank=192, index_topk=top_k, num_attention_heads=heads,
                                num_key_value_heads=heads, index_n_heads=index_heads))
    # Weights N(0, 0.1^2): the drawn samples' 0.3 would give scores 29 apart at these widths (a
    # saturated softmax, whose bf16 rounding moves the gradients by their own size) and gradients
    # past float16's largest value; 0.1 gives about 3.
    weights, scaling = attention_leaves(RandomDraw(seed_), cfg, dtype, device, seed_, indexer=True, scale=0.1)
    positions, cu = packed([tokens], device)
    leaves = {"h": make_leaf((tokens, cfg.hidden_size), "contiguous", dtype, device, seed_ + 100), **weights}

    def build(lv):
        return (lv["h"], bind(MlaWeights, lv, "self_attn."), cfg, 0, positions, cu, None, scaling, 0.0, 0), {}

    return Sample(leaves, build, note=f"GLM-5 widths, {heads} heads, {index_heads} indexer heads, {tokens} tokens, index_topk {top_k}")


def _cfg():
    return config_from_dict(dict(model_type="glm_moe_dsa", num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                                 num_key_value_heads=2, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                                 qk_rope_head_dim=4, v_head_dim=4, index_topk=4, index_head_dim=8, index_n_heads=2,
                                 indexer_types=["full", "shared"]))


def _call(h=lambda: torch.zeros(5, 16), positions=lambda: torch.arange(5), cu=lambda: torch.tensor([0, 5]), carry=None):
    def args():
        cfg = _cfg()
        w = {k: torch.zeros(s) for k, s in attention_shapes(cfg).items()}
        w.update({"self_attn.q_a_layernorm.weight": torch.ones(8), "self_attn.kv_a_layernorm.weight": torch.ones(8)})
        return (h(), bind(MlaWeights, w, "self_attn."), cfg, 1, positions(), cu(), carry and carry(), 0.0, 0.0, 8192)
    return args


def _bench(device, dtype, tokens=4096):
    """A GLM-5 attention layer (the proxy's: hidden 6144, 64 heads, DSA top-2048) on `tokens` tokens
    of one document: at 4,096 its queries past index_topk take the masked dense path, at 65,536 the
    sparse latent kernels (issue 19's shape)."""
    cfg = config_from_dict({"model_type": "glm_moe_dsa", "num_hidden_layers": 1, "indexer_types": ["full"]})
    gen = torch.Generator().manual_seed(0)
    w = {k: (0.02 * torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype).requires_grad_()
         for k, shape in attention_shapes(cfg).items()}
    n, d = cfg.index_n_heads, cfg.index_head_dim
    w.update({"self_attn.q_a_layernorm.weight": torch.ones(cfg.q_lora_rank, device=device, dtype=dtype),
              "self_attn.kv_a_layernorm.weight": torch.ones(cfg.kv_lora_rank, device=device, dtype=dtype),
              "self_attn.indexer.wq_b.weight": (0.02 * torch.randn(n * d, cfg.q_lora_rank, generator=gen)).to(device, dtype),
              "self_attn.indexer.wk.weight": (0.02 * torch.randn(d, cfg.hidden_size, generator=gen)).to(device, dtype),
              "self_attn.indexer.k_norm.weight": torch.ones(d, device=device, dtype=dtype),
              "self_attn.indexer.k_norm.bias": torch.zeros(d, device=device, dtype=dtype),
              "self_attn.indexer.weights_proj.weight": (0.02 * torch.randn(n, cfg.hidden_size, generator=gen)).to(device)})
    h = torch.randn(tokens, cfg.hidden_size, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    positions, cu = packed([tokens], device)
    return f"h [{tokens}, 6144], 64 heads, DSA top-2048", (h, bind(MlaWeights, w, "self_attn."), cfg, 0, positions, cu,
                                                           None, 0.0, 0.0, 8192)


CASE = OpCase(
    OPS["v4_mla_dsa_attention"], samples=samples, benchmarks=(_bench, functools.partial(_bench, tokens=65536)),
    errors=(
        ErrorCase("a shared layer without carry", _call(), "is a 'shared' indexer layer but no earlier layer's selection"),
        ErrorCase("h of the wrong width", _call(h=lambda: torch.zeros(5, 12)), "h has shape [5, 12], expected [T, hidden_size=16]"),
        ErrorCase("cu_seqlens not ending at T", _call(cu=lambda: torch.tensor([0, 4])), "cu_seqlens must end at T=5, got [0, 4]"),
        ErrorCase("int32 positions", _call(positions=lambda: torch.arange(5, dtype=torch.int32)), "positions must be int64 [5]"),
        ErrorCase("a carry of the wrong shape", _call(carry=lambda: torch.zeros(5, 3, dtype=torch.int64)),
                  "carry must be the int64 [5, 4] selection"),
        ErrorCase("a carry naming a key after its query", _call(carry=lambda: torch.full((5, 4), 4)),
                  "carry must name for each query keys of its own document at or before it"),
    ),
)
