"""Runs one op implementation forward and backward on a Sample; used by the generic tests."""

from __future__ import annotations

from typing import Callable

import torch

from parity.compare import assert_close
from parity.strategies import Sample


def _outputs(result) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def random_upstream(outputs, seed: int) -> list[torch.Tensor]:
    """A random gradient for each output, in its dtype and on its device."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen).to(o.dtype).to(o.device) for o in outputs]


def forward_backward(fn: Callable, sample: Sample, upstream: Callable):
    """Outputs of fn on the sample, and the gradient of every leaf for upstream(outputs).

    Leaves are fresh copies, so the implementations never share autograd state.
    """
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in sample.leaves.items()}
    args, kwargs = sample.build(leaves)
    outputs = _outputs(fn(*args, **kwargs))
    grads_out = upstream(outputs)
    differentiable = [(o, g) for o, g in zip(outputs, grads_out) if o.requires_grad]
    if differentiable:
        torch.autograd.backward([o for o, _ in differentiable], [g for _, g in differentiable])
    return outputs, {k: v.grad for k, v in leaves.items()}


def in_float64(sample: Sample) -> Sample:
    """The same sample with every floating leaf in float64, for the reference's exact answer."""
    leaves = {k: v.double() if v.is_floating_point() else v for k, v in sample.leaves.items()}
    return Sample(leaves, sample.build, sample.note)


def run_inplace(fn: Callable, sample: Sample) -> list[torch.Tensor]:
    """What an in-place op returns, then every leaf as the op left it (on fresh copies)."""
    leaves = {k: v.clone() for k, v in sample.leaves.items()}
    args, kwargs = sample.build(leaves)
    out = fn(*args, **kwargs)
    return ([] if out is None else list(_outputs(out))) + list(leaves.values())


def check_parity(op, sample: Sample, seed: int) -> None:
    """C++ against the reference: every output and every leaf's gradient (for in-place ops,
    every tensor they update).

    The reference run in float64 is the truth that arbitrates rounding (see compare.py).
    """
    if op.inplace:
        names = [f"tensor {i}" for i in range(len(sample.leaves) + 1)]
        for name, c, r in zip(names, run_inplace(op.cpp(), sample), run_inplace(op.reference, sample)):
            assert_close(c, r, f"{op.name} {name} [{sample!r}]")
        return
    grads = None

    def upstream(outputs):  # drawn once, in the op's dtypes; the same values for all three runs
        nonlocal grads
        if grads is None:
            grads = random_upstream(outputs, seed)
        return [g.to(o.dtype) for g, o in zip(grads, outputs)]

    ref_out, ref_grads = forward_backward(op.reference, sample, upstream)
    cpp_out, cpp_grads = forward_backward(op.cpp(), sample, upstream)
    true_out, true_grads = forward_backward(op.reference, in_float64(sample), upstream)
    assert len(cpp_out) == len(ref_out), f"{op.name}: {len(cpp_out)} outputs, reference has {len(ref_out)}"
    for i, (c, r) in enumerate(zip(cpp_out, ref_out)):
        assert_close(c, r, f"{op.name} output {i} [{sample!r}]", truth=true_out[i])
    for name, r in ref_grads.items():
        c = cpp_grads[name]
        assert (c is None) == (r is None), f"{op.name}: grad of {name} is {'missing' if c is None else 'present'} in C++ only"
        if r is not None:
            assert_close(c, r, f"{op.name} grad of {name} [{sample!r}]", truth=true_grads[name])
