"""Model configs read from Hugging Face config.json, with transformers 5.24's defaults.

GLM-5 (`glm_moe_dsa`) and Qwen3.5/3.6 (`qwen3_5_moe`, `qwen3_5`, their `*_text` variants). The
released Qwen3.5 checkpoints are vision-language: the text model's config is nested under
`text_config`; only that part is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


class ConfigError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary embedding: inverse frequencies over `dim` dims, YaRN when type is 'yarn'."""

    theta: float
    dim: int
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


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


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    layer_types: tuple[str, ...]
    rope: Rope
    is_moe: bool
    intermediate_size: int = 0  # dense MLP (qwen3_5)
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    family: str = "qwen3_5"


ModelConfig = Glm5Config | Qwen35Config

# The config.json keys that hold an object, and those that hold a list of strings.
_OBJECT_KEYS = ("rope_parameters", "rope_scaling", "text_config", "quantization_config")
_STRING_LISTS = ("layer_types", "mlp_layer_types", "indexer_types")


def check_shapes(d: dict, source: str) -> None:
    """An object or a list of strings where config.json holds one (a string where a dict belongs
    fails here naming the key, not deep inside the parser)."""
    for key in _OBJECT_KEYS:
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise ConfigError(f"{source}: {key} must be an object, got {json.dumps(d[key])[:80]}")
    for key in _STRING_LISTS:
        if d.get(key) is not None and not (isinstance(d[key], list) and all(isinstance(x, str) for x in d[key])):
            raise ConfigError(f"{source}: {key} must be a list of strings, got {json.dumps(d[key])[:80]}")


def check_values(cfg: ModelConfig, source: str) -> None:
    """Every size, count and constant of the parsed config in its range, checked once at load:
    a zero or negative size, a top-k above the experts, a negative eps each fail here naming the
    file and the key, not as a shape mismatch inside an op at step 1."""
    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            value = getattr(cfg, key, None)
            raise ConfigError(f"{source}: {key} must be {what}, got {value!r}")

    import math

    positive = [f.name for f in dataclasses.fields(cfg) if f.type == "int"]
    optional = {"n_shared_experts"} | ({"intermediate_size"} if getattr(cfg, "is_moe", False) else
                                       {"moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
                                        "num_experts_per_tok"} if isinstance(cfg, Qwen35Config) else set())
    for key in positive:
        need(getattr(cfg, key) >= (0 if key in optional else 1), key, "an integer >= 0" if key in optional else "an integer >= 1")
    need(math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps > 0, "rms_norm_eps", "a finite number > 0")
    need(math.isfinite(cfg.rope.theta) and cfg.rope.theta > 0, "rope", "rope_theta a finite number > 0")
    if isinstance(cfg, Glm5Config):
        need(cfg.num_experts_per_tok <= cfg.n_routed_experts, "num_experts_per_tok",
             f"at most n_routed_experts={cfg.n_routed_experts}")
        need(cfg.topk_group <= cfg.n_group, "topk_group", f"at most n_group={cfg.n_group}")
        need(cfg.num_experts_per_tok <= cfg.topk_group * (cfg.n_routed_experts // cfg.n_group), "num_experts_per_tok",
             f"at most the experts of topk_group groups ({cfg.topk_group * (cfg.n_routed_experts // cfg.n_group)})")
        need(cfg.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "even (RoPE rotates pairs)")
        need(math.isfinite(cfg.routed_scaling_factor) and cfg.routed_scaling_factor > 0, "routed_scaling_factor",
             "a finite number > 0")
        for i, (mlp, indexer) in enumerate(zip(cfg.mlp_layer_types, cfg.indexer_types)):
            need(mlp in ("dense", "sparse"), "mlp_layer_types", f"'dense' or 'sparse' (entry {i} is {mlp!r})")
            need(indexer in ("full", "shared"), "indexer_types", f"'full' or 'shared' (entry {i} is {indexer!r})")
    else:
        need(cfg.linear_num_value_heads % cfg.linear_num_key_heads == 0, "linear_num_value_heads",
             f"a multiple of linear_num_key_heads={cfg.linear_num_key_heads}")
        need(cfg.num_attention_heads % cfg.num_key_value_heads == 0, "num_attention_heads",
             f"a multiple of num_key_value_heads={cfg.num_key_value_heads}")
        need(cfg.rope.dim % 2 == 0 and 0 < cfg.rope.dim <= cfg.head_dim, "rope",
             f"a rotary dimension (head_dim x partial_rotary_factor) even and in (0, head_dim={cfg.head_dim}], "
             f"got {cfg.rope.dim}")
        if cfg.is_moe:
            need(cfg.num_experts_per_tok <= cfg.num_experts, "num_experts_per_tok", f"at most num_experts={cfg.num_experts}")

def _rope(params: dict | None, legacy: dict, dim: int, max_pos: int, default_theta: float) -> Rope:
    p = dict(params or {})
    for key in ("rope_theta", "rope_scaling"):  # configs written before rope_parameters existed
        if key in legacy and key not in p:
            p.update(legacy[key] if key == "rope_scaling" and legacy[key] else {key: legacy[key]})
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"rope_parameters.rope_type={rope_type!r} is not supported (expected 'default' or 'yarn')")
    factor = float(p.get("factor") or 1.0)
    original = int(p.get("original_max_position_embeddings") or max_pos)
    if rope_type == "yarn" and p.get("factor") is None:
        factor = max_pos / original
    return Rope(
        theta=float(p.get("rope_theta", default_theta)), dim=dim, type=rope_type, factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
        mscale=float(p.get("mscale") or 0), mscale_all_dim=float(p.get("mscale_all_dim") or 0),
        attention_factor=p.get("attention_factor"), truncate=bool(p.get("truncate", True)),
    )


