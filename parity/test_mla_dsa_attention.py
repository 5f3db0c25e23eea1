"""v4_mla_dsa_attention at GLM-5's own attention widths (64 heads, a 576-wide latent, 32 indexer
heads of 128): the latent path and, on CUDA in bf16, its kernels (the fused indexer scores, the
sparse attention's forward and backward) against the reference, forward and every gradient.
The drawn samples of the registry cover the small and odd shapes; these the tiled ones: a
top-k that is not a whole number of the kernels' 32- or 64-key tiles, one that is, and one of
three 64-key tiles (the Hopper forward's double buffer turns over). The kernels are also judged
alone against their float64 truth (the end of this file), where the layer's chain of bf16
roundings cannot hide a wrong part of a gradient."""

import pytest
import torch

from parity.strategies import devices
from v4train.ops import OPS, REFERENCE
from v4train.testing.check import check_parity
from v4train.testing.cases.mla_dsa_attention import glm5_width_sample

NAME = "v4_mla_dsa_attention"
CASES = [("cpu", torch.float32)] + [("cuda", dt) for dt in (torch.bfloat16, torch.float32) if "cuda" in devices()]


@pytest.mark.parametrize("device,dtype", CASES, ids=[f"{d}-{str(t).removeprefix('torch.')}" for d, t in CASES])
@pytest.mark.parametrize("tokens,top_k", [(160, 50), (300, 64), (400, 130)])
def test_glm5_widths_match_the_reference(device, dtype, tokens, top_k):
    sample = glm5_width_sample(dtype, device, tokens, top_k)
    check_parity(OPS[NAME], OPS[NAME].cpp(), REFERENCE[NAME], sample, seed=1)


@pytest.mark.skipif("cuda" not in devices(), reason="the Hopper kernels' own cases")
@pytest.mark.parametrize("dtype,tokens,top_k,heads,index_heads", [
    (torch.bfloat16, 600, 300, 64, 32),  # five 64-key tiles: the key-id ring's slots are reused
    (torch.float16, 600, 300, 64, 32),   # the float16 instances
    (torch.bfloat16, 300, 100, 80, 32),  # a second block of heads with 16 of its 64 rows valid
    (torch.bfloat16, 300, 100, 64, 3),   # an odd number of indexer heads
], ids=["bf16-ring", "fp16", "bf16-80-heads", "bf16-3-indexer-heads"])
def test_glm5_widths_on_cuda(dtype, tokens, top_k, heads, index_heads):
    sample = glm5_width_sample(dtype, "cuda", tokens, top_k, heads=heads, index_heads=index_heads)
    check_parity(OPS[NAME], OPS[NAME].cpp(), REFERENCE[NAME], sample, seed=1)


SMALL_BLOCKS = 64 * 1024  # bytes of scores per block: a few queries each at these widths


def _scores64(sample) -> dict[int, torch.Tensor]:
    """The indexer's scores of the sample's documents in float64, by document start."""
    from v4train.testing.check import in_float64
    from v4train.models.glm5 import attention as ref

    recorded, plain = [], ref.index_scores

    def record(q, k, head_weights, head_dim):
        recorded.append(plain(q, k, head_weights, head_dim))
        return recorded[-1]

    args, kwargs = in_float64(sample).build(in_float64(sample).leaves)
    saved = ref.index_scores, ref.SCORE_DTYPE
    ref.index_scores, ref.SCORE_DTYPE = record, torch.float64
    try:
        with torch.no_grad():
            REFERENCE[NAME](*args, **kwargs)
    finally:
        ref.index_scores, ref.SCORE_DTYPE = saved
    return recorded


def _selected_scores(scores: torch.Tensor, selection: torch.Tensor, first: int) -> torch.Tensor:
    """Per query from `first` on: the float64 scores of its selected keys, largest first."""
    rows = selection[first:]
    picked = scores[first:first + len(rows)].gather(1, rows.clamp(min=0))
    return picked.masked_fill(rows < 0, float("-inf")).sort(-1, descending=True).values


