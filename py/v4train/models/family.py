"""A model family: everything that differs between GLM-5 and Qwen3.5, in one record per family
(torchtitan's ModelSpec), so that the model container, checkpoints, LoRA and the trainer ask
the family instead of branching on the config's type."""

from __future__ import annotations

import dataclasses
from typing import Callable

from v4train.op import Op


@dataclasses.dataclass(frozen=True)
class Family:
    """name: the config's `family` field. model_types: config.json model_type values it reads.
    parse(d, model_type, source) -> config. layer_specs(cfg, i) -> the layer's WeightSpecs
    (transformers names). layer_weights: the dataclass its layer op takes the layer's tensors as
    (v4train.reference.lora.bind fills it). layer_op: the op that computes one decoder layer. carries: its layer op
    takes the previous layer's carry and returns its own (GLM-5's DSA selection). zero_centered_norm:
    the decoder and final norms scale by 1 + w (weights initialised to 0). attention_targets: what
    --lora_target_modules=attention means. frozen: substrings of weights that never train (as in
    transformers: buffers, or computed without gradient). lora_excluded: substrings of weights
    that are never adapted. config_class: its config dataclass. check(cfg, need): the config's
    own ranges (models.config.check_values). ops: its ops (the layer op and the family's own
    blocks). architecture(cfg): the class a saved text model's config.json names, where the
    checkpoint read named another (a vision-language wrapper)."""

    name: str
    model_types: tuple[str, ...]
    parse: Callable
    layer_specs: Callable
    layer_weights: type
    layer_op: str
    carries: bool
    zero_centered_norm: bool
    attention_targets: tuple[str, ...]
    config_class: type
    check: Callable
    ops: tuple[Op, ...]
    frozen: tuple[str, ...] = ()
    lora_excluded: tuple[str, ...] = ("layernorm", "norm.")
    architecture: Callable | None = None

    def is_frozen(self, name: str) -> bool:
        return any(s in name for s in self.frozen)
