"""The model families (GLM-5, Qwen3.5/3.6), one package each (models/<family>: config, weight
table, the references of its own ops, its Family record), and reading a config.json into the
family's config. A third family is one more package and one more entry in FAMILIES."""

from __future__ import annotations

import json
import os
from typing import Any

from v4train.models import glm5, qwen3_5
from v4train.models.config import ConfigError, check_shapes, check_values
from v4train.models.family import Family
from v4train.models.glm5.config import Glm5Config
from v4train.models.qwen3_5.config import Qwen35Config

FAMILIES: dict[str, Family] = {f.name: f for f in (glm5.FAMILY, qwen3_5.FAMILY)}
ModelConfig = Glm5Config | Qwen35Config
_BY_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}


def family_of(cfg: ModelConfig) -> Family:
    return FAMILIES[cfg.family]


def ops_of(cfg: ModelConfig, names) -> list[str]:
    """Of the op names, those a model of cfg's family can call (no other family's own ops)."""
    others = {op.name for f in FAMILIES.values() if f is not family_of(cfg) for op in f.ops}
    return sorted(n for n in names if n not in others)


def config_from_dict(d: dict[str, Any], source: str = "config") -> ModelConfig:
    """The model config of a config.json's contents (`source` names it in errors)."""
    model_type = d.get("model_type")
    if model_type not in _BY_TYPE:
        raise ConfigError(f"{source}: model_type={model_type!r} is not supported; expected one of {tuple(_BY_TYPE)}")
    check_shapes(d, source)
    if isinstance(d.get("text_config"), dict):
        check_shapes(d["text_config"], f"{source} (text_config)")
    family = _BY_TYPE[model_type]
    cfg = family.parse(d, model_type, source)
    check_values(cfg, source, family.check)
    return cfg


def load_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found (expected a Hugging Face checkpoint directory)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return config_from_dict(d, path)
