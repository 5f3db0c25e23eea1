"""Whether a checkpointed layer op's recomputation repeats the first pass's choices (the MoE
routing, the DSA selection) instead of choosing again, shown without relying on rounding: after
the forward pass, the test changes what only the choices read (a router's correction bias, a
router row no choice kept, the indexer's weights). A recomputation that chose again would choose
otherwise and give other gradients; one that repeats the recorded choices gives the gradients of
the unchanged layer."""

from __future__ import annotations

from typing import Callable

import torch

from v4train.testing.compare import assert_rel_close
from v4train.testing.samples import Sample, takes_gradient


def first_output(result) -> torch.Tensor:
    """A layer op's hidden output: GLM-5's returns (hidden, selection), Qwen3.5's hidden alone."""
    return result[0] if isinstance(result, tuple) else result


def gradients(layer: Callable, sample: Sample, change: Callable[[dict], None] | None = None):
    """The layer's output and the gradient of every leaf for a fixed upstream gradient;
    `change(weights)`, if given, edits the weights in place between the forward and the backward."""
    leaves = {k: v.detach().clone().requires_grad_(takes_gradient(k, sample.leaves)) for k, v in sample.leaves.items()}
    args, kwargs = sample.build(leaves)
    out = first_output(layer(*args, **kwargs))
    if change is not None:
        with torch.no_grad():
            change(args[1])
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.dtype))
    return out.detach(), {k: v.grad for k, v in leaves.items()}


def assert_recomputation_repeats_choices(layer: Callable, sample: Sample, change: Callable[[dict], None]) -> None:
    """`change` alters what a fresh forward pass computes (checked), yet applied between the
    checkpointed forward pass and its backward it leaves every gradient as it was."""
    out, expected = gradients(layer, sample)
    changed = {k: v.detach().clone() for k, v in sample.leaves.items()}
    args, kwargs = sample.build(changed)
    change(args[1])
    with torch.no_grad():
        assert not torch.equal(first_output(layer(*args, **kwargs)), out), "the change must alter the layer's choices"
    _, actual = gradients(layer, sample, change)
    for name, g in expected.items():
        if g is not None:  # (a router's softmax rounds in fp32 with other denominators: a norm bound)
            assert_rel_close(actual[name], g, f"gradient of {name} after the choices' inputs changed")
