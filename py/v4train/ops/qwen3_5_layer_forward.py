"""v4_qwen3_5_layer_forward: one Qwen3.5 decoder layer (Gated DeltaNet or gated attention, MoE or MLP)."""

from v4train.ops.registry import OpInfo
from v4train.reference.qwen3_5_layer_forward import v4_qwen3_5_layer_forward

OP = OpInfo("v4_qwen3_5_layer_forward", v4_qwen3_5_layer_forward, has_cpp=False, composite=True)
