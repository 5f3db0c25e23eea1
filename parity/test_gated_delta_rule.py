"""v4_gated_delta_rule beyond the drawn samples: the C++ op against the token-by-token recurrence
(the ground truth; the registry's parity compares it with the chunked reference), and packing:
a packed batch equals each document run alone, so no state leaks from one document into the next
(the Qwen3.5 training bug other trainers report most)."""

import functools
import re

import pytest
import torch

from parity.strategies import devices
from v4train.ops import OPS
from v4train.testing.compare import assert_close
from v4train.testing.cases.gated_delta_rule import ScaledGradient, leaves_for, long_documents
from v4train.testing.cases.mla_dsa_attention import packed
from v4train.reference import gated_delta_rule

OP = OPS["v4_gated_delta_rule"].cpp()
LENGTHS = [1, 63, 64, 65, 130, 7]
# The long documents' cases, named as test_ops' are: cpu-float32, ..., cuda-bfloat16.
LONG = [pytest.param(d, t, id=f"{d}-{str(t).removeprefix('torch.')}") for d in devices()
        for t in (torch.float32, torch.bfloat16)]


def _inputs(device, dtype=torch.float32, lengths=LENGTHS, seed=0):
    lv = leaves_for(lengths, 2, 2, 16, 8, dtype, device, seed)
    return [lv[n].detach() for n in ("q", "k", "v", "g", "beta")], packed(lengths, device)[1]


@pytest.mark.parametrize("device", devices())
def test_matches_the_recurrence_per_document(device):
    (q, k, v, g, beta), cu = _inputs(device, torch.float64)
    out = OP(q, k, v, g, beta, cu)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        want, _ = gated_delta_rule.recurrent(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e])
        assert_close(out[s:e], want[0], f"tokens {s}..{e} against the recurrence")


@pytest.mark.parametrize("device", devices())
def test_packed_documents_equal_each_alone(device):
    (q, k, v, g, beta), cu = _inputs(device)
    packed_out = OP(q, k, v, g, beta, cu)
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        alone = OP(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], torch.tensor([0, e - s], device=device))
        assert_close(packed_out[s:e], alone, f"document {s}..{e} packed vs alone")


@pytest.mark.parametrize("device", devices())
def test_no_state_crosses_a_boundary(device):
    """Changing every token of one document leaves the next document's outputs bit for bit."""
    (q, k, v, g, beta), cu = _inputs(device)
    first_end = LENGTHS[0] + LENGTHS[1] + LENGTHS[2]  # documents 0-2 changed, 3.. must not move
    v2, k2 = v.clone(), k.clone()
    v2[:first_end] += 10.0
    k2[:first_end] *= -1
    a, b = OP(q, k, v, g, beta, cu), OP(q, k2, v2, g, beta, cu)
    assert not torch.equal(a[:first_end], b[:first_end])
    assert torch.equal(a[first_end:], b[first_end:]), "a later document's output depends on an earlier one"


@pytest.mark.parametrize("device", devices())
def test_a_growth_is_refused_with_its_largest_value(device):
    """g > 0 anywhere is refused, naming g's largest value (on CUDA read after the kernels are
    queued: the op must still raise, and return nothing); a NaN is no growth."""
    (q, k, v, g, beta), cu = _inputs(device)
    grown = g.clone()
    grown[70, 1], grown[3, 0] = 0.75, 0.25
    with pytest.raises(ValueError, match=r"^v4_gated_delta_rule: g is a log decay and must be <= 0 .* got a largest "
                                         r"value of 0\.75$"):
        OP(q, k, v, grown, beta, cu)
    nan = g.clone()
    nan[5, 0] = float("nan")
    assert OP(q, k, v, nan, beta, cu)[5:].isnan().any()  # (not refused: computed, the NaN flowing on)


