"""The one comparison helper, used by the parity suite, the trainer's self-check and the model
tests; its tolerances come from the one table per dtype (tolerances.py).

An element passes when |actual - expected| <= atol + rtol * |expected| (torch.testing's rule,
with its default tolerances per dtype). Given `truth` (the reference evaluated in float64), an
element that misses also passes when actual is no further from the truth than expected is, plus
that same allowance: where the reference's own rounding is large (a result near zero obtained by
cancellation, a long fp32 sum) the C++ op must be as accurate as the reference, not equal to its
rounding. Where elements still miss, the tensor passes when its error against the truth, as a
norm, is at most twice the reference's own (the criterion FlashAttention's tests use) or the
dtype's rtol relative to the truth's norm (the table's tolerance, for the tensor as a whole): in
bf16 a result that sums rounded terms with cancellation carries an error of the size of the
terms, element by element a coin toss between two correct orders of summation (v4_moe's input
gradient: over 300 samples the C++ op's error norm was 0.97-1.47x the reference's, yet single
elements 2.9x; a LoRA A gradient, a projection of its weight's gradient, amplifies the rounding
of either side). A wrong result is far outside it: a single wrong element of a float32 tensor,
or a 5% error of a bf16 one (parity/test_compare.py). Where the expected value is not finite (inf, -inf, NaN), the actual one must be the
same non-finite value. A failure names the tensor, counts the bad elements, and reports the
worst one (index, values, error and allowance) and the error norm relative to the expected
tensor. It never warns: it fails.
"""

from __future__ import annotations

import dataclasses

import torch

from v4train.ops.tolerances import TOLERANCES


# Whole-model comparisons (a model's logits, loss and gradient norms against transformers'):
# ||actual - expected|| / ||expected|| may not exceed this. Summation order differs across a
# whole network (attention, experts), so this is a norm bound, not an element-wise one.
MODEL_REL_TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
}


@dataclasses.dataclass(frozen=True)
class Report:
    max_abs_error: float
    rel_error_norm: float  # ||actual - expected|| / ||expected||


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str,
                 truth: torch.Tensor | None = None) -> Report:
    """Fails with a full report unless `actual` matches `expected` within TOLERANCES."""
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise AssertionError(f"{name}: expected two tensors, got {type(actual).__name__} and {type(expected).__name__}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype} != expected {expected.dtype}")
    if actual.device != expected.device:
        raise AssertionError(f"{name}: device {actual.device} != expected {expected.device}")
    tol = TOLERANCES[expected.dtype]
    a = actual.detach().double().cpu()
    e = expected.detach().double().cpu()
    err = (a - e).abs()
    allowed = tol.atol + tol.rtol * e.abs()
    # A non-finite expected value must be matched exactly (inf by the same inf, NaN by NaN); a
    # non-finite actual value where a finite one is expected fails through err (inf or NaN).
    same_nonfinite = (a.isnan() & e.isnan()) | (a.isinf() & e.isinf() & (a.sign() == e.sign()))
    finite = e.isfinite()
    bad = ~same_nonfinite & ~(finite & (err <= allowed))
    if truth is not None:
        if truth.shape != expected.shape:
            raise AssertionError(f"{name}: truth shape {tuple(truth.shape)} != {tuple(expected.shape)}")
        t = truth.detach().double().cpu()
        bad &= ~(finite & ((a - t).abs() <= (e - t).abs() + allowed))
        # Every non-finite expected value matched, and the finite part within twice the
        # reference's error norm against the truth, or the dtype's rtol of the truth's norm:
        # rounding, not a wrong result.
        if bad.any() and not (bad & ~finite).any():
            bound = max(2 * (e[finite] - t[finite]).norm(), tol.rtol * t[finite].norm())
            if (a[finite] - t[finite]).norm() <= bound:
                bad = torch.zeros_like(bad)
    finite = finite & a.isfinite()
    diff = (a - e)[finite]
    ref_norm = e[finite].norm().item()
    rel = diff.norm().item() / ref_norm if ref_norm > 0 else diff.norm().item()
    max_abs = err[finite].max().item() if finite.any() else 0.0
    if bad.any():
        excess = torch.where(bad, (err - allowed).nan_to_num(nan=float("inf")), torch.full_like(err, -1.0))
        flat = int(excess.argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), e.shape)) if e.dim() else ()
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {e.numel()} elements outside rtol={tol.rtol:g}, atol={tol.atol:g} "
            f"({expected.dtype}); worst at {idx}: actual={a.reshape(-1)[flat].item():.9g} "
            f"expected={e.reshape(-1)[flat].item():.9g} |diff|={err.reshape(-1)[flat].item():.3g} "
            f"allowed={allowed.reshape(-1)[flat].item():.3g}"
            + (f" truth={truth.reshape(-1)[flat].item():.9g}" if truth is not None else "")
            + f"; relative error norm {rel:.3g}; "
            f"shape {tuple(e.shape)}"
        )
    return Report(max_abs_error=max_abs, rel_error_norm=rel)


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, name: str,
                     truth: torch.Tensor | None = None) -> float:
    """Whole-model check: ||actual - expected|| / ||expected|| within MODEL_REL_TOLERANCE; returns it.

    Given `truth` (the exact answer the expected fp32 result approximates), it also passes when
    actual is within twice expected's own distance from the truth, plus that same tolerance: a
    gradient summed with heavy cancellation carries rounding far above the tolerance in any
    fp32 evaluation (5e-4 for some DeltaNet gradients), so an evaluation in another order is
    judged by the size of that rounding, not by equality with the reference's. A wrong formula
    (a 1% error, a sign) is still far outside it.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    rel_to = lambda x, ref: ((x - ref).norm() / ref.norm()).item() if ref.norm() > 0 else (x - ref).norm().item()  # noqa: E731
    rel = rel_to(a, e)
    limit = MODEL_REL_TOLERANCE[expected.dtype if expected.dtype in MODEL_REL_TOLERANCE else torch.float32]
    if rel <= limit:
        return rel
    if truth is not None:
        t = truth.detach().double().cpu()
        ours, theirs = rel_to(a, t), rel_to(e, t)
        if ours <= 2 * theirs + limit:
            return rel
        detail = f"; from the exact answer: {ours:.3g}, more than twice expected's own {theirs:.3g}"
    else:
        detail = ""
    flat = int((a - e).abs().argmax())
    raise AssertionError(f"{name}: relative error norm {rel:.3g} > {limit:g}{detail}; worst element {flat}: "
                         f"actual {a.reshape(-1)[flat].item():.9g}, expected {e.reshape(-1)[flat].item():.9g}")
