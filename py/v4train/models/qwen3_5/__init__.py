"""Qwen3.5 / Qwen3.6 (`qwen3_5_moe`, `qwen3_5`), everything the family has of its own: its config
(config.py), its weight table (weights.py), its Gated DeltaNet block (deltanet.py), its gated
attention (attention.py), its MoE block (moe.py) and its decoder layer (layer.py), each op's
reference; and the family record. The C++ side is cc/models/qwen3_5."""

from __future__ import annotations

from v4train.models.family import Family
from v4train.models.qwen3_5 import attention, deltanet, layer, moe
from v4train.models.qwen3_5.config import Qwen35Config, check, parse_qwen3_5
from v4train.models.qwen3_5.weights import layer_specs
from v4train.op import F64, Op

OPS = (
    Op("v4_qwen3_5_moe", moe.v4_qwen3_5_moe, dtypes=F64, composite=True),
    Op("v4_gated_deltanet", deltanet.v4_gated_deltanet, dtypes=F64, composite=True),
    Op("v4_gated_attention", attention.v4_gated_attention, dtypes=F64, composite=True),
    Op("v4_qwen3_5_layer_forward", layer.v4_qwen3_5_layer_forward, dtypes=F64, composite=True),
)


def architecture(cfg: Qwen35Config) -> str:
    """The class transformers loads a saved text model with (a vision-language checkpoint's text part)."""
    return "Qwen3_5MoeForCausalLM" if cfg.is_moe else "Qwen3_5ForCausalLM"


FAMILY = Family(
    name="qwen3_5", model_types=("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_text"), parse=parse_qwen3_5,
    layer_specs=layer_specs, layer_weights=layer.Qwen35LayerWeights, layer_op="v4_qwen3_5_layer_forward",
    carries=False, zero_centered_norm=True,
    attention_targets=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"),
    config_class=Qwen35Config, check=check, ops=OPS, architecture=architecture,
    lora_excluded=("layernorm", "norm.", "mlp.gate.", "shared_expert_gate", "conv1d", "A_log", "dt_bias"),
)