@pytest.mark.parametrize("device,dtype", LONG)
def test_qwen_widths_across_document_and_chunk_boundaries(device, dtype):
    """Qwen3.5's head widths (128; 2 key heads serving 4 value heads) over documents of 1, 63, 64,
    65 and 4,097 tokens in one packed batch: the recurrence across chunks (on CUDA its kernel,
    forward and backward) against the reference and its float64 truth, every gradient, g's and
    beta's included (a Hopper backward can be wrong in one gradient only: fla issue 640)."""
    from v4train.testing.check import check_parity
    from v4train.reference.gated_delta_rule import v4_gated_delta_rule as reference

    check_parity(OPS["v4_gated_delta_rule"], OP, reference, long_documents(dtype, device, 11), seed=3)


def _ran(prof, kernel: str) -> set[str]:
    """The names of `kernel`'s launches in a profile (its template arguments among them)."""
    return {e.name for e in prof.events() if f"{kernel}<" in e.name}


def _judged_on_cuda(sample, seed: int):
    """The profile of v4_gated_delta_rule's parity on `sample` (every output and gradient against the
    reference and its float64 truth)."""
    from v4train.testing.check import check_parity
    from v4train.reference.gated_delta_rule import v4_gated_delta_rule as reference

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        check_parity(OPS["v4_gated_delta_rule"], OP, reference, sample, seed=seed)
        torch.cuda.synchronize()
    return prof


def _prepare_blocks(prof) -> set[int]:
    """prepare_planes_kernel's blocks a multiprocessor (its template argument kBlocks) in each launch."""
    return {int(re.search(r",\s*(?:\(int\))?(\d+)>\(", n).group(1)) for n in _ran(prof, "prepare_planes_kernel")}


def _folded(prof, recurrence: str) -> set[bool]:
    """For each launch of the recurrence kernel `recurrence`: whether it is the folded (backward) one."""
    return {"true>(" in n.replace(" ", "") for n in _ran(prof, recurrence)}


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_the_planes_kernels_pass_the_judge_on_cuda():
    """bf16 at Qwen3.5's widths takes the kernels on planes (cc/ops/gated_delta_rule.cu kPlanes), the
    prepare's (forward and the backward's recomputation), the output's and wy_grads' among them (the UT
    transform's backward: v's, beta's, k's and g's gradients) and dqkwg's (state_grads and intra_grads
    as one kernel: q's gradient, k's and G's parts, W's gradient), and the reverse recurrence forms the
    state's gradient from each chunk's outputs itself (its `true` instance, from E Q as local_grads
    wrote it): every gradient against the reference and its float64 truth over documents across chunk
    boundaries (1, 63, 64, 65 and 4,097 tokens); the profile shows the planes kernels ran, not the
    float32 ones, the folded recurrence in the backward alone, and prepare at three blocks a
    multiprocessor (V4TRAIN_GDR_VARIANTS unset: every variant). On Hopper the recurrence, the output
    and local_grads run on warpgroup products; elsewhere on the warps' (the test below judges those
    on Hopper)."""
    prof = _judged_on_cuda(long_documents(torch.bfloat16, "cuda", 11), seed=3)
    output, local, recurrence = (("output_wgmma_kernel", "local_wgmma_kernel", "recurrence_wgmma_kernel") if HOPPER
                                 else ("output_planes_kernel", "local_grads_planes_kernel", "recurrence_planes_kernel"))
    for planes, plain in (("prepare_planes_kernel", "prepare_kernel"), (output, "output_kernel"),
                          (local, "local_grads_kernel"), ("dqkwg_planes_kernel", "state_grads_kernel"),
                          ("dqkwg_planes_kernel", "intra_grads_kernel"), ("wy_grads_planes_kernel", "wy_grads_kernel")):
        assert _ran(prof, planes) and not _ran(prof, plain), (planes, _ran(prof, plain))
    assert _folded(prof, recurrence) == {True, False}, (recurrence, _ran(prof, "recurrence_"))  # backward, forward
    assert _prepare_blocks(prof) == {3}, _ran(prof, "prepare_planes_kernel")


