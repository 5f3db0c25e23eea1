"""What the model configs share: the error type, the rotary embedding and its parsing, and the
checks made once at load of every config.json (each family's config lives in
models/<family>/config.py, with transformers 5.24's defaults)."""

from __future__ import annotations

import dataclasses
import json
import math


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


def number(value, key: str, source: str, what: str = "a finite number", ok=lambda v: True, integer: bool = False):
    """A config.json value read as a number: a finite JSON number (a whole one where `integer`,
    returned as an int) for which ok(value) holds; else a ConfigError naming the file and the key,
    not float()'s "could not convert string to float" or a ZeroDivisionError later."""
    numeric = not isinstance(value, bool) and (isinstance(value, int)
                                               or isinstance(value, float) and math.isfinite(value))
    if not (numeric and (not integer or value == int(value)) and ok(value)):
        raise ConfigError(f"{source}: {key} must be {what}, got {json.dumps(value, default=repr)[:80]}")
    return int(value) if integer else float(value)


POSITIVE = dict(what="a finite number > 0", ok=lambda v: v > 0)
AT_LEAST_1 = dict(what="an integer >= 1", ok=lambda v: v >= 1, integer=True)


def parse_rope(params: dict | None, legacy: dict, dim: int, max_pos, default_theta: float, source: str) -> Rope:
    """The rotary embedding of rope_parameters (or a legacy rope_theta / rope_scaling), each value
    checked as it is read and named by its key (`max_pos`: max_position_embeddings)."""
    p = dict(params or {})
    names = {k: f"rope_parameters.{k}" for k in p}  # each value's key in config.json
    for key in ("rope_theta", "rope_scaling"):  # configs written before rope_parameters existed
        if key in legacy and key not in p:
            scaling = key == "rope_scaling" and legacy[key]
            extra = legacy[key] if scaling else {key: legacy[key]}
            names.update({k: f"{key}.{k}" if scaling else key for k in extra})
            p.update(extra)
    name = lambda k: names.get(k, f"rope_parameters.{k}")  # noqa: E731
    # Where the parser has always read 0 or null as the default (as transformers does), it still does.
    value = lambda k, default, **rule: number(p.get(k) or default, name(k), source, **rule)  # noqa: E731
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"{source}: {name('rope_type' if 'rope_type' in p else 'type')}={rope_type!r} is not "
                          "supported (expected 'default' or 'yarn')")
    max_pos = number(max_pos, "max_position_embeddings", source, **AT_LEAST_1)
    factor = value("factor", 1.0, **POSITIVE)
    original = value("original_max_position_embeddings", max_pos, **AT_LEAST_1)
    if rope_type == "yarn" and p.get("factor") is None:
        factor = max_pos / original
    truncate = p.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{source}: {name('truncate')} must be true or false, got {json.dumps(truncate)[:80]}")
    at_least_0 = dict(what="a finite number >= 0", ok=lambda v: v >= 0)
    return Rope(
        theta=number(p.get("rope_theta", default_theta), name("rope_theta"), source, **POSITIVE), dim=dim,
        type=rope_type, factor=factor, original_max_position_embeddings=original,
        beta_fast=value("beta_fast", 32, **POSITIVE), beta_slow=value("beta_slow", 1, **POSITIVE),
        mscale=value("mscale", 0, **at_least_0), mscale_all_dim=value("mscale_all_dim", 0, **at_least_0),
        attention_factor=None if p.get("attention_factor") is None else
        number(p["attention_factor"], name("attention_factor"), source, **POSITIVE),
        truncate=truncate,
    )


def check_values(cfg, source: str, family_check) -> None:
    """Every size, count and constant of the parsed config in its range, checked once at load:
    a zero or negative size, a top-k above the experts, a negative eps each fail here naming the
    file and the key, not as a shape mismatch inside an op at step 1 (the values the parser itself
    computes with, and the rotary embedding's, are checked as they are read: `number`).
    `family_check(cfg, need)` adds the family's own rules; `optional` sizes (the family's
    `optional_sizes(cfg)`) may be 0."""
    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            value = getattr(cfg, key, None)
            raise ConfigError(f"{source}: {key} must be {what}, got {value!r}")

    optional = family_check.optional_sizes(cfg)
    for key in (f.name for f in dataclasses.fields(cfg) if f.type == "int"):
        need(getattr(cfg, key) >= (0 if key in optional else 1), key, "an integer >= 0" if key in optional else "an integer >= 1")
    need(math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps > 0, "rms_norm_eps", "a finite number > 0")
    family_check(cfg, need)
