"""v4_gated_delta_rule: the chunked gated delta rule of Gated DeltaNet over packed documents."""

import functools

import torch

from v4train.testing.cases.mla_dsa_attention import packed
from v4train.ops import OPS
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import Sample, layout, make_leaf, seed, size, view_as_layout
from v4train.reference.gated_delta_rule import v4_gated_delta_rule


def chunk_documents(draw) -> list[int]:
    """Document lengths around the chunk of 64 (1, 63, 64, 65, two chunks and a bit), empty ones,
    at least one token."""
    lengths = [draw.sampled_from([0, 1, 2, 63, 64, 65, 130, size(draw, 100)]) for _ in range(draw.integers(1, 3))]
    return lengths if sum(lengths) else lengths + [1]


def _rows_of_norms(shape, lay: str, dtype, device, s: int) -> torch.Tensor:
    """q's or k's leaf, each token's row of each head scaled by its own factor exp(N(0, 1) / 2) (about
    0.37 to 2.7): the op normalises the rows, so a kernel that pairs one row's norm with another's
    gradient is wrong by their ratio, which rows of N(0, 1) (norms within a few percent of each
    other) hide inside the bfloat16 tolerance."""
    leaf = make_leaf(shape, lay, torch.float32, "cpu", s)
    factor = torch.exp(torch.randn(shape[:2], generator=torch.Generator().manual_seed(s + 5)) / 2)
    leaf *= factor[:, None, :] if lay == "transposed" else factor[:, :, None]  # the leaf's storage: [T, dk, heads]
    return leaf.to(dtype=dtype, device=device)


def leaves_for(lengths: list[int], heads: int, rep: int, dk: int, dv: int, dtype, device, s: int, lay: str = "contiguous",
               decay: float = 0.5):
    """q, k, v, g (log decay <= 0, from Qwen3.5's -exp(A) softplus(a + dt_bias), times `decay`: at
    0.5 a chunk of 64 tokens keeps about exp(-22) of the state it starts with, at 0.01 most of it,
    as the long-memory heads of a trained model do), beta in (0, 1)."""
    T, hv = sum(lengths), heads * rep
    g = -torch.nn.functional.softplus(torch.randn(T, hv, generator=torch.Generator().manual_seed(s + 3))) * decay
    beta = torch.rand(T, hv, generator=torch.Generator().manual_seed(s + 4))
    return {"q": _rows_of_norms((T, heads, dk), lay, dtype, device, s), "k": _rows_of_norms((T, heads, dk), "contiguous", dtype, device, s + 1),
            "v": make_leaf((T, hv, dv), lay, dtype, device, s + 2),
            "g": g.to(device=device, dtype=dtype).requires_grad_(), "beta": beta.to(device=device, dtype=dtype).requires_grad_()}


LONG_DOCUMENTS = [1, 63, 64, 65, 4097]


def long_documents(dtype, device, s: int) -> Sample:
    """Qwen3.5's head widths (128; 2 key heads serving 4 value heads) over documents of 1, 63, 64,
    65 and 4,097 tokens in one packed batch, under the slow decay at which the state crosses chunks:
    the only samples where the chunk decay's gradient (zero before a document's first chunk end and
    after its last) is a large part of g's."""
    leaves = leaves_for(LONG_DOCUMENTS, 2, 2, 128, 128, dtype, device, s, decay=0.01)
    cu = packed(LONG_DOCUMENTS, device)[1]
    return Sample(leaves, lambda lv: ((lv["q"], lv["k"], lv["v"], lv["g"], lv["beta"], cu), {}),
                  note=f"documents {LONG_DOCUMENTS}, Qwen3.5 widths")


class ScaledGradient(torch.autograd.Function):
    """x, its gradient times `factor`: through the reference's path hook, one path of a gradient
    computed that far off (a kernel's bug a judge must see)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def samples(draw, dtype: torch.dtype, device) -> Sample:
    lengths = chunk_documents(draw)
    heads, rep, dk, dv = draw.integers(1, 3), draw.sampled_from([1, 2]), size(draw, 16), size(draw, 16)
    lay, s, decay = layout(draw), seed(draw), draw.sampled_from([0.5, 0.01])  # 0.01: the state crosses chunks
    if draw.integers(0, 2) == 0:  # a third at Qwen3.5's widths: the CUDA kernels' own path for them (FixedDims)
        dk = dv = 128
    leaves = leaves_for(lengths, heads, rep, dk, dv, dtype, device, s, lay, decay)
    _, cu = packed(lengths, device)

    def build(lv):
        return (view_as_layout(lv["q"], lay), lv["k"], view_as_layout(lv["v"], lay), lv["g"], lv["beta"], cu.to(device)), {}

    return Sample(leaves, build, note=f"documents {lengths}, key heads {heads} x {rep}, dk {dk}, dv {dv}, layout {lay}, "
                                      f"decay {decay}")


def _bench(device, dtype, tokens=4096):
    """Qwen3.5-35B's linear attention: 16 key heads, 32 value heads, 128 dims, one document (the
    shape of the published fla and FlashQLA times: 8,192 and 32,768 tokens). cu_seqlens on the CPU,
    as the model passes it (Batch): the op plans its chunks on the host from it."""
    lv = leaves_for([tokens], 16, 2, 128, 128, dtype, device, 0)
    return f"{tokens} tokens, 16 key heads x 2, dims 128", (lv["q"], lv["k"], lv["v"], lv["g"], lv["beta"],
                                                              torch.tensor([0, tokens]))


def _call(v=lambda: torch.zeros(5, 2, 4), cu=lambda: torch.tensor([0, 5]), g=lambda: torch.zeros(5, 2)):
    return lambda: (torch.zeros(5, 2, 4), torch.zeros(5, 2, 4), v(), g(), torch.zeros(5, 2), cu())


CASE = OpCase(
    OPS["v4_gated_delta_rule"], samples=samples,
    benchmarks=(_bench, functools.partial(_bench, tokens=8192), functools.partial(_bench, tokens=32768)),
    errors=(
        ErrorCase("value heads not a multiple of key heads", _call(v=lambda: torch.zeros(5, 3, 4)),
                  "a multiple of the 2 key heads"),
        ErrorCase("cu_seqlens not ending at T", _call(cu=lambda: torch.tensor([0, 4])), "cu_seqlens must end at T=5, got [0, 4]"),
        ErrorCase("a growth (g > 0)", _call(g=lambda: torch.full((5, 2), 0.5)),
                  "g is a log decay and must be <= 0"),
    ),
)
