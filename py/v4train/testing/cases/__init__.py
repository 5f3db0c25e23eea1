"""The test case of every op (OpCase), one module each, in the order of v4train.ops.OPS:
CASES[name].samples, .errors, .benchmarks, and the op's own facts."""

from __future__ import annotations

from v4train.ops import OPS
from v4train.testing.case import OpCase
from v4train.testing.cases import adam_step
from v4train.testing.cases import causal_conv1d
from v4train.testing.cases import clip_grad_norm
from v4train.testing.cases import cross_entropy_loss
from v4train.testing.cases import embedding
from v4train.testing.cases import gated_attention
from v4train.testing.cases import gated_delta_rule
from v4train.testing.cases import gated_deltanet
from v4train.testing.cases import glm5_layer_forward
from v4train.testing.cases import glm5_moe
from v4train.testing.cases import mla_dsa_attention
from v4train.testing.cases import mlp
from v4train.testing.cases import qwen3_5_layer_forward
from v4train.testing.cases import qwen3_5_moe
from v4train.testing.cases import rms_norm

_MODULES = (
    adam_step,
    causal_conv1d,
    clip_grad_norm,
    cross_entropy_loss,
    embedding,
    gated_attention,
    gated_delta_rule,
    gated_deltanet,
    glm5_layer_forward,
    glm5_moe,
    mla_dsa_attention,
    mlp,
    qwen3_5_layer_forward,
    qwen3_5_moe,
    rms_norm,
)
_BY_NAME = {m.CASE.name: m.CASE for m in _MODULES}
_MISSING = sorted(set(OPS) - set(_BY_NAME))
if _MISSING:  # (an op registered half way: name the list it is missing from)
    raise ImportError(f"{', '.join(_MISSING)}: an Op in v4train/ops but no test case: add its module (cases/<op>.py, "
                      "CASE = OpCase(...)) to _MODULES in v4train/testing/cases/__init__.py")
CASES: dict[str, OpCase] = {name: _BY_NAME[name] for name in OPS}
