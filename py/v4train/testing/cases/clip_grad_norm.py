"""v4_clip_grad_norm: the global gradient norm, and clipping, in one call."""

import torch

from v4train.ops import OPS
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import Sample, layout, make_leaf, seed, shape, view_as_layout
from v4train.reference.clip_grad_norm import v4_clip_grad_norm


def samples(draw, dtype: torch.dtype, device) -> Sample:
    shapes = [shape(draw, 1, 3, 65) for _ in range(draw.integers(1, 4))]
    layouts = [layout(draw, writable=True) for _ in shapes]
    s = seed(draw)
    leaves = {f"g{i}": make_leaf(sh, layouts[i], dtype, device, s + i) for i, sh in enumerate(shapes)}
    max_norm = draw.sampled_from([0.0, 0.5, 1e6])  # off, clipping, not reached

    def build(lv):
        return ([view_as_layout(lv[f"g{i}"], layouts[i]) for i in range(len(shapes))], max_norm), {}

    return Sample(leaves, build, note=f"max_norm {max_norm}")


def lora_tensors(device, dtype) -> list[torch.Tensor]:
    """The rank-16 LoRA tensors of one GLM-5 MoE layer: its five attention projections and its
    256 routed experts (gate_up and down): 14 tensors, 77M values (the optimizer ops' benchmark)."""
    gen = torch.Generator().manual_seed(0)
    r = 16
    attention = [(r, 6144), (2048, r), (r, 2048), (64 * 256, r), (r, 6144), (576, r), (r, 512), (64 * 448, r),
                 (r, 64 * 256), (6144, r)]
    shapes = attention + [(256, r, 6144), (256, 4096, r), (256, r, 2048), (256, 6144, r)]
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shapes]


def _bench(device, dtype):
    grads = lora_tensors(device, dtype)
    return f"{len(grads)} tensors, {sum(g.numel() for g in grads) / 1e6:.0f}M values", (grads, 1.0)


CASE = OpCase(
    OPS["v4_clip_grad_norm"], samples=samples, benchmarks=(_bench,),
    errors=(
        ErrorCase("negative max_norm", lambda: ([torch.zeros(2)], -1.0), "max_norm must be a finite number >= 0, got -1"),
        ErrorCase("integer gradient", lambda: ([torch.zeros(2, dtype=torch.int64)], 1.0),
                  "grads[i] must be float32, bfloat16 or float16"),
        ErrorCase("an expanded gradient", lambda: ([torch.zeros(2, 1).expand(2, 3)], 1.0),
                  "grads[0] has elements that share memory"),
    ),
)
