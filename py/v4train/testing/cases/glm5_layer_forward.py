"""v4_glm5_layer_forward: one GLM-5 decoder layer (MLA + DSA attention, dense MLP or MoE)."""

import dataclasses

import torch

from v4train.layer_call import Batch, LayerOptions
from v4train.model import CausalLM
from v4train.models import config_from_dict
from v4train.models.glm5.layer import Glm5LayerWeights
from v4train.models.glm5.weights import layer_specs
from v4train.reference.lora import bind
from v4train.testing.cases.mla_dsa_attention import documents, packed, random_selection, small_config
from v4train.ops import OPS
from v4train.testing.case import ErrorCase, OpCase
from v4train.testing.samples import Sample, checkpoint_block, layout, lora_dropout, make_leaf, seed, view_as_layout, weight_leaves, width
from v4train.testing.ties import rerouted
from v4train.models.glm5.layer import v4_glm5_layer_forward


def layer_leaves(draw, cfg, layer: int, dtype, device, s, specs_of=layer_specs, excluded=("indexer",)):
    """A layer's tensors from the family's weight table (GLM-5's by default; fp32 where
    transformers keeps fp32), norms around 1, biases small, LoRA on a drawn subset of the
    projections and experts (none on names containing one of `excluded`)."""
    specs = specs_of(cfg, layer)
    adaptable = {sp.name: sp.shape for sp in specs
                 if len(sp.shape) >= 2 and not sp.fp32 and not any(x in sp.name for x in excluded)}
    weights, scaling = weight_leaves(draw, adaptable, dtype, device, s)
    for i, sp in enumerate(specs):
        if sp.name in weights:
            continue
        shift = 1.0 if sp.init == "ones" else 0.0
        weights[sp.name] = make_leaf(sp.shape, "contiguous", torch.float32 if sp.fp32 else dtype, device, s + 200 + i,
                                     scale=0.1 if sp.init != "normal" else 0.3, shift=shift)
    return weights, scaling


def samples(draw, dtype: torch.dtype, device) -> Sample:
    shared = draw.booleans()
    moe = draw.booleans()
    n_group = draw.sampled_from([1, 2])
    experts = n_group * draw.sampled_from([2, 3])
    cfg = small_config(draw, dtype, layers=2, indexer_types=["full", "shared"],
                       mlp_layer_types=["sparse" if moe else "dense"] * 2, intermediate_size=width(draw, 24, dtype),
                       moe_intermediate_size=width(draw, 16, dtype), n_routed_experts=experts, n_group=n_group,
                       topk_group=1, num_experts_per_tok=draw.integers(1, experts // n_group))
    layer = 1 if shared else 0
    lengths = documents(draw, cfg.index_topk)
    checkpoint = draw.booleans()
    h_layout, s = layout(draw), seed(draw)
    dropout = lora_dropout(draw, checkpoint, device)
    weights, scaling = layer_leaves(draw, cfg, layer, dtype, device, s)
    positions, cu = packed(lengths, device)
    carry = random_selection(lengths, cfg.index_topk, torch.Generator().manual_seed(s)).to(device) if shared else None
    leaves = {"hidden": make_leaf((sum(lengths), cfg.hidden_size), h_layout, dtype, device, s + 100), **weights}
    block = checkpoint_block(draw, checkpoint, dropout, sum(lengths))  # (drawn last: the other draws as before)

    def build(lv):
        return (view_as_layout(lv["hidden"], h_layout), bind(Glm5LayerWeights, lv), cfg, layer, Batch(positions, cu),
                LayerOptions(scaling, dropout, checkpoint, checkpoint_block=block), carry), {}

    return Sample(leaves, build, note=f"documents {lengths}, {'MoE' if moe else 'dense'}, shared {shared}, "
                                      f"checkpoint {checkpoint} (blocks of {block}), dropout {dropout}, cfg {cfg}",
                  reroute=(lambda args, kwargs, out, seed: rerouted(v4_glm5_layer_forward, args, kwargs, out, seed)) if moe else None)


def proxy_config(layers: int = 4):
    """The GLM-5 proxy of ../shared/notes/baselines.md: GlmMoeDsaConfig defaults, 4 layers (1 dense +
    3 MoE), 32 routed experts top-8."""
    return {"model_type": "glm_moe_dsa", "num_hidden_layers": layers, "n_routed_experts": 32, "first_k_dense_replace": 1}


def _bench(device, dtype, tokens=4096):
    """One GLM-5 MoE layer of the proxy (hidden 6144, 64 heads, DSA top-2048, 32 experts top-8)."""

    cfg = config_from_dict(proxy_config(2))
    model = CausalLM.random(cfg, {}, dtype, device)
    for p in model.layers[1].parameters():
        p.requires_grad_()
    w = model.layers[1].weights
    h = torch.randn(tokens, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
    positions, cu = packed([tokens], device)
    return f"one MoE layer, {tokens} tokens", (h, w, cfg, 1, Batch(positions, cu), LayerOptions())


def _call(layer=0, dropout=0.0, **replaced):
    """A call of a one-layer model's layer 0 weights (some replaced) as layer `layer`."""
    def args():
        cfg = config_from_dict({"model_type": "glm_moe_dsa", "num_hidden_layers": 1, "hidden_size": 8})
        w = dataclasses.replace(CausalLM.random(cfg, {}, torch.float32).layers[0].weights, **replaced)
        return (torch.zeros(3, 8), w, cfg, layer, Batch(torch.arange(3), torch.tensor([0, 3])),
                LayerOptions(lora_dropout=dropout))
    return args


CASE = OpCase(
    OPS["v4_glm5_layer_forward"], samples=samples, benchmarks=(_bench,),
    errors=(
        ErrorCase("a layer past the config", _call(layer=3), "layer 3 is not one of the config's 1 layers"),
        ErrorCase("dropout 1", _call(dropout=1.0), "lora_dropout must lie in [0, 1), got 1"),
        ErrorCase("a norm on another device", _call(input_layernorm=torch.zeros(8, device="meta")),
                  "weights.input_layernorm is on meta but the input is on cpu"),
    ),
)
