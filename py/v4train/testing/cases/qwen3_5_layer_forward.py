"""v4_qwen3_5_layer_forward: one Qwen3.5 decoder layer (Gated DeltaNet or gated attention, MoE or MLP)."""

import dataclasses

import torch

from v4train.layer_call import Batch, LayerOptions
from v4train.model import CausalLM
from v4train.models import config_from_dict
from v4train.models.qwen3_5 import FAMILY
from v4train.models.qwen3_5.layer import Qwen35LayerWeights
from v4train.models.qwen3_5.weights import layer_specs
from v4train.testing.cases.gated_delta_rule import chunk_documents
from v4train.testing.cases.glm5_layer_forward import layer_leaves
from v4train.testing.cases.mla_dsa_attention import packed
from v4train.ops import OPS
from v4train.reference.lora import bind
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import Sample, checkpoint_block, layout, lora_dropout, make_leaf, seed, view_as_layout
from v4train.testing.ties import rerouted
from v4train.models.qwen3_5.layer import v4_qwen3_5_layer_forward


def small_config(draw, moe: bool):
    """A Qwen3.5 config of drawn small dimensions: one Gated DeltaNet and one gated attention layer."""
    nk = draw.integers(1, 2)
    d = dict(model_type="qwen3_5_moe" if moe else "qwen3_5", num_hidden_layers=2, hidden_size=8 * draw.integers(1, 3),
             layer_types=["linear_attention", "full_attention"], linear_num_key_heads=nk,
             linear_num_value_heads=nk * draw.sampled_from([1, 2]), linear_key_head_dim=4 * draw.integers(1, 3),
             linear_value_head_dim=4 * draw.integers(1, 3), linear_conv_kernel_dim=draw.integers(2, 4),
             num_attention_heads=2, num_key_value_heads=draw.sampled_from([1, 2]), head_dim=8,
             intermediate_size=16, moe_intermediate_size=8, shared_expert_intermediate_size=8,
             num_experts=draw.sampled_from([2, 4]), num_experts_per_tok=draw.integers(1, 2),
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": draw.sampled_from([0.5, 1.0])})
    return config_from_dict(d)


def samples(draw, dtype: torch.dtype, device) -> Sample:
    moe, layer, checkpoint = draw.booleans(), draw.integers(0, 1), draw.booleans()
    dropout = lora_dropout(draw, checkpoint, device)
    cfg = small_config(draw, moe)
    lengths = chunk_documents(draw)
    h_layout, s = layout(draw), seed(draw)
    weights, scaling = layer_leaves(draw, cfg, layer, dtype, device, s, layer_specs, FAMILY.lora_excluded)
    positions, cu = packed(lengths, device)
    leaves = {"hidden": make_leaf((sum(lengths), cfg.hidden_size), h_layout, dtype, device, s + 100), **weights}
    block = checkpoint_block(draw, checkpoint, dropout, sum(lengths))  # (drawn last: the other draws as before)

    def build(lv):
        return (view_as_layout(lv["hidden"], h_layout), bind(Qwen35LayerWeights, lv), cfg, layer, Batch(positions, cu.to(device)),
                LayerOptions(scaling, dropout, checkpoint, checkpoint_block=block)), {}

    return Sample(leaves, build, note=f"documents {lengths}, {cfg.layer_types[layer]}, {'MoE' if moe else 'dense'}, "
                                      f"checkpoint {checkpoint} (blocks of {block}), dropout {dropout}, cfg {cfg}",
                  reroute=(lambda args, kwargs, out, seed: rerouted(v4_qwen3_5_layer_forward, args, kwargs, out, seed)) if moe else None)


def _call(layer=0, dropout=0.0, **replaced):
    """A call of a one-layer model's layer 0 weights (some replaced) as layer `layer`."""
    def args():
        cfg = config_from_dict({"model_type": "qwen3_5", "num_hidden_layers": 1, "hidden_size": 8})
        w = dataclasses.replace(CausalLM.random(cfg, {}, torch.float32).layers[0].weights, **replaced)
        return (torch.zeros(3, 8), w, cfg, layer, Batch(torch.arange(3), torch.tensor([0, 3])),
                LayerOptions(lora_dropout=dropout))
    return args


CASE = OpCase(
    OPS["v4_qwen3_5_layer_forward"], samples=samples,
    errors=(
        ErrorCase("a layer past the config's", _call(layer=3), "layer 3 is not one of the config's 1 layers"),
        ErrorCase("lora_dropout of 1", _call(dropout=1.0), "lora_dropout must lie in [0, 1), got 1"),
        ErrorCase("a norm on another device", _call(input_layernorm=torch.zeros(8, device="meta")),
                  "weights.input_layernorm is on meta but the input is on cpu"),
    ),
)
