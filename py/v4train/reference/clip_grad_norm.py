import torch
import torch.distributed as dist


@torch.no_grad()
def v4_clip_grad_norm(grads: list[torch.Tensor], max_norm: float, group: str | None = None,
                      copies: list[int] | None = None) -> torch.Tensor:
    """The global L2 norm of all gradients (fp32 scalar); when max_norm > 0, the gradients are
    scaled in place by min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_). With
    `group` (a torch.distributed group's name) the gradients are each rank's shards (FSDP2's): the
    norm is sqrt of the sum over the ranks of each rank's sum of squares; copies[i] (default 1) ranks
    hold the same grads[i] (a replicated weight), counted once."""
    if copies is not None and (group is None or len(copies) != len(grads) or min(copies, default=1) < 1):
        raise ValueError(f"v4_clip_grad_norm: copies needs a group and one count >= 1 per gradient, got {copies} "
                         f"for {len(grads)}")
    norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]) if grads else torch.zeros(1)
    if group is None:
        norm = torch.linalg.vector_norm(norms)
    else:
        square = norms.square()
        square = (square / torch.tensor(copies, dtype=torch.float32, device=square.device) if copies else square).sum()
        dist.all_reduce(square, group=dist.distributed_c10d._resolve_process_group(group))
        norm = square.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return norm
