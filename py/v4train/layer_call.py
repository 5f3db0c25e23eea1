"""What a layer op is called with besides its input, weights and config (cc/common/layer_call.h
reads the same fields): where the tokens sit in the packed batch (`Batch`) and how the layer runs
(`LayerOptions`, the expert-parallel group among them). This module imports nothing of
v4train's: every layer may use it."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Batch:
    """positions [T] int64, restarting at 0 at each document; cu_seqlens [N + 1] int64 on the
    CPU: the document boundaries (attention, the convolution and the delta rule never cross them)."""

    positions: torch.Tensor
    cu_seqlens: torch.Tensor


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """The expert-parallel group of the MoE ops: `size` ranks of the torch.distributed group
    registered as `group` (its group_name), rank `rank` holding the E / size consecutive experts
    from rank * E / size. size 1: no group, every expert here."""

    group: str = ""
    rank: int = 0
    size: int = 1


@dataclasses.dataclass(frozen=True)
class LayerOptions:
    """lora_scaling: alpha / r of the layer's adapters; lora_dropout: the dropout probability on an
    adapter's input (0 when not training); checkpoint: keep only the layer's input for the backward
    pass and recompute the layer there (activation checkpointing); expert_parallel: the MoE
    block's group (its routed experts' weights are this rank's share); checkpoint_block: the
    tokens a block of a checkpointed layer's MLP or MoE takes (cc/common/checkpoint.h; 0: as many
    as the C++ op's memory budget for them holds; tests shrink it)."""

    lora_scaling: float = 0.0
    lora_dropout: float = 0.0
    checkpoint: bool = False
    expert_parallel: ExpertParallel = ExpertParallel()
    checkpoint_block: int = 0