def parse_glm5(d: dict, model_type: str, source: str) -> Glm5Config:
    g = lambda k, default: d.get(k, default)  # noqa: E731
    n_layers = g("num_hidden_layers", 78)
    indexer_types = d.get("indexer_types")
    if indexer_types is None:
        pattern = d.get("index_topk_pattern")
        if pattern is not None:
            indexer_types = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq = max(d.get("index_topk_freq", 1), 1)
            offset = d.get("index_skip_topk_offset", 2)
            indexer_types = ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n_layers)]
    mlp_types = d.get("mlp_layer_types")
    if mlp_types is None:
        n_dense = min(g("first_k_dense_replace", 3), n_layers)
        mlp_types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
    if g("attention_bias", False) or g("mlp_bias", False):
        raise ConfigError("attention_bias/mlp_bias = true is not supported for glm_moe_dsa")
    heads = g("num_attention_heads", 64)
    if g("num_key_value_heads", heads) != heads:
        raise ConfigError("glm_moe_dsa: num_key_value_heads must equal num_attention_heads (MLA)")
    if indexer_types and indexer_types[0] != "full":
        raise ConfigError("glm_moe_dsa: indexer_types[0] must be 'full' (a shared layer reuses an earlier full one)")
    cfg = Glm5Config(
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
        rope=_rope(d.get("rope_parameters"), d, g("qk_rope_head_dim", 64), g("max_position_embeddings", 202752), 10000.0),
    )
    if len(cfg.mlp_layer_types) != n_layers or len(cfg.indexer_types) != n_layers:
        raise ConfigError(f"glm_moe_dsa: mlp_layer_types/indexer_types must have num_hidden_layers={n_layers} entries")
    if cfg.n_routed_experts % cfg.n_group:
        raise ConfigError("glm_moe_dsa: n_routed_experts must be divisible by n_group")
    return cfg


def _qwen3_5_text(d: dict, model_type: str) -> Qwen35Config:
    g = lambda k, default: d.get(k, default)  # noqa: E731
    n_layers = g("num_hidden_layers", 40)
    layer_types = d.get("layer_types")
    if layer_types is None:
        interval = d.get("full_attention_interval", 4)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    bad = sorted(set(layer_types) - {"linear_attention", "full_attention"})
    if bad or len(layer_types) != n_layers:
        raise ConfigError(f"{model_type}: layer_types must be {n_layers} of linear_attention/full_attention, got {bad or len(layer_types)}")
    head_dim = g("head_dim", 256)
    rope_params = dict(d.get("rope_parameters") or {})
    partial = float(rope_params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)))
    is_moe = model_type.startswith("qwen3_5_moe")
    extra = dict(moe_intermediate_size=g("moe_intermediate_size", 512),
                 shared_expert_intermediate_size=g("shared_expert_intermediate_size", 512),
                 num_experts=g("num_experts", 256), num_experts_per_tok=g("num_experts_per_tok", 8)) if is_moe \
        else dict(intermediate_size=g("intermediate_size", 12288))
    if g("attention_bias", False):
        raise ConfigError(f"{model_type}: attention_bias = true is not supported")
    return Qwen35Config(
        model_type=model_type, vocab_size=g("vocab_size", 248320), hidden_size=g("hidden_size", 2048 if is_moe else 4096),
        num_hidden_layers=n_layers, num_attention_heads=g("num_attention_heads", 16),
        num_key_value_heads=g("num_key_value_heads", 2 if is_moe else 4), head_dim=head_dim,
        rms_norm_eps=float(g("rms_norm_eps", 1e-6)), tie_word_embeddings=bool(g("tie_word_embeddings", False)),
        linear_conv_kernel_dim=g("linear_conv_kernel_dim", 4), linear_key_head_dim=g("linear_key_head_dim", 128),
        linear_value_head_dim=g("linear_value_head_dim", 128), linear_num_key_heads=g("linear_num_key_heads", 16),
        linear_num_value_heads=g("linear_num_value_heads", 32), layer_types=tuple(layer_types),
        rope=_rope(rope_params, d, int(head_dim * partial), g("max_position_embeddings", 32768), 10000.0),
        is_moe=is_moe, **extra,
    )


def parse_qwen3_5(d: dict, model_type: str, source: str) -> Qwen35Config:
    text = d.get("text_config")
    if text is None:
        return _qwen3_5_text(d, model_type)
    # The vision-language wrapper: read the text model's part.
    tie = d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    text = {**text, "tie_word_embeddings": text.get("tie_word_embeddings", tie)}
    text_type = text.get("model_type", model_type + "_text")
    if not text_type.startswith("qwen3_5"):
        raise ConfigError(f"{source}: text_config.model_type={text_type!r} is not a Qwen3.5 text model")
    return _qwen3_5_text(text, text_type)
