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




@st.composite
def _param_shapes(draw):
    return draw(st.lists(shapes(1, 3, 65), min_size=1, max_size=4))


@st.composite
def adam_step_samples(draw, dtype: torch.dtype, device: str) -> Sample:
    shapes_ = draw(_param_shapes())
    seed = draw(seeds())
    leaves = {}
    for i, s in enumerate(shapes_):
        leaves[f"p{i}"] = make_leaf(s, "contiguous", dtype, device, seed + 4 * i)
        leaves[f"g{i}"] = make_leaf(s, "contiguous", dtype, device, seed + 4 * i + 1, scale=0.1)
        leaves[f"m{i}"] = make_leaf(s, "contiguous", torch.float32, device, seed + 4 * i + 2, scale=0.01)
        leaves[f"v{i}"] = make_leaf(s, "contiguous", torch.float32, device, seed + 4 * i + 3, scale=0.01).square()
    step = draw(st.sampled_from([1, 2, 10, 1000]))
    lr = draw(st.sampled_from([1e-4, 2e-3]))
    b1, b2 = draw(st.sampled_from([(0.9, 0.999), (0.9, 0.95)]))
    wd = draw(st.sampled_from([0.0, 0.1]))
    n = len(shapes_)

    def build(lv):
        pick = lambda c: [lv[f"{c}{i}"] for i in range(n)]  # noqa: E731
        return (pick("p"), pick("g"), pick("m"), pick("v"), step, lr, b1, b2, 1e-8, wd), {}

    return Sample(leaves, build, note=f"step {step}, lr {lr}, betas {b1},{b2}, wd {wd}")


@st.composite
def clip_grad_norm_samples(draw, dtype: torch.dtype, device: str) -> Sample:
    shapes_ = draw(_param_shapes())
    seed = draw(seeds())
    leaves = {f"g{i}": make_leaf(s, "contiguous", dtype, device, seed + i) for i, s in enumerate(shapes_)}
    max_norm = draw(st.sampled_from([0.0, 0.5, 1e6]))  # off, clipping, not reached

    def build(lv):
        return ([lv[f"g{i}"] for i in range(len(shapes_))], max_norm), {}

    return Sample(leaves, build, note=f"max_norm {max_norm}")




@st.composite
def cross_entropy_loss_samples(draw, dtype: torch.dtype, device: str) -> Sample:
    tokens, hidden, vocab = draw(sizes(130)), draw(sizes(64)), draw(sizes(300))
    chunk = draw(st.sampled_from([1, 7, 64, 4096]))
    seed = draw(seeds())
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[torch.rand(tokens, generator=gen) < draw(st.sampled_from([0.0, 0.3, 1.0]))] = -100
    targets = targets.to(device)
    h_layout = draw(layouts())
    normalizer = float(draw(st.integers(1, 300)))
    leaves = {"hidden": make_leaf((tokens, hidden), h_layout, dtype, device, seed),
              "weight": make_leaf((vocab, hidden), "contiguous", dtype, device, seed + 1, scale=0.5)}

    def build(lv):
        return (view_as_layout(lv["hidden"], h_layout), lv["weight"], targets, normalizer, chunk), {}

    return Sample(leaves, build, note=f"chunk {chunk}, normalizer {normalizer}, {int((targets == -100).sum())} ignored")




@st.composite
def embedding_samples(draw, dtype: torch.dtype, device: str) -> Sample:
    vocab, hidden = draw(sizes(300)), draw(sizes(100))
    shape = draw(shapes(1, 2, 70))
    seed = draw(seeds())
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed)).to(device)
    leaves = {"weight": make_leaf((vocab, hidden), "contiguous", dtype, device, seed)}

    def build(lv):
        return (ids, lv["weight"]), {}

    return Sample(leaves, build, note=f"ids {tuple(shape)}")


SAMPLES = {
    "v4_rms_norm": rms_norm_samples,
    "v4_adam_step": adam_step_samples,
    "v4_clip_grad_norm": clip_grad_norm_samples,
    "v4_cross_entropy_loss": cross_entropy_loss_samples,
    "v4_embedding": embedding_samples,
}
