"""The sample-input strategy of every op in the registry, keyed by op name.

Each entry maps (dtype, device) to a strategy of `Sample`s. test_registry.py checks that every
op of v4train.ops.OPS has one.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from parity.strategies import Sample, layouts, make_leaf, seeds, shapes, sizes, view_as_layout


@st.composite
def rms_norm_samples(draw, dtype: torch.dtype, device: str) -> Sample:
    lead = draw(shapes(0, 3, 9))
    hidden = draw(sizes(300))
    x_layout = draw(layouts())
    # Weights are kept in fp32 under mixed precision as often as in the activation dtype.
    w_dtype = draw(st.sampled_from([dtype, torch.float32]))
    zero_centered = draw(st.booleans())
    eps = draw(st.sampled_from([1e-6, 1e-5]))
    seed = draw(seeds())
    x = make_leaf(lead + (hidden,), x_layout, dtype, device, seed, scale=draw(st.sampled_from([1.0, 30.0])))
    w = make_leaf((hidden,), "contiguous", w_dtype, device, seed + 1, scale=0.5,
                  shift=0.0 if zero_centered else 1.0)

    def build(leaves):
        return (view_as_layout(leaves["x"], x_layout), leaves["weight"], eps, zero_centered), {}

    return Sample(leaves={"x": x, "weight": w}, build=build,
                  note=f"x layout {x_layout}, eps {eps}, zero_centered {zero_centered}")


SAMPLES = {
    "v4_rms_norm": rms_norm_samples,
}
