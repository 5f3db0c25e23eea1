"""v4_qwen3_5_layer_forward beyond the drawn samples: a checkpointed MoE layer's recomputation
repeats the first pass's routing (parity/recompute.py)."""

import torch

from parity.recompute import assert_recomputation_repeats_choices
from v4train.layer_call import Batch, LayerOptions
from v4train.models.qwen3_5.layer import Qwen35LayerWeights
from v4train.ops import OPS, REFERENCE
from v4train.reference.lora import bind
from v4train.testing import ties
from v4train.testing.cases.glm5_layer_forward import layer_leaves
from v4train.testing.cases.mla_dsa_attention import packed
from v4train.testing.cases.qwen3_5_layer_forward import small_config
from v4train.models.qwen3_5 import FAMILY
from v4train.models.qwen3_5.weights import layer_specs
from v4train.testing.samples import RandomDraw, Sample, make_leaf

NAME = "v4_qwen3_5_layer_forward"


def choosing_layer(layer: int) -> Sample:
    """A checkpointed MoE layer (0: Gated DeltaNet, 1: gated attention) of 16 experts top-2 over
    6 tokens, in float32: some experts get no token."""
    cfg = small_config(RandomDraw(5), moe=True)
    cfg = type(cfg)(**{**cfg.__dict__, "num_experts": 16, "num_experts_per_tok": 2})
    weights, scaling = layer_leaves(RandomDraw(5), cfg, layer, torch.float32, "cpu", 9, layer_specs, FAMILY.lora_excluded)
    positions, cu = packed([6], "cpu")
    leaves = {"hidden": make_leaf((6, cfg.hidden_size), "contiguous", torch.float32, "cpu", 109), **weights}

    def build(lv):
        return (lv["hidden"], bind(Qwen35LayerWeights, lv), cfg, layer, Batch(positions, cu), LayerOptions(scaling, 0.0, True)), {}

    return Sample(leaves, build, note=f"layer {layer}, 6 tokens, 16 experts top-2, checkpointed")


def test_the_recomputation_repeats_the_routing():
    """A router row of an expert no token chose, made 1.1 times the row of the expert that scores
    highest for some token, after the forward pass: a recomputation that routed again would send
    that token there; the chosen experts' weights are
    renormalised over the chosen ones, so the recorded routing's gradients do not change."""
    for layer in (0, 1):
        sample = choosing_layer(layer)
        args, kwargs = sample.build({k: v.detach() for k, v in sample.leaves.items()})
        seen = []
        with torch.no_grad():
            REFERENCE[NAME](*args, **kwargs, ops=ties._table(REFERENCE, None, seen))
        _, call, routing = seen[0]
        unused = sorted(set(range(16)) - set(routing.reshape(-1).tolist()))
        assert unused, "every expert got a token: nothing to change"
        logits = call["x"] @ call["weights"].gate.T
        best = logits.max(-1).values.argmax()  # the token whose chosen expert scores highest (> 0)
        assert logits[best].max() > 0

        def change(w, u=unused[0], e=int(logits[best].argmax())):
            w.moe.gate[u] = 1.1 * w.moe.gate[e]  # above expert e where it scores > 0
        assert_recomputation_repeats_choices(OPS[NAME].cpp(), sample, change)
