"""GLM-5's config (`model_type: glm_moe_dsa`) from Hugging Face config.json, with transformers
5.24's defaults (GlmMoeDsaConfig)."""

from __future__ import annotations

import dataclasses
import json
import math

from v4train.models.config import AT_LEAST_1, ConfigError, Rope, number, parse_rope


@dataclasses.dataclass(frozen=True)
class Glm5Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_shared_experts: int
    n_routed_experts: int
    routed_scaling_factor: float
    kv_lora_rank: int
    q_lora_rank: int
    qk_rope_head_dim: int
    v_head_dim: int
    qk_nope_head_dim: int
    n_group: int
    topk_group: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    rms_norm_eps: float
    tie_word_embeddings: bool
    index_topk: int
    index_head_dim: int
    index_n_heads: int
    mlp_layer_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    rope: Rope
    family: str = "glm5"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def parse_glm5(d: dict, model_type: str, source: str) -> Glm5Config:
    g = lambda k, default: d.get(k, default)  # noqa: E731
    n_layers = number(g("num_hidden_layers", 78), "num_hidden_layers", source, **AT_LEAST_1)  # the lists' length
    indexer_types = d.get("indexer_types")
    if indexer_types is None:
        pattern = d.get("index_topk_pattern")
        if pattern is not None:
            if not (isinstance(pattern, str) and set(pattern) <= set("FS") or isinstance(pattern, list)):
                raise ConfigError(f"{source}: index_topk_pattern must be a string of F and S or a list of "
                                  f"'full'/'shared', got {json.dumps(pattern)[:80]}")
            indexer_types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else pattern
        else:
            freq = max(number(d.get("index_topk_freq", 1), "index_topk_freq", source, integer=True), 1)
            offset = number(d.get("index_skip_topk_offset", 2), "index_skip_topk_offset", source, integer=True)
            indexer_types = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n_layers)]
    mlp_types = d.get("mlp_layer_types")
    if mlp_types is None:
        n_dense = min(number(g("first_k_dense_replace", 3), "first_k_dense_replace", source, "an integer >= 0",
                             lambda v: v >= 0, integer=True), n_layers)
        mlp_types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
    for key, types in (("mlp_layer_types", mlp_types), ("indexer_types", indexer_types)):
        if len(types) != n_layers:
            raise ConfigError(f"{source}: {key} must have num_hidden_layers={n_layers} entries, got {len(types)}")
    if g("attention_bias", False) or g("mlp_bias", False):
        raise ConfigError(f"{source}: attention_bias/mlp_bias = true is not supported for glm_moe_dsa")
    heads = g("num_attention_heads", 64)
    if g("num_key_value_heads", heads) != heads:
        raise ConfigError(f"{source}: num_key_value_heads must equal num_attention_heads={heads} (MLA)")
    if indexer_types[0] != "full":
        raise ConfigError(f"{source}: indexer_types[0] must be 'full' (a shared layer reuses an earlier full one)")
    return Glm5Config(
        model_type=d["model_type"], vocab_size=g("vocab_size", 154880), hidden_size=g("hidden_size", 6144),
        intermediate_size=g("intermediate_size", 12288), moe_intermediate_size=g("moe_intermediate_size", 2048),
        num_hidden_layers=n_layers, num_attention_heads=heads,
        n_shared_experts=g("n_shared_experts", 1), n_routed_experts=d.get("n_routed_experts", d.get("num_experts", 256)),
        routed_scaling_factor=float(g("routed_scaling_factor", 2.5)), kv_lora_rank=g("kv_lora_rank", 512),
        q_lora_rank=g("q_lora_rank", 2048), qk_rope_head_dim=g("qk_rope_head_dim", 64), v_head_dim=g("v_head_dim", 256),
        qk_nope_head_dim=g("qk_nope_head_dim", 192), n_group=g("n_group", 1), topk_group=g("topk_group", 1),
        num_experts_per_tok=g("num_experts_per_tok", 8), norm_topk_prob=bool(g("norm_topk_prob", True)),
        rms_norm_eps=float(g("rms_norm_eps", 1e-5)), tie_word_embeddings=bool(g("tie_word_embeddings", False)),
        index_topk=g("index_topk", 2048), index_head_dim=g("index_head_dim", 128), index_n_heads=g("index_n_heads", 32),
        mlp_layer_types=tuple(mlp_types), indexer_types=tuple(indexer_types),
        rope=parse_rope(d.get("rope_parameters"), d, g("qk_rope_head_dim", 64), g("max_position_embeddings", 202752),
                        10000.0, source),
    )


def check(cfg: Glm5Config, need) -> None:
    """GLM-5's own ranges (models.config.check_values)."""
    need(cfg.num_experts_per_tok <= cfg.n_routed_experts, "num_experts_per_tok",
         f"at most n_routed_experts={cfg.n_routed_experts}")
    need(cfg.n_routed_experts % cfg.n_group == 0, "n_routed_experts", f"divisible by n_group={cfg.n_group}")
    need(cfg.topk_group <= cfg.n_group, "topk_group", f"at most n_group={cfg.n_group}")
    need(cfg.num_experts_per_tok <= cfg.topk_group * (cfg.n_routed_experts // cfg.n_group), "num_experts_per_tok",
         f"at most the experts of topk_group groups ({cfg.topk_group * (cfg.n_routed_experts // cfg.n_group)})")
    need(cfg.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "even (RoPE rotates pairs)")
    need(math.isfinite(cfg.routed_scaling_factor) and cfg.routed_scaling_factor > 0, "routed_scaling_factor",
         "a finite number > 0")
    for i, (mlp, indexer) in enumerate(zip(cfg.mlp_layer_types, cfg.indexer_types)):
        need(mlp in ("dense", "sparse"), "mlp_layer_types", f"'dense' or 'sparse' (entry {i} is {mlp!r})")
        need(indexer in ("full", "shared"), "indexer_types", f"'full' or 'shared' (entry {i} is {indexer!r})")


check.optional_sizes = lambda cfg: {"n_shared_experts"}
