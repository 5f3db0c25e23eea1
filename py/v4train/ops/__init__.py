"""The ops. Each op's facts live in one file, v4train/ops/<op>.py, as `OP = OpInfo(...)` (its
reference, C++ entry, dtypes, parity samples, error cases and benchmark shapes); NAMES below is
the one list of them. A run resolves --cpp_ops once into an OpTable (`resolve`) and calls every
op through it; REFERENCE is the table with every op on its pure-PyTorch reference.
"""

from __future__ import annotations

import importlib

from v4train.ops.registry import CppOpUnavailable, ErrorCase, OpInfo, OpTable, parse_cpp_ops

NAMES = (
    "v4_embedding",
    "v4_rms_norm",
    "v4_mlp",
    "v4_glm5_moe",
    "v4_mla_dsa_attention",
    "v4_glm5_layer_forward",
    "v4_qwen3_5_layer_forward",
    "v4_cross_entropy_loss",
    "v4_adam_step",
    "v4_clip_grad_norm",
    "v4_causal_conv1d",
    "v4_gated_delta_rule",
    "v4_qwen3_5_moe",
    "v4_gated_deltanet",
    "v4_gated_attention",
)

OPS: dict[str, OpInfo] = {name: importlib.import_module(f"v4train.ops.{name.removeprefix('v4_')}").OP for name in NAMES}

REFERENCE = OpTable(OPS)


def resolve(spec: str) -> OpTable:
    """The table of a --cpp_ops value ('all', 'none' or a comma list of op names); fails now,
    naming the flag, if an op is unknown, has no C++ implementation, or is not built."""
    return OpTable(OPS, parse_cpp_ops(spec, OPS))


__all__ = ["NAMES", "OPS", "REFERENCE", "CppOpUnavailable", "ErrorCase", "OpInfo", "OpTable", "resolve"]
