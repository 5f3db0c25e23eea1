"""Qwen3.5 / Qwen3.6's config (`qwen3_5_moe`, `qwen3_5` and their `*_text` variants) from Hugging
Face config.json, with transformers 5.24's defaults. The released checkpoints are
vision-language: the text model's config is nested under `text_config`; only that part is read."""

from __future__ import annotations

import dataclasses

from v4train.models.config import AT_LEAST_1, ConfigError, Rope, number, parse_rope


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


def _qwen3_5_text(d: dict, model_type: str, source: str) -> Qwen35Config:
    g = lambda k, default: d.get(k, default)  # noqa: E731
    n_layers = number(g("num_hidden_layers", 40), "num_hidden_layers", source, **AT_LEAST_1)  # layer_types' length
    layer_types = d.get("layer_types")
    if layer_types is None:
        interval = number(d.get("full_attention_interval", 4), "full_attention_interval", source, **AT_LEAST_1)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    bad = sorted(set(layer_types) - {"linear_attention", "full_attention"})
    if bad or len(layer_types) != n_layers:
        raise ConfigError(f"{source}: layer_types must be {n_layers} of linear_attention/full_attention, got "
                          f"{bad or len(layer_types)}")
    head_dim = g("head_dim", 256)
    rope_params = dict(d.get("rope_parameters") or {})
    key = "rope_parameters.partial_rotary_factor" if "partial_rotary_factor" in rope_params else "partial_rotary_factor"
    partial = number(rope_params.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)), key, source,
                     "a number in (0, 1]", lambda v: 0 < v <= 1)
    is_moe = model_type.startswith("qwen3_5_moe")
    extra = dict(moe_intermediate_size=g("moe_intermediate_size", 512),
                 shared_expert_intermediate_size=g("shared_expert_intermediate_size", 512),
                 num_experts=g("num_experts", 256), num_experts_per_tok=g("num_experts_per_tok", 8)) if is_moe \
        else dict(intermediate_size=g("intermediate_size", 12288))
    if g("attention_bias", False):
        raise ConfigError(f"{source}: attention_bias = true is not supported for {model_type}")
    return Qwen35Config(
        model_type=model_type, vocab_size=g("vocab_size", 248320), hidden_size=g("hidden_size", 2048 if is_moe else 4096),
        num_hidden_layers=n_layers, num_attention_heads=g("num_attention_heads", 16),
        num_key_value_heads=g("num_key_value_heads", 2 if is_moe else 4), head_dim=head_dim,
        rms_norm_eps=float(g("rms_norm_eps", 1e-6)), tie_word_embeddings=bool(g("tie_word_embeddings", False)),
        linear_conv_kernel_dim=g("linear_conv_kernel_dim", 4), linear_key_head_dim=g("linear_key_head_dim", 128),
        linear_value_head_dim=g("linear_value_head_dim", 128), linear_num_key_heads=g("linear_num_key_heads", 16),
        linear_num_value_heads=g("linear_num_value_heads", 32), layer_types=tuple(layer_types),
        rope=parse_rope(rope_params, d, int(head_dim * partial), g("max_position_embeddings", 32768), 10000.0, source),
        is_moe=is_moe, **extra,
    )


def parse_qwen3_5(d: dict, model_type: str, source: str) -> Qwen35Config:
    text = d.get("text_config")
    if text is None:
        return _qwen3_5_text(d, model_type, source)
    # The vision-language wrapper: read the text model's part.
    tie = d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    text = {**text, "tie_word_embeddings": text.get("tie_word_embeddings", tie)}
    text_type = text.get("model_type", model_type + "_text")
    if not text_type.startswith("qwen3_5"):
        raise ConfigError(f"{source}: text_config.model_type={text_type!r} is not a Qwen3.5 text model")
    return _qwen3_5_text(text, text_type, f"{source} (text_config)")


def check(cfg: Qwen35Config, need) -> None:
    """Qwen3.5's own ranges (models.config.check_values)."""
    need(cfg.linear_num_value_heads % cfg.linear_num_key_heads == 0, "linear_num_value_heads",
         f"a multiple of linear_num_key_heads={cfg.linear_num_key_heads}")
    need(cfg.num_attention_heads % cfg.num_key_value_heads == 0, "num_attention_heads",
         f"a multiple of num_key_value_heads={cfg.num_key_value_heads}")
    need(cfg.rope.dim % 2 == 0 and 0 < cfg.rope.dim <= cfg.head_dim, "rope",
         f"a rotary dimension (head_dim x partial_rotary_factor) even and in (0, head_dim={cfg.head_dim}], "
         f"got {cfg.rope.dim}")
    if cfg.is_moe:
        need(cfg.num_experts_per_tok <= cfg.num_experts, "num_experts_per_tok", f"at most num_experts={cfg.num_experts}")


check.optional_sizes = lambda cfg: ({"intermediate_size"} if cfg.is_moe else
                                    {"moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
                                     "num_experts_per_tok"})
