"""v4_glm5_moe beyond the drawn samples: the SwiGLU and combine CUDA kernels (cc/common/experts.cu)
at widths they take, on every device and dtype."""

import pytest
import torch

from parity.strategies import devices
from v4train.models.glm5.moe import Glm5MoeWeights
from v4train.ops import REFERENCE
from v4train.reference.lora import bind
from v4train.testing.cases import CASES
from v4train.testing.cases.glm5_moe import glm5_moe_weights
from v4train.testing.check import check_parity
from v4train.testing.samples import Sample

OP = CASES["v4_glm5_moe"]


@pytest.mark.parametrize("device,dtype,H", [(d, t, H) for d in devices() for t in (torch.float32, torch.bfloat16)
                                            for H in (16, 2056)])
def test_widths_the_cuda_kernels_take(device, dtype, H):
    """53 tokens, 8 experts of 24, top 6: the SwiGLU of each routed row; the combine weighs and
    sums 6 rows a token (forward) and writes their gradients over them (backward); 2056 wide is
    one 16-byte pack a thread and part of a second. Judged as the drawn samples are (check_parity):
    the output, the routing, and the gradients of x, the router and every expert."""
    gen = torch.Generator().manual_seed(H)
    weights = {k: v.detach() for k, v in glm5_moe_weights(device, dtype, experts=8, hidden=H, inter=24, gen=gen).items()}
    weights["mlp.gate.weight"] = weights["mlp.gate.weight"] * 20  # routing weights that differ
    leaves = {"x": torch.randn(53, H, generator=gen).to(device=device, dtype=dtype), **weights}

    def build(lv):
        w = {k: v for k, v in lv.items() if k != "x"}
        return (lv["x"], bind(Glm5MoeWeights, w, "mlp."), 6, 1, 1, True, 2.5, 0.0, 0.0, None), {}

    check_parity(OP, OP.cpp(), REFERENCE["v4_glm5_moe"], Sample(leaves, build), seed=H)
