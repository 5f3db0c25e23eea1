"""One Python face per op: each picks C++ or the reference by the run's --cpp_ops selection.

OPS lists every op; it is written out here (no registration by import side effect).
"""

from v4train.ops import model_ops, rms_norm
from v4train.ops.model_ops import (v4_adam_step, v4_clip_grad_norm, v4_cross_entropy_loss, v4_embedding,
                                   v4_glm5_layer_forward, v4_qwen3_5_layer_forward)
from v4train.ops.registry import CppOpUnavailable, OpInfo, parse_cpp_ops, self_check
from v4train.ops.registry import select_cpp_ops as _select
from v4train.ops.rms_norm import v4_rms_norm

OPS: dict[str, OpInfo] = {
    op.name: op
    for op in (rms_norm.OP, model_ops.EMBEDDING, model_ops.GLM5_LAYER, model_ops.QWEN3_5_LAYER, model_ops.CROSS_ENTROPY,
               model_ops.ADAM_STEP, model_ops.CLIP_GRAD_NORM)
}


def select_cpp_ops(spec: str) -> set[str]:
    """Applies a --cpp_ops value ('all', 'none' or a comma list); returns the ops now in C++."""
    return _select(spec, OPS)


__all__ = ["OPS", "CppOpUnavailable", "OpInfo", "parse_cpp_ops", "select_cpp_ops", "self_check", "v4_rms_norm", "v4_embedding",
           "v4_glm5_layer_forward", "v4_qwen3_5_layer_forward", "v4_cross_entropy_loss", "v4_adam_step",
           "v4_clip_grad_norm"]
