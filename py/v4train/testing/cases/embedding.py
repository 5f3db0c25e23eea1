"""v4_embedding: the token embedding, ids checked against the vocabulary."""

import torch

from v4train.ops import OPS
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import Sample, make_leaf, seed, shape, size
from v4train.reference.embedding import v4_embedding


def samples(draw, dtype: torch.dtype, device) -> Sample:
    vocab, hidden = size(draw, 300), size(draw, 100)
    ids_shape = shape(draw, 1, 2, 70)
    s = seed(draw)
    ids = torch.randint(0, vocab, ids_shape, generator=torch.Generator().manual_seed(s)).to(device)

    def build(leaves):
        return (ids, leaves["weight"]), {}

    return Sample({"weight": make_leaf((vocab, hidden), "contiguous", dtype, device, s)}, build, note=f"ids {ids_shape}")


def _bench(device, dtype):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 154880, (16384,), generator=gen).to(device)
    w = (0.02 * torch.randn(154880, 6144, generator=gen)).to(device=device, dtype=dtype).requires_grad_()
    return "ids [16384], weight [154880, 6144]", (ids, w)


CASE = OpCase(
    OPS["v4_embedding"], samples=samples, benchmarks=(_bench,),
    errors=(
        ErrorCase("id past the vocabulary", lambda: (torch.tensor([0, 5]), torch.zeros(5, 3)),
                  "input_ids must lie in [0, 5), got [0, 5]"),
        ErrorCase("negative id", lambda: (torch.tensor([-1, 2]), torch.zeros(5, 3)), "input_ids must lie in [0, 5), got [-1, 2]"),
        ErrorCase("int32 ids", lambda: (torch.tensor([0, 1], dtype=torch.int32), torch.zeros(5, 3)), "input_ids must be int64"),
    ),
)
