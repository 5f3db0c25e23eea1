"""v4_adam_step: AdamW over every trainable tensor in one call (fp32 math, optional fp32 masters)."""

import torch

from v4train.testing.cases.clip_grad_norm import lora_tensors
from v4train.ops import OPS
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import Sample, layout, make_leaf, seed, shape, view_as_layout
from v4train.reference.adam_step import v4_adam_step


def samples(draw, dtype: torch.dtype, device) -> Sample:
    """Every term of the update must move the result by more than its tolerance somewhere:
    second moments from 1e-16 (where eps dominates the denominator) to 1, gradients from 1e-6 to
    1, learning rates and weight decays large enough that lr x wd x p shows in fp32, and for
    bf16/fp16 parameters fp32 master weights (whose change is compared at its own scale). The
    updated tensors come in every writable layout, the gradients in any layout."""
    shapes = [shape(draw, 1, 3, 65) for _ in range(draw.integers(1, 4))]
    layouts = {f"{c}{i}": layout(draw, writable=c != "g") for i in range(len(shapes)) for c in ("p", "g", "m", "v", "master")}
    s = seed(draw)
    masters = dtype != torch.float32 and draw.booleans()
    leaves = {}
    for i, sh in enumerate(shapes):
        leaf = lambda c, k, dt, scale=1.0: make_leaf(sh, layouts[f"{c}{i}"], dt, device, s + 5 * i + k, scale)  # noqa: E731
        p = leaf("p", 0, torch.float32)
        leaves[f"p{i}"] = p.to(dtype)
        leaves[f"g{i}"] = leaf("g", 1, dtype, scale=draw.sampled_from([1e-6, 1e-3, 1.0]))
        leaves[f"m{i}"] = leaf("m", 2, torch.float32, scale=0.01)
        v_scale = draw.sampled_from([1e-8, 1e-4, 1.0])  # sqrt: 1e-16 .. 1
        leaves[f"v{i}"] = leaf("v", 3, torch.float32, scale=v_scale).square()
        if masters:  # the master holds what the bf16 param rounds (same layout as the param)
            layouts[f"master{i}"] = layouts[f"p{i}"]
            leaves[f"master{i}"] = p + leaf("p", 4, torch.float32, scale=1e-3)
            leaves[f"p{i}"] = leaves[f"master{i}"].to(dtype)
    step = draw.sampled_from([1, 2, 10, 1000])
    lr = draw.sampled_from([1e-4, 2e-3, 1e-2])
    b1, b2 = draw.sampled_from([(0.9, 0.999), (0.9, 0.95), (0.0, 0.5)])
    eps = draw.sampled_from([1e-8, 1e-6])
    wd = draw.sampled_from([0.0, 0.01, 0.1])
    n = len(shapes)

    def build(lv):
        pick = lambda c: [view_as_layout(lv[f"{c}{i}"], layouts[f"{c}{i}"]) for i in range(n)]  # noqa: E731
        return (pick("p"), pick("g"), pick("m"), pick("v"), step, lr, b1, b2, eps, wd), \
            ({"master_params": pick("master")} if masters else {})

    return Sample(leaves, build, note=f"step {step}, lr {lr}, betas {b1},{b2}, eps {eps}, wd {wd}, masters {masters}")


def _bench(device, dtype):
    params, grads = lora_tensors(device, dtype), lora_tensors(device, dtype)
    moments = [[torch.zeros_like(p, dtype=torch.float32) for p in params] for _ in range(2)]
    n = sum(p.numel() for p in params)
    return f"{len(params)} tensors, {n / 1e6:.0f}M values", (params, grads, *moments, 1, 1e-4, 0.9, 0.999, 1e-8, 0.0)


def _call(p=None, g=None, m=None, v=None, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.0, **kw):
    def args():
        P = [torch.zeros(2, 2), torch.zeros(5)]
        zeros = lambda: [torch.zeros_like(x) for x in P]  # noqa: E731
        return ((p or (lambda: P))(), (g or zeros)(), (m or zeros)(), (v or zeros)(), step, lr, *betas, eps, wd,
                *([kw["master"]()] if "master" in kw else []))
    return args


def _grad_as_moment():
    g = [torch.zeros(3)]
    return [torch.zeros(3)], g, g, [torch.zeros(3)], 1, 1e-3, 0.9, 0.999, 1e-8, 0.0


CASE = OpCase(
    OPS["v4_adam_step"], samples=samples, benchmarks=(_bench,),
    errors=(
        ErrorCase("lists of different lengths", _call(g=lambda: [torch.zeros(2, 2)]), "must be lists of one length, got 2, 1"),
        ErrorCase("float64 moments", _call(m=lambda: [torch.zeros(2, 2, dtype=torch.float64), torch.zeros(5)]),
                  "exp_avgs[0] and exp_avg_sqs[0] must be float32"),
        ErrorCase("step 0", _call(step=0), "step must be >= 1, got 0"),
        ErrorCase("beta1 = 1", _call(betas=(1.0, 0.999)), "betas must lie in [0, 1)"),
        ErrorCase("NaN learning rate", _call(lr=float("nan")), "lr and weight_decay must be finite"),
        ErrorCase("a gradient of another shape", _call(g=lambda: [torch.zeros(3), torch.zeros(5)]),
                  "grads[0] has shape [3] but params[0] has shape [2, 2]"),
        ErrorCase("an expanded parameter", _call(p=lambda: [torch.zeros(2, 1).expand(2, 2), torch.zeros(5)]),
                  "params[0] has elements that share memory"),
        ErrorCase("float16 masters", _call(master=lambda: [torch.zeros(2, 2, dtype=torch.float16), torch.zeros(5)]),
                  "master_params[0] must be float32"),
        ErrorCase("too few masters", _call(master=lambda: [torch.zeros(2, 2)]), "master_params must be empty or as long as params"),
        ErrorCase("a moment that is the gradient", _grad_as_moment, "grads[0] and exp_avgs[0] share memory"),
    ),
)
