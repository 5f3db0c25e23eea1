"""C++ against reference on one Sample (forward and every gradient, or every tensor an in-place op
updates), through the one comparison helper: the parity suite's check and the trainer's
self-check are this same function."""

from __future__ import annotations

from typing import Callable

import torch

from v4train.testing.compare import assert_close
from v4train.op import Op, OpTable
from v4train.testing.cases import CASES
from v4train.testing.samples import FP8_DTYPES, RandomDraw, Sample, takes_gradient
from v4train.testing.tolerances import TOLERANCES


def _outputs(result) -> tuple[torch.Tensor, ...]:
    items = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    return tuple(t for t in items if isinstance(t, torch.Tensor))


def random_upstream(outputs, seed: int) -> list[torch.Tensor]:
    """A random gradient for each floating output, in its dtype and on its device."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen).to(o.dtype).to(o.device) if o.is_floating_point() else None
            for o in outputs]


def forward_backward(fn: Callable, sample: Sample, upstream: Callable, seed: int = 0):
    """Outputs of fn on the sample, and the gradient of every leaf for upstream(outputs).

    Leaves are fresh copies, so the implementations never share autograd state. The random
    generators start from `seed`, so that every implementation draws the same LoRA dropout masks
    (on the CPU a mask does not depend on the dtype).
    """
    leaves = {k: v.detach().clone().requires_grad_(takes_gradient(k, sample.leaves)) for k, v in sample.leaves.items()}
    args, kwargs = sample.build(leaves)
    torch.manual_seed(seed)
    outputs = _outputs(fn(*args, **kwargs))
    grads_out = upstream(outputs)
    differentiable = [(o, g) for o, g in zip(outputs, grads_out) if o.requires_grad]
    if differentiable:
        torch.autograd.backward([o for o, _ in differentiable], [g for _, g in differentiable])
    return outputs, {k: v.grad for k, v in leaves.items()}


def in_float64(sample: Sample) -> Sample:
    """The same sample with every floating leaf in float64, for the reference's exact answer."""
    leaves = {k: v.double() if v.is_floating_point() and v.dtype not in FP8_DTYPES else v
              for k, v in sample.leaves.items()}  # (an FP8 weight's values are exact already)
    return Sample(leaves, sample.build, sample.note)


def run_inplace(fn: Callable, sample: Sample) -> dict[str, torch.Tensor]:
    """What an in-place op returns ("result") and every leaf as the op left it (on fresh copies)."""
    leaves = {k: v.clone() for k, v in sample.leaves.items()}
    args, kwargs = sample.build(leaves)
    out = fn(*args, **kwargs)
    return {**({} if out is None else {"result": out}), **leaves}


def _check_inplace(name: str, cpp: Callable, reference: Callable, sample: Sample) -> None:
    """Every tensor the op leaves behind, and for float32 tensors (moments, master weights) what the
    step changed: a change far below a tensor's own tolerance (lr x weight decay against a
    parameter of size 1) is still compared at its own scale."""
    ours, theirs, truth = run_inplace(cpp, sample), run_inplace(reference, sample), run_inplace(reference, in_float64(sample))
    assert ours.keys() == theirs.keys(), f"{name}: returns {sorted(ours)} but the reference {sorted(theirs)}"
    for key in theirs:
        where = f"{name} {key} [{sample!r}]"
        assert_close(ours[key], theirs[key], where, truth=truth[key])
        before = sample.leaves.get(key)
        if before is not None and before.dtype == torch.float32:
            b = before.double()
            assert_close((ours[key].double() - b).float(), (theirs[key].double() - b).float(), f"{where}, its change",
                         truth=truth[key] - b)


# How far from the exact answer an op whose math is checked in float64 may land at low precision,
# in multiples of the reference's own distance (or of its dtype's rtol): an order of magnitude.
# Two correct evaluations of a layer differ in where they round, and gradients that pass through
# several projections and norms amplify that differently: over 2,000 tensors of the GLM-5
# attention op the C++ result's error norm was up to 2.8x the reference's in fp32 and 4.5x in bf16,
# both being right. A lost precision (a long sum accumulated in bf16) is tens to hundreds of times.
LOW_PRECISION_FACTOR = 10


