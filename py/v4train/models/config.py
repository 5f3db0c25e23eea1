"""What the model configs share: the error type, the rotary embedding and its parsing, and the
checks made once at load of every config.json (each family's config lives in
models/<family>/config.py, with transformers 5.24's defaults)."""

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


def parse_rope(params: dict | None, legacy: dict, dim: int, max_pos: int, default_theta: float) -> Rope:
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


def check_values(cfg, source: str, family_check) -> None:
    """Every size, count and constant of the parsed config in its range, checked once at load:
    a zero or negative size, a top-k above the experts, a negative eps each fail here naming the
    file and the key, not as a shape mismatch inside an op at step 1. `family_check(cfg, need)`
    adds the family's own rules; `optional` sizes (the family's `optional_sizes(cfg)`) may be 0."""
    import math

    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            value = getattr(cfg, key, None)
            raise ConfigError(f"{source}: {key} must be {what}, got {value!r}")

    optional = family_check.optional_sizes(cfg)
    for key in (f.name for f in dataclasses.fields(cfg) if f.type == "int"):
        need(getattr(cfg, key) >= (0 if key in optional else 1), key, "an integer >= 0" if key in optional else "an integer >= 1")
    need(math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps > 0, "rms_norm_eps", "a finite number > 0")
    need(math.isfinite(cfg.rope.theta) and cfg.rope.theta > 0, "rope", "rope_theta a finite number > 0")
    family_check(cfg, need)
