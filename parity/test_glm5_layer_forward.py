"""v4_glm5_layer_forward beyond the drawn samples: a document past the masked-attention limit
(8192 tokens), where the layer attends through the latent path and a checkpointed layer keeps that
attention's outputs for its recomputation instead of attending again; and a checkpointed layer's
recomputation repeating the first pass's routing and DSA selection (parity/recompute.py)."""

import torch

from parity.recompute import assert_recomputation_repeats_choices
from v4train.layer_call import Batch, LayerOptions
from v4train.models.glm5.layer import Glm5LayerWeights
from v4train.ops import OPS, REFERENCE
from v4train.reference.lora import bind
from v4train.testing.check import check_parity
from v4train.testing.compare import assert_close
from v4train.testing.cases.glm5_layer_forward import layer_leaves
from v4train.testing.cases.mla_dsa_attention import packed, small_config
from v4train.testing.samples import RandomDraw, Sample, make_leaf, takes_gradient

NAME = "v4_glm5_layer_forward"
TOKENS = 8200  # past the layer's masked-attention limit of 8192


def long_document(checkpoint: bool) -> Sample:
    draw = RandomDraw(3)
    cfg = small_config(draw, torch.float32, layers=1, indexer_types=["full"], mlp_layer_types=["sparse"],
                       hidden_size=16, index_topk=6, index_n_heads=1, intermediate_size=8, moe_intermediate_size=8,
                       n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2)
    weights, scaling = layer_leaves(draw, cfg, 0, torch.float32, "cpu", 5)
    positions, cu = packed([TOKENS], "cpu")
    leaves = {"hidden": make_leaf((TOKENS, cfg.hidden_size), "contiguous", torch.float32, "cpu", 105), **weights}

    def build(lv):
        return (lv["hidden"], bind(Glm5LayerWeights, lv), cfg, 0, Batch(positions, cu), LayerOptions(scaling, 0.0, checkpoint)), {}

    return Sample(leaves, build, note=f"one document of {TOKENS} tokens, checkpoint {checkpoint}")


def _grads(checkpoint: bool) -> dict[str, torch.Tensor]:
    sample = long_document(checkpoint)
    leaves = {k: v.detach().clone().requires_grad_(takes_gradient(k, sample.leaves)) for k, v in sample.leaves.items()}
    args, kwargs = sample.build(leaves)
    out, _ = OPS[NAME].cpp()(*args, **kwargs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(0)))
    return {"out": out.detach(), **{k: v.grad for k, v in leaves.items()}}


def test_long_document_matches_the_reference():
    check_parity(OPS[NAME], OPS[NAME].cpp(), REFERENCE[NAME], long_document(checkpoint=True), seed=2)


def test_checkpointed_long_document_equals_the_plain_layer():
    plain, ckpt = _grads(False), _grads(True)
    assert [n for n, g in ckpt.items() if g is None] == [n for n, g in plain.items() if g is None]
    for name, g in plain.items():
        if g is not None:
            assert_close(ckpt[name], g, f"checkpointed {name}")


def choosing_layer() -> Sample:
    """A checkpointed MoE layer over a document longer than its DSA top-k, in float32."""
    draw = RandomDraw(4)
    cfg = small_config(draw, torch.float32, layers=1, indexer_types=["full"], mlp_layer_types=["sparse"],
                       hidden_size=16, index_topk=6, index_n_heads=2, intermediate_size=8, moe_intermediate_size=8,
                       n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2)
    weights, scaling = layer_leaves(draw, cfg, 0, torch.float32, "cpu", 7)
    positions, cu = packed([40], "cpu")
    leaves = {"hidden": make_leaf((40, cfg.hidden_size), "contiguous", torch.float32, "cpu", 107), **weights}

    def build(lv):
        return (lv["hidden"], bind(Glm5LayerWeights, lv), cfg, 0, Batch(positions, cu), LayerOptions(scaling, 0.0, True)), {}

    return Sample(leaves, build, note="40 tokens, DSA top-6, 4 experts top-2, checkpointed")


def test_the_recomputation_repeats_the_routing():
    """The correction bias only chooses experts: raised for expert 0 after the forward pass, it
    would send most tokens there in a recomputation that routed again."""
    def change(w):
        w.moe.e_score_correction_bias[0] += 100.0
    assert_recomputation_repeats_choices(OPS[NAME].cpp(), choosing_layer(), change)


def test_the_recomputation_repeats_the_selection():
    """The indexer's weights only select keys: negated after the forward pass, they would select
    other keys in a recomputation that selected again."""
    def change(w):
        w.self_attn.indexer.wq_b.weight.neg_()
    assert_recomputation_repeats_choices(OPS[NAME].cpp(), choosing_layer(), change)
