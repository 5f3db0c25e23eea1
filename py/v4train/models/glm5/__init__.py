"""GLM-5 (`glm_moe_dsa`), everything the family has of its own: its config (config.py), its weight
table (weights.py), its attention (MLA with the DSA indexer, attention.py), its MoE block
(moe.py) and its decoder layer (layer.py), each op's reference; and the family record. The C++
side is cc/models/glm5."""

from __future__ import annotations

from v4train.models.family import Family
from v4train.models.glm5 import attention, layer, moe
from v4train.models.glm5.config import Glm5Config, check, parse_glm5
from v4train.models.glm5.weights import layer_specs
from v4train.op import F64, Op

OPS = (
    Op("v4_glm5_moe", moe.v4_glm5_moe, dtypes=F64, composite=True),
    Op("v4_mla_dsa_attention", attention.v4_mla_dsa_attention, dtypes=F64, composite=True),
    Op("v4_glm5_layer_forward", layer.v4_glm5_layer_forward, dtypes=F64, composite=True),
)

FAMILY = Family(
    name="glm5", model_types=("glm_moe_dsa",), parse=parse_glm5, layer_specs=layer_specs,
    layer_weights=layer.Glm5LayerWeights, layer_op="v4_glm5_layer_forward", carries=True, zero_centered_norm=False,
    attention_targets=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
    config_class=Glm5Config, check=check, ops=OPS,
    # transformers keeps the routing bias as a buffer and runs the DSA indexer without gradient.
    frozen=("e_score_correction_bias", ".indexer."),
    lora_excluded=("layernorm", "norm.", "mlp.gate.", "indexer."),
)