def test_the_blocked_selection_selects_keys_of_the_same_scores():
    """With blocks of a few queries (set_block_bytes), the CPU indexer scores each block of queries
    on its own (the path documents beyond about 2,900 tokens take); its selection must pick, for
    every query, keys of the same float64 index scores as the reference's (compared by scores:
    keys of equal score, ReLU zeros among them, may be picked either way). A selection with one
    key swapped for the next-best fails that comparison."""
    import v4_mla_dsa_attention as module
    from v4train.testing.compare import assert_close

    tokens, top_k = 300, 64
    sample = glm5_width_sample(torch.float32, "cpu", tokens, top_k)
    args, kwargs = sample.build({k: v.detach() for k, v in sample.leaves.items()})
    previous = module.set_block_bytes(SMALL_BLOCKS)
    try:
        with torch.no_grad():
            _, ours = module.v4_mla_dsa_attention(*args, **kwargs)
    finally:
        module.set_block_bytes(previous)
    with torch.no_grad():
        _, theirs = REFERENCE[NAME](*args, **kwargs)
    (scores,) = _scores64(sample)
    expected = _selected_scores(scores, theirs, top_k)
    assert_close(_selected_scores(scores, ours, top_k).float(), expected.float(), "blocked selection's scores",
                 truth=expected)
    wrong = ours.clone()
    best_left_out = scores[top_k:].masked_fill(torch.zeros_like(scores[top_k:], dtype=torch.bool).scatter_(
        1, ours[top_k:].clamp(min=0), True), float("-inf")).argmax(-1)
    wrong[top_k + 7, 0], wrong[top_k + 7, 1] = best_left_out[7], best_left_out[7]  # a key lost, the next-best twice
    with pytest.raises(AssertionError):
        assert_close(_selected_scores(scores, wrong, top_k).float(), expected.float(), "wrong", truth=expected)


def test_the_blocked_paths_match_the_reference():
    """The same small blocks through the whole op: the blocked indexer and the blocked sparse
    attention, forward and every gradient."""
    import v4_mla_dsa_attention as module

    previous = module.set_block_bytes(SMALL_BLOCKS)
    try:
        check_parity(OPS[NAME], OPS[NAME].cpp(), REFERENCE[NAME], glm5_width_sample(torch.float32, "cpu", 300, 64), seed=1)
    finally:
        module.set_block_bytes(previous)


# ---- The op's sparse kernels alone, against their float64 truth. Through the layer, a bf16
# gradient carries the rounding of a chain of projections, norms and RoPE (at GLM-5's widths the
# bf16 reference's own error is 4-20% of a weight's gradient), so a kernel's wrong part of a
# gradient can pass there; here only the kernel's own rounding stands against it.

def sparse_attention(q, kv, idx, scale, value_dims):
    """softmax(q kv[idx]^T scale) kv[idx][:, :value_dims] by a gather: what
    sparse_latent_attention computes, in the inputs' dtype."""
    sel = kv[idx]  # [Lq, K, D]
    s = torch.einsum("qhd,qkd->qhk", q, sel) * scale
    return torch.einsum("qhk,qkc->qhc", s.softmax(-1), sel[..., :value_dims])


SPARSE_ALONE = [("cpu", torch.float32, 4, 24, 16)] + [
    ("cuda", dtype, heads, D, C) for dtype in (torch.bfloat16, torch.float16)
    for heads, D, C in [(64, 576, 512), (80, 576, 512), (16, 136, 128)]]


@pytest.mark.parametrize("device,dtype,heads,D,C", SPARSE_ALONE,
                         ids=[f"{d}-{str(t).removeprefix('torch.')}-{h}x{D}" for d, t, h, D, _ in SPARSE_ALONE])
