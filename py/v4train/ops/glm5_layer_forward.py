"""v4_glm5_layer_forward: one GLM-5 decoder layer (MLA + DSA attention, dense MLP or MoE)."""

from v4train.ops.registry import OpInfo
from v4train.reference.glm5_layer_forward import v4_glm5_layer_forward

OP = OpInfo("v4_glm5_layer_forward", v4_glm5_layer_forward, has_cpp=False, composite=True)
