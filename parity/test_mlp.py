"""v4_mlp beyond the drawn samples: FP8 weights over several 128 x 128 scale blocks (the drawn
samples fit in one), against the weights dequantised as the loader does, and the dequantisation
itself against values worked by hand."""

import torch

from v4train.ops import OPS
from v4train.reference.lora import Linear, dequantize_fp8, quantize_fp8
from v4train.reference.mlp import MlpWeights
from v4train.testing.compare import assert_close

NAME = "v4_mlp"


def test_each_block_is_scaled_by_its_own_scale():
    weight = torch.ones(130, 129).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0, 3.0], [5.0, 7.0]])
    w = dequantize_fp8(weight, scale, torch.float32)
    assert w[0, 0] == 2 and w[127, 127] == 2 and w[0, 128] == 3 and w[128, 0] == 5 and w[129, 128] == 7


def test_quantised_blocks_use_the_range_of_float8():
    weight = torch.zeros(2, 200)
    weight[0, 0], weight[1, 150] = 3.5, -0.25
    q, scale = quantize_fp8(weight)
    assert scale.shape == (1, 2) and torch.equal(scale, torch.tensor([[3.5 / 448, 0.25 / 448]]))
    assert q[0, 0].float() == 448 and q[1, 150].float() == -448 and q[0, 1].float() == 0


def test_fp8_weights_over_several_blocks_equal_the_weights_dequantised_on_load():
    gen = torch.Generator().manual_seed(0)
    shapes = {"gate_proj": (300, 200), "up_proj": (300, 200), "down_proj": (200, 300)}
    dense, fp8 = {}, {}
    for name, shape in shapes.items():
        q, scale = quantize_fp8(torch.randn(shape, generator=gen) * 0.05)
        fp8[name] = Linear(q, scale)
        dense[name] = Linear(dequantize_fp8(q, scale, torch.bfloat16))
    x = torch.randn(37, 200, generator=gen).to(torch.bfloat16).requires_grad_()
    ours = OPS[NAME].cpp()(x, MlpWeights(**fp8))
    (grad_ours,) = torch.autograd.grad(ours, x, torch.ones_like(ours))
    theirs = OPS[NAME].reference(x, MlpWeights(**dense))
    (grad_theirs,) = torch.autograd.grad(theirs, x, torch.ones_like(theirs))
    assert_close(ours, theirs, "output")
    assert_close(grad_ours, grad_theirs, "gradient of x")


def test_an_fp8_weight_keeps_no_dense_copy_for_the_backward_pass():
    """The gradient of x through an FP8 map needs the weight again: the C++ op keeps the FP8 weight
    and its scales for it (a byte a weight, the model's own tensors), not a dequantised copy (two
    bytes a weight in bf16, made for the call: more than the weights dequantised on load)."""
    gen = torch.Generator().manual_seed(1)
    shapes = {"gate_proj": (256, 128), "up_proj": (256, 128), "down_proj": (128, 256)}
    fp8, dense = {}, {}
    for name, shape in shapes.items():
        q, scale = quantize_fp8(torch.randn(shape, generator=gen) * 0.05)
        fp8[name], dense[name] = Linear(q, scale), Linear(dequantize_fp8(q, scale, torch.bfloat16))
    x = torch.randn(16, 128, generator=gen).to(torch.bfloat16).requires_grad_()

    def saved_bytes(weights) -> int:
        total = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: total.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            OPS[NAME].cpp()(x, MlpWeights(**weights))
        return sum(total)
    weight_bytes = sum(2 * r * c for r, c in shapes.values())  # the dense weights in bf16
    scale_bytes = sum(w.weight_scale_inv.numel() * 4 for w in fp8.values())
    # the same activations; the weights at one byte each (and their scales) instead of two
    assert saved_bytes(fp8) <= saved_bytes(dense) - weight_bytes // 2 + scale_bytes