@pytest.mark.skipif(not HOPPER, reason="no Hopper GPU (elsewhere these kernels are the default, judged above)")
def test_the_planes_kernels_pass_the_judge_on_cuda_with_the_warps_kernels(monkeypatch):
    """V4TRAIN_GDR_VARIANTS=none takes the recurrence, the output and local_grads on the warps' mma.sync
    (recurrence_planes_kernel, output_planes_kernel, local_grads_planes_kernel), which devices after
    Hopper run from the PTX (the warpgroup kernels are sm_90a's alone), and prepare at two blocks a
    multiprocessor: on Hopper they are judged as the test above judges the default, forward and folded
    backward over documents across chunk boundaries, every gradient against the float64 truth, and the
    output along each path."""
    monkeypatch.setenv("V4TRAIN_GDR_VARIANTS", "none")
    prof = _judged_on_cuda(long_documents(torch.bfloat16, "cuda", 11), seed=3)
    assert _folded(prof, "recurrence_planes_kernel") == {True, False} and not _ran(prof, "recurrence_wgmma_kernel"), \
        _ran(prof, "recurrence_")
    for warps, wgmma in (("output_planes_kernel", "output_wgmma_kernel"), ("local_grads_planes_kernel", "local_wgmma_kernel")):
        assert _ran(prof, warps) and not _ran(prof, wgmma), (_ran(prof, warps), _ran(prof, wgmma))
    assert _prepare_blocks(prof) == {2}, _ran(prof, "prepare_planes_kernel")
    _judge_paths(OP, "cuda", torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("rep", [1, 3, 4, 9])
def test_a_key_heads_value_heads_sum_in_one_cluster_on_cuda(rep):
    """The plane kernels write q's and k's gradients summed over a key head's value heads, the blocks
    of one cluster (gated_delta_rule.cu sum_over_value_heads): 1 (Qwen3.5's small models), 3 (27B) and 4
    (397B-A17B) value heads a key head, at Qwen3.5's widths in bf16, every gradient against the
    reference and its float64 truth across chunk boundaries; past the cluster's 8 blocks the float32
    kernels and their separate sum take it (the profile shows which ran)."""
    from v4train.testing.samples import Sample

    lengths = [1, 63, 65, 200]
    leaves = leaves_for(lengths, 2, rep, 128, 128, torch.bfloat16, "cuda", 5, decay=0.01)
    cu = packed(lengths, "cuda")[1]
    sample = Sample(leaves, lambda lv: ((lv["q"], lv["k"], lv["v"], lv["g"], lv["beta"], cu), {}),
                    note=f"{rep} value heads a key head")
    prof = _judged_on_cuda(sample, seed=5)
    on_planes = rep <= 8
    assert bool(_ran(prof, "wy_grads_planes_kernel")) == on_planes, (_ran(prof, "wy_grads_planes_kernel"),
                                                                    _ran(prof, "wy_grads_kernel"))
    assert bool(_ran(prof, "sum_value_heads_kernel")) != on_planes, _ran(prof, "sum_value_heads_kernel")


PATHS = [(leaf, site) for leaf, sites in gated_delta_rule.PATH_SITES.items() for site in sites]
# The output's shares: central differences in float64 of the value scaled by 1 -+ SHARE_STEP (their
# error, about SHARE_STEP^2 of the share, is far below any bound).
SHARE_STEP = 1e-4


def _scaled(leaf, site, factor):
    """The reference with path (leaf, site)'s value times `factor` (a float) or through `factor` (a
    function: ScaledGradient, x.detach)."""
    how = factor if callable(factor) else (lambda x: x * factor)
    return functools.partial(gated_delta_rule.v4_gated_delta_rule,
                             path=lambda x, of, at: how(x) if (of, at) == (leaf, site) else x)


@functools.lru_cache(maxsize=None)
def _paths(device, dtype):
    """On the long documents (where the state crosses chunks, so every path carries a large share):
    the run's upstream gradients, the reference's output and gradients, the exact ones, and for each
    path (a site of PATH_SITES) its share of the exact output and of its leaf's exact gradient (the
    exact gradient less that with the site cut, the leaf detached there)."""
    from v4train.testing.check import forward_backward, in_float64, upstream_of

    reference, sample = gated_delta_rule.v4_gated_delta_rule, long_documents(dtype, device, 11)
    exact = in_float64(sample)
    upstream = upstream_of(3)  # drawn by the first run, in the sample's dtype (exact in the others)
    run = lambda fn, s: forward_backward(fn, s, upstream, 3)  # noqa: E731
    expected, truth = run(reference, sample), run(reference, exact)
    output = lambda fn: fn(*exact.build({k: v.detach() for k, v in exact.leaves.items()})[0])  # noqa: E731
    shares = {}
    for leaf, site in PATHS:
        shares[("output", leaf, site)] = (output(_scaled(leaf, site, 1 + SHARE_STEP)) -
                                          output(_scaled(leaf, site, 1 - SHARE_STEP))) / (2 * SHARE_STEP)
        shares[("gradient", leaf, site)] = truth[1][leaf] - run(_scaled(leaf, site, torch.Tensor.detach), exact)[1][leaf]
    return upstream, expected, truth, shares


def _path_name(kind, leaf, site) -> str:
    return f"output along {leaf} at {site}" if kind == "output" else f"{leaf}'s gradient through {site}"


def _judge_paths(fn, device, dtype) -> None:
    """judge_path of fn's output and its g, beta, k and q gradients along each of their paths, every
    failing one reported."""
    from v4train.testing.check import forward_backward, judge_path

    upstream, expected, truth, shares = _paths(device, dtype)
    actual = forward_backward(fn, long_documents(dtype, device, 11), upstream, 3)
    failures = []
    for (kind, leaf, site), share in shares.items():
        of = lambda run: run[0][0] if kind == "output" else run[1][leaf]  # noqa: E731
        try:
            judge_path(f"v4_gated_delta_rule {_path_name(kind, leaf, site)} [{dtype}, {device}]", of(actual),
                       of(expected), of(truth), share)
        except AssertionError as failure:
            failures.append(str(failure))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("device,dtype", LONG)
def test_each_path_of_the_output_and_gradients(device, dtype):
    """The output, and g's, beta's, k's and q's gradients, judged along each path's share
    (check.judge_path). g's: the decay matrix of the UT system and of Q K^T, the decay of w's keys and
    of q to the chunk's start, of k to its end, and the state's across it (on CUDA a dot in
    state_grads' kernel, which judge's bf16 norm bound passed 10% off on these documents); beta's:
    through v, and through k in the system and in w (wy_grads' three sums); k's: through K K^T, w,
    Q K^T and the state's update; q's: through Q K^T and Q S (each a product of its own in the
    kernels, where judge's bf16 bound passes a path 1% off). The output along the same paths' values:
    judge's bf16 bound passed it 8.9% off (U's lo plane taken from W's M: beta's share through v)."""
    _judge_paths(OP, device, dtype)


@pytest.mark.parametrize("leaf,site", PATHS)
@pytest.mark.parametrize("kind", ["output", "gradient"])
def test_the_path_judge_fails_each_path_off(kind, leaf, site):
    """The same judge handed the reference with one path's gradient 2% off, or its value 5% off (kind
    "output": the log decay's smallest shares of the output, through the system and w, have bounds of
    3.6% and 2.2%, the others 1.3% or less), in bf16 (the kernels' dtype; g's state path fails 1% off
    too, docs/testing.md): it fails along that path's own share (the shares are not orthogonal, so
    others may fail as well)."""
    wrong = _scaled(leaf, site, 1.05 if kind == "output" else lambda x: ScaledGradient.apply(x, 1.02))
    with pytest.raises(AssertionError, match=rf"{_path_name(kind, leaf, site)} \["):
        _judge_paths(wrong, "cpu", torch.bfloat16)