@pytest.mark.parametrize("top_k", [64, 256, 300])
def test_the_sparse_attention_alone_matches_its_truth(device, dtype, heads, D, C, top_k):
    """GLM-5's widths (64 heads of a 576-wide latent: the wgmma kernels; 80 heads: a second block
    of heads 16 rows valid) and another (the mma.sync kernels); one whole 64-key tile, four (two
    pairs: the forward's warpgroups take a tile each) and five partial ones (the last pair half
    empty); scores about 2.5 apart (the online softmax rescales across tiles). Forward, dq and dkv
    within the dtype's tolerance of the float64 truth, or twice the error of the same computation
    in torch (compare.assert_close)."""
    import v4_mla_dsa_attention as module
    from v4train.testing.compare import assert_close

    if device not in devices():
        pytest.skip("no GPU")
    gen = torch.Generator().manual_seed(heads + D + top_k)
    queries, keys = 40, 700
    # the dtype's values, the same in every run
    q, kv = torch.randn(queries, heads, D, generator=gen).to(dtype), torch.randn(keys, D, generator=gen).to(dtype)
    dout = torch.randn(queries, heads, C, generator=gen).to(dtype)
    idx = torch.stack([torch.randperm(keys, generator=gen)[:top_k] for _ in range(queries)]).to(device)
    scale = 2.5 / D ** 0.5
    runs = {}
    for name, fn, dt in [("truth", sparse_attention, torch.float64), ("expected", sparse_attention, dtype),
                         ("actual", module.sparse_latent_attention, dtype)]:
        leaves = [t.to(device, dt, copy=True).requires_grad_() for t in (q, kv)]
        out = fn(*leaves, idx, scale, C)
        out.backward(dout.to(device, dt))
        runs[name] = (out, *(t.grad for t in leaves))
    for i, what in enumerate(["out", "dq", "dkv"]):
        assert_close(runs["actual"][i], runs["expected"][i], f"sparse_latent_attention {what}", truth=runs["truth"][i])


@pytest.mark.skipif("cuda" not in devices(), reason="the device's indexer kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads,d", [(32, 128), (3, 128), (4, 64)])
def test_the_indexer_scores_alone_match_their_truth(dtype, heads, d):
    """GLM-5's head width (128: the wgmma kernel; 32 heads and an odd 3) and another (64); 100
    queries from query 300 (a block of 64 and a partial one) against 400 keys (a 256-key tile and
    a partial one, causal). Float32 scores of bf16 values: within float32's tolerance of the
    float64 truth, or twice the error of the reference's index_scores in float32."""
    import v4_mla_dsa_attention as module
    from v4train.models.glm5.attention import index_scores
    from v4train.testing.compare import assert_close

    gen = torch.Generator().manual_seed(heads * d)
    first, Nk = 300, 400  # the document's queries first.. against its keys
    q = torch.randn(Nk, heads, d, generator=gen).to(dtype)
    k = torch.randn(Nk, d, generator=gen).to(dtype)
    w = torch.randn(Nk, heads, generator=gen)
    actual = module.indexer_scores(q[first:].cuda(), k.cuda(), w[first:].cuda(), first, d ** -0.5)
    expected = index_scores(q.float(), k.float(), w, d)[first:]
    truth = index_scores(q.double(), k.double(), w.double(), d)[first:]
    assert_close(actual.cpu(), expected, "indexer_scores", truth=truth)


def test_the_kernels_alone_refuse_what_they_cannot_take():
    """The test entry points name the tensor and what was expected: a selection with an unused
    slot (-1, which the op's sparse path never gets), mismatched widths, and the indexer scores
    where no device kernel covers the inputs (the CPU)."""
    import v4_mla_dsa_attention as module

    q, kv = torch.randn(2, 4, 24), torch.randn(10, 24)
    with pytest.raises(ValueError, match=r"idx must lie in \[0, 10\)"):
        module.sparse_latent_attention(q, kv, torch.tensor([[0, -1], [1, 2]]), 1.0, 16)
    with pytest.raises(ValueError, match="expected q \\[Lq, nh, D\\], kv \\[L, D\\]"):
        module.sparse_latent_attention(q, torch.randn(10, 20), torch.tensor([[0, 1], [1, 2]]), 1.0, 16)
    with pytest.raises(ValueError, match="indexer_scores: no device kernel covers q"):
        module.indexer_scores(torch.randn(3, 2, 8), torch.randn(5, 8), torch.randn(3, 2), 2, 1.0)
