"""v4_cross_entropy_loss: the LM head and next-token cross-entropy, chunk by chunk."""

import torch

from v4train.ops import OPS
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import Sample, layout, make_leaf, seed, size, view_as_layout
from v4train.reference.cross_entropy_loss import v4_cross_entropy_loss


def samples(draw, dtype: torch.dtype, device) -> Sample:
    tokens, hidden, vocab = size(draw, 130), size(draw, 64), size(draw, 300)
    chunk = draw.sampled_from([1, 7, 64, 4096])
    s = seed(draw)
    gen = torch.Generator().manual_seed(s)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[torch.rand(tokens, generator=gen) < draw.sampled_from([0.0, 0.3, 1.0])] = -100
    targets = targets.to(device)
    h_layout = layout(draw)
    normalizer = float(draw.integers(1, 300))
    leaves = {"hidden": make_leaf((tokens, hidden), h_layout, dtype, device, s),
              "weight": make_leaf((vocab, hidden), "contiguous", dtype, device, s + 1, scale=0.5)}

    def build(lv):
        return (view_as_layout(lv["hidden"], h_layout), lv["weight"], targets, normalizer, chunk), {}

    return Sample(leaves, build, note=f"chunk {chunk}, normalizer {normalizer}, {int((targets == -100).sum())} ignored")


def _bench(device, dtype, tokens=16384):
    """GLM-5's LM head over a 16k-token batch: the reference keeps every chunk's logits."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, 6144, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    w = (0.02 * torch.randn(154880, 6144, generator=gen)).to(device=device, dtype=dtype).requires_grad_()
    t = torch.randint(0, 154880, (tokens,), generator=gen).to(device)
    return f"hidden [{tokens}, 6144], lm_head [154880, 6144], chunks of 4096", (h, w, t, float(tokens), 4096)


def _args(h=lambda: torch.zeros(50, 16), w=lambda: torch.zeros(90, 16), t=lambda: torch.zeros(50, dtype=torch.int64),
          normalizer=1.0, chunk=8):
    return lambda: (h(), w(), t(), normalizer, chunk)


CASE = OpCase(
    OPS["v4_cross_entropy_loss"], samples=samples, benchmarks=(_bench,),
    errors=(
        ErrorCase("int32 targets", _args(t=lambda: torch.zeros(50, dtype=torch.int32)), "targets must be int64"),
        ErrorCase("float64 weight", _args(w=lambda: torch.zeros(90, 16, dtype=torch.float64)),
                  "weight must be float32, bfloat16 or float16"),
        ErrorCase("mixed dtypes", _args(w=lambda: torch.zeros(90, 16, dtype=torch.bfloat16)), "weight is BFloat16 but hidden is Float"),
        ErrorCase("target past the vocabulary", _args(t=lambda: torch.full((50,), 100)), "targets must be -100 or lie in [0, 90)"),
        ErrorCase("too few targets", _args(t=lambda: torch.zeros(3, dtype=torch.int64)), "targets.size(0) must be hidden.size(0) = 50"),
        ErrorCase("normalizer 0", _args(normalizer=0.0), "normalizer must be a finite number > 0"),
        ErrorCase("chunk 0", _args(chunk=0), "chunk_tokens must be > 0"),
        ErrorCase("empty vocabulary", _args(w=lambda: torch.zeros(0, 16), t=lambda: torch.full((50,), -100)),
                  "weight.size(0) (the vocabulary) must be > 0, got shape [0, 16]"),
    ),
)
