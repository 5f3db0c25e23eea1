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
terms, element by element a coin toss between two correct orders of summation (v4_glm5_moe's input
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

from v4train.testing.tolerances import TOLERANCES


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


def assert_same_kind(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Fails unless both are tensors of one shape, dtype and device: what no tolerance forgives."""
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise AssertionError(f"{name}: expected two tensors, got {type(actual).__name__} and {type(expected).__name__}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype} != expected {expected.dtype}")
    if actual.device != expected.device:
        raise AssertionError(f"{name}: device {actual.device} != expected {expected.device}")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, name: str,
                 truth: torch.Tensor | None = None) -> Report:
    """Fails with a full report unless `actual` matches `expected` within TOLERANCES."""
    assert_same_kind(actual, expected, name)
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
                     truth: torch.Tensor | None = None, spread: float | None = None) -> float:
    """Whole-model check: ||actual - expected|| / ||expected|| within MODEL_REL_TOLERANCE; returns it.

    Given `truth` (the exact answer, float64) and `spread` (rounding_spread: how far rounding to
    the working precision moves the exact answer), it also passes when
        ||actual - truth|| <= SPREAD_FACTOR * spread + MODEL_REL_TOLERANCE * ||truth||.

    Why that bound. An evaluation in a working precision with unit roundoff u rounds the weights,
    every activation it stores and every gradient it passes back; a stable one errs by about what
    those roundings do to the exact answer, whatever its order of summation. `spread` measures
    that on the problem itself: the exact (float64) gradient with every weight, every module's
    output and its gradient multiplied by 1 + u xi (xi = +-1 drawn per element), the largest change
    over a few draws. It is large exactly where a gradient sums terms that cancel (Gated
    DeltaNet's dt_bias and A_log: 6e-6 to 2e-5 of their norm) and small elsewhere (3e-7).
    SPREAD_FACTOR allows for the roundings inside a module, which the model of `spread` leaves
    out: on every golden, v4train's fp32 gradients lie within 0.6 of the bound (the largest,
    a DeltaNet A_log gradient at 2.4 spreads). The bound depends on the problem, not on the
    machine: the rule it replaces, within twice transformers' own fp32 error, took one draw of
    rounding noise for the bound (green on one CPU, red on another), and where transformers' own
    error is large it let anything through (its fp32 chunked delta rule, summing the cumulative
    log decay in fp32, is up to 129% off the exact dt_bias gradient of a golden; v4train's is
    2e-5, see gated_delta_rule.h). A wrong formula (a 1% error, a sign) is far outside it
    (parity/test_compare.py, py/tests/test_goldens.py).
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if (truth is None) != (spread is None):
        raise ValueError(f"{name}: the exact answer is judged with its spread: give both truth and spread, or neither")
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    rel_to = lambda x, ref: ((x - ref).norm() / ref.norm()).item() if ref.norm() > 0 else (x - ref).norm().item()  # noqa: E731
    rel = rel_to(a, e)
    limit = MODEL_REL_TOLERANCE[expected.dtype if expected.dtype in MODEL_REL_TOLERANCE else torch.float32]
    if rel <= limit:
        return rel
    if truth is not None:
        t = truth.detach().double().cpu()
        ours, bound = (a - t).norm().item(), SPREAD_FACTOR * spread + limit * t.norm().item()
        if ours <= bound:
            return rel
        detail = (f"; from the exact answer: {ours:.3g}, more than {SPREAD_FACTOR} x its spread under one unit of "
                  f"roundoff ({spread:.3g}) + {limit:g} of its norm = {bound:.3g}")
    else:
        detail = ""
    flat = int((a - e).abs().argmax())
    raise AssertionError(f"{name}: relative error norm {rel:.3g} > {limit:g}{detail}; worst element {flat}: "
                         f"actual {a.reshape(-1)[flat].item():.9g}, expected {e.reshape(-1)[flat].item():.9g}")


# See assert_rel_close: how many spreads (rounding_spread) an evaluation that also rounds inside its
# modules may lie from the exact answer.
SPREAD_FACTOR = 4

UNIT_ROUNDOFF: dict[torch.dtype, float] = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11,
                                          torch.float64: 2.0**-53}


def rounding_spread(model: torch.nn.Module, gradients, dtype: torch.dtype = torch.float32, draws: int = 4,
                    seed: int = 0) -> dict[str, float]:
    """For each parameter, max over `draws` of ||g~ - g||: how far its exact gradient g moves when
    every weight, every module's output and the gradient of every module's output of `model`
    (float64) are rounded as working in `dtype` would round them, modelled as a factor 1 + u xi
    per element (u the unit roundoff of `dtype`, xi = +-1 drawn per element). `gradients(model)` -> {name: gradient}, evaluated on a copy each
    draw. See assert_rel_close. (Its twin for one op, every aten op's output rounded: spread.op_spread.)"""
    import copy

    u = UNIT_ROUNDOFF[dtype]
    gen = torch.Generator().manual_seed(seed)

    def rounded(x, grads: bool = False):
        """x (tensors, or tuples of them) times 1 + u xi; with `grads`, its gradient in the backward too."""
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            y = x * (1 + u * torch.randint(0, 2, x.shape, generator=gen).to(x.dtype).mul_(2).sub_(1).to(x.device))
            if grads and y.requires_grad:
                y.register_hook(rounded)
            return y
        if isinstance(x, (tuple, list)):
            return type(x)(rounded(i, grads) for i in x)
        return x

    exact = gradients(copy.deepcopy(model))
    spread = dict.fromkeys(exact, 0.0)
    for _ in range(draws):
        m = copy.deepcopy(model)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(rounded(p))
        for module in m.modules():
            if module is not m:
                module.register_forward_hook(lambda _m, _i, out: rounded(out, grads=True))
        for n, g in gradients(m).items():
            spread[n] = max(spread[n], (g.double() - exact[n].double()).norm().item())
    return spread
