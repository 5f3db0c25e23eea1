"""The ops: the one list of them (OPS: the shared blocks here, each family's own from its package),
REFERENCE (every op on its pure-PyTorch reference), and `resolve`, which turns --cpp_ops into the
run's OpTable once. What the tests need of an op (its parity samples, error cases, benchmark
shapes) is v4train/testing/cases/<op>.py.
"""

from __future__ import annotations

from v4train.models import glm5, qwen3_5
from v4train.op import F64, CppOpUnavailable, Op, OpTable, parse_cpp_ops
from v4train.reference import adam_step
from v4train.reference import causal_conv1d
from v4train.reference import clip_grad_norm
from v4train.reference import cross_entropy_loss
from v4train.reference import embedding
from v4train.reference import gated_delta_rule
from v4train.reference import mlp
from v4train.reference import rms_norm

class _Registry(dict):
    def __missing__(self, name):  # (an op registered half way: its test case names it first)
        raise KeyError(f"{name}: no Op record in OPS (v4train/ops/__init__.py, or a family's OPS): add "
                       f"Op(\"{name}\", <its reference>)")


OPS: dict[str, Op] = _Registry({op.name: op for op in (
    Op("v4_embedding", embedding.v4_embedding),
    Op("v4_rms_norm", rms_norm.v4_rms_norm, dtypes=F64),
    Op("v4_mlp", mlp.v4_mlp, dtypes=F64),
    Op("v4_cross_entropy_loss", cross_entropy_loss.v4_cross_entropy_loss),
    Op("v4_adam_step", adam_step.v4_adam_step, inplace=True),
    Op("v4_clip_grad_norm", clip_grad_norm.v4_clip_grad_norm, inplace=True),
    Op("v4_causal_conv1d", causal_conv1d.v4_causal_conv1d, dtypes=F64),
    Op("v4_gated_delta_rule", gated_delta_rule.v4_gated_delta_rule, dtypes=F64),
    # the families' own ops
    *glm5.OPS,
    *qwen3_5.OPS,
)})

REFERENCE = OpTable(OPS)


def resolve(spec: str) -> OpTable:
    """The table of a --cpp_ops value ('all', 'none' or a comma list of op names); fails now,
    naming the flag, if an op is unknown, has no C++ implementation, or is not built."""
    return OpTable(OPS, parse_cpp_ops(spec, OPS))


__all__ = ["OPS", "REFERENCE", "CppOpUnavailable", "Op", "OpTable", "resolve"]
