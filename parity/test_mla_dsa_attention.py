"""v4_mla_dsa_attention at GLM-5's own attention widths (64 heads, a 576-wide latent, 32 indexer
heads of 128): the latent path and, on CUDA in bf16, its kernels (the fused indexer scores, the
sparse attention's forward and backward) against the reference, forward and every gradient.
The drawn samples of the registry cover the small and odd shapes; these the tiled ones: a
top-k that is not a whole number of the kernels' 32- or 64-key tiles, one that is, and one of
three 64-key tiles (the Hopper forward's double buffer turns over)."""

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
