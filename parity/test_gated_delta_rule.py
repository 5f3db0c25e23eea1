"""v4_gated_delta_rule beyond the drawn samples: the C++ op against the token-by-token recurrence
(the ground truth; the registry's parity compares it with the chunked reference), and packing:
a packed batch equals each document run alone, so no state leaks from one document into the next
(the Qwen3.5 training bug other trainers report most)."""

import functools

import pytest
import torch

from parity.strategies import devices
from v4train.ops import OPS
from v4train.testing.compare import assert_close
from v4train.testing.cases.gated_delta_rule import StoredDecay, leaves_for, long_documents
from v4train.testing.cases.mla_dsa_attention import packed
from v4train.reference import gated_delta_rule

OP = OPS["v4_gated_delta_rule"].cpp()
LENGTHS = [1, 63, 64, 65, 130, 7]


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


@pytest.mark.parametrize("device,dtype", [(d, t) for d in devices() for t in (torch.float32, torch.bfloat16)])
def test_qwen_widths_across_document_and_chunk_boundaries(device, dtype):
    """Qwen3.5's head widths (128; 2 key heads serving 4 value heads) over documents of 1, 63, 64,
    65 and 4,097 tokens in one packed batch: the recurrence across chunks (on CUDA its kernel,
    forward and backward) against the reference and its float64 truth, every gradient, g's and
    beta's included (a Hopper backward can be wrong in one gradient only: fla issue 640)."""
    from v4train.testing.check import check_parity
    from v4train.reference.gated_delta_rule import v4_gated_delta_rule as reference

    check_parity(OPS["v4_gated_delta_rule"], OP, reference, long_documents(dtype, device, 11), seed=3)


def _chunk_decay_share(fn, device, dtype) -> float:
    """judge_path of fn's g gradient along the chunk decay's share of it (the state's decay across a
    chunk's end: its gradient, the dot of the state before the end with the gradient of the state
    after it), on the long documents, where that share is some 60% of g's gradient."""
    from v4train.testing.check import forward_backward, in_float64, judge_path, upstream_of

    reference = gated_delta_rule.v4_gated_delta_rule
    sample, seed = long_documents(dtype, device, 11), 3
    upstream = upstream_of(seed)
    grads = [forward_backward(f, s, upstream, seed)[1]["g"] for f, s in (
        (fn, sample), (reference, sample), (reference, in_float64(sample)),
        (functools.partial(reference, decay_state=lambda state, factor: state * factor.detach()), in_float64(sample)))]
    return judge_path(f"v4_gated_delta_rule g's gradient through the chunk decay [{dtype}, {device}]", *grads)


@pytest.mark.parametrize("device,dtype", [(d, t) for d in devices() for t in (torch.float32, torch.bfloat16)])
def test_the_chunk_decay_s_share_of_g_s_gradient(device, dtype):
    """The chunk decay's gradient (on CUDA a dot in state_grads' kernel) is judged along its own share
    of g's gradient: judge's norm bound passed it 10% off in bf16 on these documents."""
    _chunk_decay_share(OP, device, dtype)


@pytest.mark.parametrize("off", [0.01, -0.01])
def test_the_path_judge_fails_the_chunk_decay_one_percent_off(off):
    """The same judge handed the reference with that dot 1% off, in bf16 (the kernels' dtype)."""
    wrong = functools.partial(gated_delta_rule.v4_gated_delta_rule,
                              decay_state=lambda state, factor: StoredDecay.apply(state, factor, (), off))
    with pytest.raises(AssertionError, match="through the chunk decay"):
        _chunk_decay_share(wrong, "cpu", torch.bfloat16)
