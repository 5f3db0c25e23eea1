import torch


@torch.no_grad()
def v4_clip_grad_norm(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The global L2 norm of all gradients (fp32 scalar); when max_norm > 0, the gradients are
    scaled in place by min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_)."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return norm
