"""Many processes: the world torchrun starts (one process per device), data parallel with FSDP2
over the decoder layers. docs/distributed.md says what each rank holds and computes.

The trainer asks this module which rank it is and on which device (`World`, from torchrun's
environment), how to shard the model (`shard_experts`: with --expert_parallel=N each rank keeps
E / N routed experts; `shard`: fully_shard per decoder layer, then the root for the embeddings,
final norm and LM head), what gradient sync FSDP2 leaves to it (`sync_experts`), and how to move a
sharded tensor between its shard and its whole (`whole`, `gathered`, `assign`) for checkpoints;
a rank that loads a checkpoint reads only its shards' rows (`fsdp_rows`, `fill_shards`).

The ranks form a [data parallel, expert parallel] mesh: expert-parallel groups of N consecutive
ranks, each holding all experts between them; the world / N groups are data-parallel replicas of
the experts. An expert's weights and adapters are DTensors on that mesh (Replicate, Shard(0));
every other weight is FSDP2's over the whole world. FSDP2 averages the gradients over the
ranks (gloo has no pre-scaled sum), so each rank's loss is divided by the global batch's target
count over the world size: the average is the gradient of the global batch's mean loss.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from v4train.atomic import kill_point
from v4train.layer_call import ExpertParallel


@dataclasses.dataclass(frozen=True)
class World:
    """This process's place: rank of size (1: no process group), its local rank (its device on the
    node), and the name of the default group (what the C++ collectives resolve)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    group: str | None = None
    expert_parallel: int = 1  # ranks of an expert-parallel group
    mesh: object = None  # the [dp, ep] DeviceMesh, with expert parallelism

    @property
    def main(self) -> bool:
        """Rank 0: the one that logs, plots and writes."""
        return self.rank == 0

    @property
    def shard(self) -> tuple[int, int] | None:
        """(rank, size): what hf_checkpoint.load reads of FSDP2's shards (None: one process, whole)."""
        return (self.rank, self.size) if self.size > 1 else None

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

    def broadcast(self, value):
        """Rank 0's `value` (a plain value), on every rank."""
        if self.size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def launched() -> bool:
    """Whether torch's launcher (torchrun / torch.distributed.run) started this process."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_size() -> int:
    """The processes of this run torch's launcher started (1 for a process it did not start)."""
    return int(os.environ["WORLD_SIZE"]) if launched() else 1


def check_divides(expert_parallel: int, processes: int, what: str) -> None:
    """--expert_parallel divides the processes (`what` names them), else a ValueError."""
    if processes % expert_parallel:
        raise ValueError(f"--expert_parallel={expert_parallel} does not divide {what}: each expert-parallel group is "
                         "that many ranks")