def judge(op: Op, actual, expected, truth, name: str) -> None:
    """assert_close; and for an op whose math the suite also checks in float64 (F64 in its
    dtypes), a low-precision result that misses it still passes when its error norm against the
    exact answer is at most LOW_PRECISION_FACTOR times the reference's own, plus the dtype's floor
    (rtol of the truth's norm and atol per element): the C++ result is always judged, against the
    scale of rounding the reference shows on this very tensor. (An ill-conditioned tensor, where
    the reference itself misses the truth by far more than the floor, widens the bound with the
    reference's error; it never waives it: a result 12x off passed that way before.)"""
    try:
        assert_close(actual, expected, name, truth=truth)
    except AssertionError:
        if expected.dtype == torch.float64 or torch.float64 not in op.dtypes or truth is None:
            raise
        a, e, t = actual.double().cpu(), expected.double().cpu(), truth.double().cpu()
        finite = e.isfinite()
        if not torch.equal(a.isfinite(), finite) or not torch.equal(a[~finite].isnan(), e[~finite].isnan()):
            raise
        a, e, t = a[finite], e[finite], t[finite]
        tol = TOLERANCES[expected.dtype]
        floor = tol.rtol * t.norm() + tol.atol * t.numel() ** 0.5
        if (a - t).norm() <= LOW_PRECISION_FACTOR * (e - t).norm() + floor:
            return
        raise


def check_parity(op: Op, cpp: Callable, reference: Callable, sample: Sample, seed: int) -> None:
    """`cpp` against `reference` (the pure reference of `op`) on `sample`: every output and every
    leaf's gradient, or for in-place ops every tensor they update. The reference run in float64
    is the truth that arbitrates rounding (see compare.py). Raises AssertionError naming the op,
    the tensor and the sample. Where the C++ ops route a token to another expert than the
    references (rounding at a near-tie; Sample.reroute), the verdict is against the reference
    routed as the C++ ops routed."""
    if op.inplace:
        _check_inplace(op.name, cpp, reference, sample)
        return
    grads = None

    def upstream(outputs):  # drawn once, in the op's dtypes; the same values for all three runs
        nonlocal grads
        if grads is None:
            grads = random_upstream(outputs, seed)
        return [None if g is None else g.to(o.dtype) for g, o in zip(grads, outputs)]

    ref_out, ref_grads = forward_backward(reference, sample, upstream, seed)
    cpp_out, cpp_grads = forward_backward(cpp, sample, upstream, seed)
    true_out, true_grads = forward_backward(reference, in_float64(sample), upstream, seed)
    try:
        _compare(op, sample, cpp_out, cpp_grads, ref_out, ref_grads, true_out, true_grads)
    except AssertionError:
        routed = (sample.reroute(*sample.build({k: v.detach() for k, v in sample.leaves.items()}), cpp_out[0], seed)
                  if sample.reroute else None)
        if routed is None:
            raise
        # The C++ ops routed a token otherwise (rounding at a near-tie): judge against the
        # reference, and its float64 truth, routed as they did.
        ref_out, ref_grads = forward_backward(routed, sample, upstream, seed)
        true_out, true_grads = forward_backward(routed, in_float64(sample), upstream, seed)
        _compare(op, sample, cpp_out, cpp_grads, ref_out, ref_grads, true_out, true_grads)


def _compare(op: Op, sample: Sample, cpp_out, cpp_grads, ref_out, ref_grads, true_out, true_grads) -> None:
    assert len(cpp_out) == len(ref_out), f"{op.name}: {len(cpp_out)} outputs, reference has {len(ref_out)}"
    for i, (c, r) in enumerate(zip(cpp_out, ref_out)):
        if r.is_floating_point():
            judge(op, c, r, true_out[i], f"{op.name} output {i} [{sample!r}]")
        elif not torch.equal(c, r):
            raise AssertionError(f"{op.name} output {i} [{sample!r}]: {(c != r).sum().item()} of {r.numel()} "
                                 f"values differ (integer outputs must be equal)")
    for name, r in ref_grads.items():
        c = cpp_grads[name]
        assert (c is None) == (r is None), f"{op.name}: grad of {name} is {'missing' if c is None else 'present'} in C++ only"
        if r is not None:
            judge(op, c, r, true_grads[name], f"{op.name} grad of {name} [{sample!r}]")


SELF_CHECK_SAMPLES = 4


def self_check(table: OpTable, reference: OpTable, dtype: torch.dtype, device, samples: int = SELF_CHECK_SAMPLES) -> None:
    """Each C++ op of `table` against its pure reference on a few samples drawn from the op's own
    parity strategy (seeded, so every run checks the same), on the run's dtype and device.
    Raises ValueError naming the op and what differed."""
    for name in sorted(table.cpp):
        op = CASES[name]
        if dtype not in op.dtypes:
            continue
        if op.samples is None:
            raise ValueError(f"self-check: {name} has no parity samples to check it with")
        for i in range(samples):
            sample = op.samples(RandomDraw(i), dtype, device)
            try:
                check_parity(op, table[name], reference[name], sample, seed=i)
            except AssertionError as e:
                raise ValueError(f"self-check: the C++ op {name} differs from its reference ({dtype} on {device}): "
                                 f"{e}. Run its parity suite (tools/bazel test //parity:{name.removeprefix('v4_')}), "
                                 f"or leave it out of --cpp_ops") from None
