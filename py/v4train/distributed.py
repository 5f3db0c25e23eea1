"""Many processes: the world torchrun starts (one process per device), data parallel with FSDP2
over the decoder layers. docs/distributed.md says what each rank holds and computes.

The trainer asks this module three things: which rank it is and on which device (`World`, from
torchrun's environment), how to shard the model (`shard`: fully_shard per decoder layer, then the
root for the embeddings, final norm and LM head), and how to move a sharded tensor between its
shard and its whole (`whole`, `assign`) for checkpoints. FSDP2 averages the gradients over the
ranks (gloo has no pre-scaled sum), so each rank's loss is divided by the global batch's target
count over the world size: the average is the gradient of the global batch's mean loss.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor


@dataclasses.dataclass(frozen=True)
class World:
    """This process's place: rank of size (1: no process group), its local rank (its device on the
    node), and the name of the default group (what the C++ collectives resolve)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    group: str | None = None

    @property
    def main(self) -> bool:
        """Rank 0: the one that logs, plots and writes."""
        return self.rank == 0

    def sum(self, values: list[float], device: str) -> list[float]:
        """Each value summed over the ranks (float64; one collective), for what the step logs."""
        if self.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()

    def gather(self, value) -> list:
        """Every rank's `value` (plain values and CPU tensors), in rank order (one collective)."""
        if self.size == 1:
            return [value]
        out = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def launched() -> bool:
    """Whether torch's launcher (torchrun / torch.distributed.run) started this process."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def join(device: str, timeout_s: float) -> World:
    """The world of a process torchrun started: the process group initialised (NCCL on CUDA, gloo
    on the CPU) with `timeout_s` for every collective, and on CUDA this rank's device made the
    current one (LOCAL_RANK). A process started without torchrun is a world of one."""
    if not launched() or int(os.environ["WORLD_SIZE"]) == 1:
        return World()
    rank, size, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        if local >= torch.cuda.device_count():
            raise ValueError(f"--nproc_per_node: local rank {local} has no GPU of its own (this machine has "
                             f"{torch.cuda.device_count()}): start at most one process per GPU")
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return World(rank, size, local, dist.group.WORLD.group_name)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shard(model, world: World) -> None:
    """FSDP2 over the model: each decoder layer one unit (its weights, scales and adapters
    gathered before its op runs, forward and backward, and freed after), the root the rest.
    A layer's op reads its weights from the module at each call (DecoderLayer.sharded), so it sees
    the gathered tensors; its C++ recomputation in the backward pass runs after FSDP2 has gathered
    them again."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if world.size == 1:
        return
    for layer in model.layers:
        layer.sharded = True
        fully_shard(layer)
    fully_shard(model)
    register_fsdp_forward_method(model, "loss")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of t (t itself when not sharded), sharing t's storage."""
    return t._local_tensor if isinstance(t, DTensor) else t


def whole(like: torch.Tensor, shard_: torch.Tensor) -> torch.Tensor:
    """The whole tensor whose shard on this rank is `shard_`, sharded as `like` is (every rank
    calls it: a collective). `like` not sharded: shard_ itself."""
    if not isinstance(like, DTensor):
        return shard_
    return DTensor.from_local(shard_, like.device_mesh, like.placements, shape=like.shape,
                              stride=like.stride()).full_tensor()


def assign(dst: torch.Tensor, full: torch.Tensor, like: torch.Tensor | None = None) -> None:
    """Copies the whole tensor `full` into dst, a shard sharded as `like` (default: dst itself,
    a DTensor) or a plain tensor. Every rank holds `full` (each read the same checkpoint)."""
    like = dst if like is None else like
    with torch.no_grad():
        if isinstance(like, DTensor):
            part = distribute_tensor(full.to(like.device), like.device_mesh, like.placements,
                                     src_data_rank=None).to_local()
            local(dst).copy_(part)
        else:
            dst.copy_(full)