def join(device: str, timeout_s: float, expert_parallel: int = 1) -> World:
    """The world of a process torchrun started: the process group initialised (NCCL on CUDA, gloo
    on the CPU) with `timeout_s` for every collective, and on CUDA this rank's device made the
    current one (LOCAL_RANK). A process started without torchrun is a world of one.
    `expert_parallel` must divide the world size (ValueError naming both)."""
    size = launched_size()
    check_divides(expert_parallel, size, f"the {size} process(es) of this run (--nproc_per_node x nodes)")
    if size == 1:
        return World()
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        if local >= torch.cuda.device_count():
            raise ValueError(f"--nproc_per_node: local rank {local} has no GPU of its own (this machine has "
                             f"{torch.cuda.device_count()}): start at most one process per GPU")
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    mesh = None
    if expert_parallel > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device, (size // expert_parallel, expert_parallel), mesh_dim_names=("dp", "ep"))
    return World(rank, size, local, dist.group.WORLD.group_name, expert_parallel, mesh)


def expert_tensor(name: str) -> bool:
    """Whether a layer's tensor (its name under model.layers.{i}.) is a routed expert's: the
    packed [E, ...] weights, their scales and adapters."""
    return ".experts." in f".{name}"


def routed_experts(cfg) -> int:
    """The routed experts of each MoE layer of a model config (0: no MoE)."""
    return getattr(cfg, "n_routed_experts", 0) or getattr(cfg, "num_experts", 0)


def local_experts(cfg, world: World) -> tuple[int, int] | None:
    """(start, stop): the routed experts this rank holds with expert parallelism (None: all)."""
    if world.expert_parallel == 1:
        return None
    per_rank, ep_rank = routed_experts(cfg) // world.expert_parallel, world.rank % world.expert_parallel
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


def shard_experts(model, world: World) -> None:
    """Each rank keeps its expert-parallel rank's E / N consecutive routed experts of every MoE
    layer (weights, FP8 scales, LoRA factors: DTensors on the mesh, replicated over the
    data-parallel dimension), and its layer ops exchange the routed rows within its group. A
    tensor of all E experts is cut to this rank's; one of E / N (read so from the checkpoint,
    hf_checkpoint.load's `experts`) is taken as this rank's."""
    if world.expert_parallel == 1:
        return
    from v4train.model import put_parameter

    n, ep, E = world.expert_parallel, world.mesh["ep"], routed_experts(model.cfg)
    options = ExpertParallel(ep.get_group().group_name, ep.get_local_rank(), n)
    placements = [Replicate(), Shard(0)]
    for layer in model.layers:
        experts = {k: p for k, p in layer.named_parameters() if expert_tensor(k)}
        for k, p in experts.items():
            if p.shape[0] == E:
                shard = distribute_tensor(p.detach(), world.mesh, placements, src_data_rank=None)
            else:
                shard = DTensor.from_local(p.detach(), world.mesh, placements, run_check=False,
                                           shape=(E, *p.shape[1:]), stride=(p[0].numel(), *p.stride()[1:]))
            put_parameter(layer, k, shard, requires_grad=p.requires_grad)
        if experts:
            layer.expert_parallel = options


def fsdp_rows(n: int, rank: int, size: int) -> tuple[int, int]:
    """The rows (start, stop) of dim 0 that FSDP2's Shard(0) gives `rank` of `size` ranks of a
    tensor of n rows: torch.chunk's split, ceil(n / size) rows a rank, the last ranks fewer or
    none (fully_shard's _chunk_with_empty). fill_shards checks each shard's shape against it."""
    per_rank = -(-n // size)
    start = min(rank * per_rank, n)
    return start, min(start + per_rank, n)


def fill_shards(model, rows: dict[str, torch.Tensor]) -> None:
    """Makes the model's meta parameters, now FSDP2's (after `shard`), this rank's rows of the
    checkpoint (hf_checkpoint.load's `shard`: its report's 'rows' {name: rows}). Rows that are not
    the shape of FSDP2's shard, or a meta parameter left without rows, are a ValueError naming it."""
    from torch import nn

    for name, part in rows.items():
        p = model.get_parameter(name)
        if not isinstance(p, DTensor) or local(p).shape != part.shape:
            held = f"its FSDP2 shard is {list(local(p).shape)}" if isinstance(p, DTensor) else "FSDP2 does not shard it"
            raise ValueError(f"{name}: rank {dist.get_rank()} read rows of shape {list(part.shape)} from the "
                             f"checkpoint, but {held}")
        # FSDP2 takes the new local tensor at its lazy init (FSDPParam.reset_sharded_param)
        torch.utils.swap_tensors(p, nn.Parameter(as_sharded(p, part), requires_grad=p.requires_grad))
    left = [n for n, p in model.named_parameters() if local(p).is_meta]
    if left:
        raise ValueError(f"{left[0]}: on the meta device after loading ({len(left)} such): no rows were read for it")


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """The end of a process that was one rank of a group (after leave()), without Python's
    finalisation: gloo's worker threads drop their last reference to a collective's tensors after
    its wait returns, and one that does so while the interpreter finalises cannot take the GIL,
    exits the thread, and aborts the process ("terminate called without an active exception",
    SIGABRT: a finished run reported failed; a core dump's stack showed ProcessGroupGloo::runLoop ->
    ~AsyncWork -> THPVariable_clear -> take_gil -> pthread_exit). Every file is closed by then."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to say there
            pass
    os._exit(code)


def shard(model, world: World) -> None:
    """FSDP2 over the model: each decoder layer one unit (its weights, scales and adapters
    gathered before its op runs, forward and backward, and freed after), the root the rest.
    A layer's op reads its weights from the module at each call (DecoderLayer.sharded), so it sees
    the gathered tensors; its C++ recomputation in the backward pass runs after FSDP2 has gathered
    them again."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if world.size == 1:
        return
    # The experts of expert parallelism are this rank's already (shard_experts): FSDP2 leaves them.
    experts = {p for layer in model.layers for k, p in layer.named_parameters()
               if expert_tensor(k) and world.expert_parallel > 1} or None
    for layer in model.layers:
        layer.sharded = True
        fully_shard(layer, ignored_params=experts)
    fully_shard(model, ignored_params=experts)
    register_fsdp_forward_method(model, "loss")


def sync_experts(params: list[torch.Tensor], world: World) -> None:
    """The experts' gradients, which FSDP2 does not hold, made the global batch's: each arrived
    through the all-to-all from every rank of its expert-parallel group, of losses scaled by the
    world size (for FSDP2's average); summed over the data-parallel replicas and divided by the
    world size."""
    if world.expert_parallel == 1:
        return
    replicas = world.mesh["dp"].get_group()
    for p in params:
        if isinstance(p, DTensor) and p.grad is not None and p.device_mesh is world.mesh:
            g = local(p.grad)
            if world.size > world.expert_parallel:
                dist.all_reduce(g, group=replicas)
            g.div_(world.size)


def copies(t: torch.Tensor) -> int:
    """How many ranks hold the same shard of t: the sizes of the mesh dimensions it is replicated
    over (1 for FSDP2's shards and for a tensor of one process)."""
    if not isinstance(t, DTensor):
        return 1
    n = 1
    for size, placement in zip(t.device_mesh.shape, t.placements):
        n *= size if isinstance(placement, Replicate) else 1
    return n


SHARDED = "optimizer"  # a checkpoint's folder of the optimizer state's shards: rank{r}.safetensors a rank


def shard_file(folder: str, rank: int) -> str:
    """Where rank `rank` keeps its shards of the optimizer state in the checkpoint `folder`."""
    return os.path.join(folder, SHARDED, f"rank{rank}.safetensors")


def as_sharded(like: torch.Tensor, shard_: torch.Tensor) -> torch.Tensor:
    """shard_ (this rank's part, sharing its storage) as the DTensor sharded as `like` is."""
    if not isinstance(like, DTensor):
        return shard_
    return DTensor.from_local(shard_, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def save_sharded(state: dict[str, torch.Tensor], world: World, folder: str | None) -> None:
    """Each rank writes its shards `state` (by name) to shard_file under rank 0's `folder` (the other
    ranks pass None and get its name from rank 0): safetensors, so that a checkpoint holds no pickle
    (torch.distributed.checkpoint's .metadata is one, and unpickling it runs whatever it names). A
    collective: every rank returns once all have written, and a write that failed on any rank is an
    OSError on every rank naming it (rank 0's checkpoint.save reports it; no rank waits)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    folder = world.broadcast(folder)
    error = None
    try:
        kill_point("optimizer-shards")  # (the tests' fault injection)
        os.makedirs(os.path.join(folder, SHARDED), exist_ok=True)
        save_file({k: t.detach().cpu().contiguous() for k, t in state.items()}, shard_file(folder, world.rank))
    except (OSError, RuntimeError, SafetensorError) as e:
        error = f"rank {world.rank}: {e}"
    errors = [e for e in world.gather(error) if e]
    if errors:
        raise OSError("; ".join(errors))


def load_sharded(state: dict[str, torch.Tensor], folder: str, rank: int) -> None:
    """Fills `state` (this rank's shards, by name) from its shard_file under `folder`, written by a
    run of the same layout: a name it lacks or adds, or a shard of another shape, is a ValueError
    naming it. An optimizer/ of torch.distributed.checkpoint (an earlier v4train's) is refused
    unread: its .metadata is a pickle."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = shard_file(folder, rank)
    if not os.path.exists(path):
        if os.path.exists(os.path.join(folder, SHARDED, ".metadata")):
            raise ValueError("holds torch.distributed.checkpoint's files (an earlier v4train's), whose .metadata is "
                             "a pickle, which v4train does not unpickle (it could run code); resume with the version "
                             "that wrote it, or start a new run from the checkpoint's adapter or weights")
        raise ValueError(f"lacks {os.path.basename(path)}, rank {rank}'s shards")
    try:
        saved = load_file(path)
    except (OSError, SafetensorError) as e:
        raise ValueError(f"{os.path.basename(path)}: not a safetensors file ({e})") from None
    missing, extra = sorted(set(state) - set(saved)), sorted(set(saved) - set(state))
    if missing or extra:
        raise ValueError(f"{os.path.basename(path)}: " + "; ".join(
            f"{what} {names[:3]}" for what, names in (("lacks", missing), ("has more", extra)) if names)
            + " (was the checkpoint made with other trainable weights?)")
    for key, t in state.items():
        if saved[key].shape != t.shape or not saved[key].is_floating_point():
            raise ValueError(f"{os.path.basename(path)}: {key} is {saved[key].dtype} {tuple(saved[key].shape)}, "
                             f"expected a floating shard of {tuple(t.shape)}")
        t.copy_(saved[key])


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of t (t itself when not sharded), sharing t's storage."""
    return t._local_tensor if isinstance(t, DTensor) else t


def whole(like: torch.Tensor, shard_: torch.Tensor) -> torch.Tensor:
    """The whole tensor whose shard on this rank is `shard_`, sharded as `like` is (every rank
    calls it: a collective). `like` not sharded: shard_ itself."""
    return as_sharded(like, shard_).full_tensor() if isinstance(like, DTensor) else shard_


def gathered(tensors: dict[str, torch.Tensor]):
    """(name, whole tensor) of each of `tensors` (shards or plain), in order, each gathered as it
    is taken: every rank takes them all in the same order (each gather is a collective), and one
    that lets each go before taking the next holds one gathered tensor at a time."""
    for name, t in tensors.items():
        yield name, whole(t, local(t).detach())


def take_part(gathers) -> None:
    """A rank other than the writer's share of `gathered(...)`: each gather joined, in order, and
    let go at once, while rank 0 writes what it takes."""
    collections.deque(gathers, maxlen=0)


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
