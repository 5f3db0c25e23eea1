"""The model configs, a layer call's Batch and LayerOptions, and the ops' weights are written once
per language, and these must agree: every field the C++ ops read (the X(type, name, default)
lists of cc/common/{config,layer_call,weights}.h, cc/models/<family>/config.h and the ops'
headers, which both declare the C++ structs and drive the casters) is a field of the Python
dataclass of the same name, of the matching kind; and a weights dataclass has no field that C++
does not read (a tensor bound there would be ignored)."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

from v4train import layer_call
from v4train.models import config
from v4train.models.glm5 import attention as glm5_attention, layer as glm5_layer, moe as glm5_moe
from v4train.models.qwen3_5 import attention as qwen_attention, deltanet, layer as qwen_layer, moe as qwen_moe
from v4train.reference import lora, mlp, moe
from v4train.models.glm5.config import Glm5Config
from v4train.models.qwen3_5.config import Qwen35Config

CC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "cc")
# C++ field type -> the annotation of the Python dataclass field
KINDS = {"int64_t": "int", "double": "float", "bool": "bool", "std::string": "str",
         "std::vector<std::string>": "tuple[str, ...]", "std::optional<double>": "float | None", "Rope": "Rope",
         "at::Tensor": "torch.Tensor"}


def kind(cpp_type: str) -> str:
    """The annotation of the Python field for a C++ field type: a struct is its dataclass's name,
    std::optional<T> is T's kind or None."""
    optional = re.fullmatch(r"std::optional<(.+)>", cpp_type)
    if optional and cpp_type not in KINDS:
        return kind(optional.group(1)) + " | None"
    return KINDS.get(cpp_type, cpp_type)


# the X lists of weights -> (the header, the Python dataclass); these must agree both ways
WEIGHTS = {"V4_LINEAR_FIELDS": ("common/weights.h", lora.Linear),
           "V4_MLP_WEIGHTS_FIELDS": ("common/weights.h", mlp.MlpWeights),
           "V4_EXPERTS_WEIGHTS_FIELDS": ("common/weights.h", moe.ExpertsWeights),
           "V4_INDEXER_WEIGHTS_FIELDS": ("models/glm5/mla_dsa_attention.h", glm5_attention.IndexerWeights),
           "V4_MLA_WEIGHTS_FIELDS": ("models/glm5/mla_dsa_attention.h", glm5_attention.MlaWeights),
           "V4_GLM5_MOE_WEIGHTS_FIELDS": ("models/glm5/glm5_moe.h", glm5_moe.Glm5MoeWeights),
           "V4_GLM5_LAYER_WEIGHTS_FIELDS": ("models/glm5/glm5_layer_forward.h", glm5_layer.Glm5LayerWeights),
           "V4_GATED_DELTANET_WEIGHTS_FIELDS": ("models/qwen3_5/gated_deltanet.h", deltanet.GatedDeltaNetWeights),
           "V4_GATED_ATTENTION_WEIGHTS_FIELDS": ("models/qwen3_5/gated_attention.h", qwen_attention.GatedAttentionWeights),
           "V4_QWEN35_MOE_WEIGHTS_FIELDS": ("models/qwen3_5/qwen3_5_moe.h", qwen_moe.Qwen35MoeWeights),
           "V4_QWEN35_LAYER_WEIGHTS_FIELDS": ("models/qwen3_5/qwen3_5_layer_forward.h", qwen_layer.Qwen35LayerWeights)}
# the X list -> (the header that holds it, the Python dataclass)
LISTS = {"V4_ROPE_FIELDS": ("common/config.h", config.Rope),
         "V4_BATCH_FIELDS": ("common/layer_call.h", layer_call.Batch),
         "V4_LAYER_OPTIONS_FIELDS": ("common/layer_call.h", layer_call.LayerOptions),
         "V4_EXPERT_PARALLEL_FIELDS": ("common/layer_call.h", layer_call.ExpertParallel),
         "V4_GLM5_CONFIG_FIELDS": ("models/glm5/config.h", Glm5Config),
         "V4_QWEN35_CONFIG_FIELDS": ("models/qwen3_5/config.h", Qwen35Config), **WEIGHTS}


def cpp_fields(macro: str) -> list[tuple[str, str]]:
    """(C++ type, name) of each X(...) entry of the #define `macro`."""
    text = open(os.path.join(CC, LISTS[macro][0])).read()
    body = re.search(rf"#define {macro}\(X\)(.*?)\n\n", text, re.S).group(1)
    return [(t.strip(), n.strip()) for t, n in re.findall(r"X\(([^,]+(?:<[^>]*>)?),\s*(\w+),", body)]


def disagreements(macro: str, cls) -> list[str]:
    python = {f.name: f.type for f in dataclasses.fields(cls)}
    out = []
    for cpp_type, name in cpp_fields(macro):
        if name not in python:
            out.append(f"{cls.__name__} has no field {name} (C++ {cpp_type})")
        elif python[name] != kind(cpp_type):
            out.append(f"{cls.__name__}.{name} is {python[name]}, C++ reads {cpp_type} ({kind(cpp_type)})")
    if macro in WEIGHTS:
        read = {n for _, n in cpp_fields(macro)}
        out += [f"{cls.__name__}.{name} is not read by C++" for name in python if name not in read]
    return out


@pytest.mark.parametrize("macro", sorted(LISTS))
def test_every_cpp_field_is_a_python_field_of_its_kind(macro):
    assert cpp_fields(macro), f"no X(...) entries found for {macro} in cc/{LISTS[macro][0]}"
    assert disagreements(macro, LISTS[macro][1]) == []


def test_a_weights_field_that_cpp_does_not_read_is_found():
    @dataclasses.dataclass
    class MlpWeights:
        gate_proj: Linear  # noqa: F821
        up_proj: Linear  # noqa: F821
        down_proj: Linear  # noqa: F821
        bias: torch.Tensor  # noqa: F821
    assert disagreements("V4_MLP_WEIGHTS_FIELDS", MlpWeights) == ["MlpWeights.bias is not read by C++"]


def test_a_disagreement_is_found():
    @dataclasses.dataclass
    class Wrong:
        theta: int  # C++ reads a double
        dim: int
    found = disagreements("V4_ROPE_FIELDS", Wrong)
    assert "Wrong.theta is int, C++ reads double (float)" in found
    assert any("has no field factor" in d for d in found)


def test_bind_pairs_each_weight_with_its_adapter_and_names_a_missing_tensor():
    t = {n: torch.zeros(2, 2) for n in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                                          "mlp.up_proj.lora_A", "mlp.up_proj.lora_B")}
    w = lora.bind(mlp.MlpWeights, t, "mlp.")
    assert w.up_proj.weight is t["mlp.up_proj.weight"]
    assert w.up_proj.lora_A is t["mlp.up_proj.lora_A"] and w.up_proj.lora_B is t["mlp.up_proj.lora_B"]
    assert w.gate_proj.lora_A is None and w.down_proj.lora_B is None
    experts = lora.bind(moe.ExpertsWeights, {"mlp.experts.gate_up_proj": torch.zeros(2, 4, 2),
                                             "mlp.experts.gate_up_proj_lora_A": torch.zeros(2, 1, 2),
                                             "mlp.experts.gate_up_proj_lora_B": torch.zeros(2, 4, 1),
                                             "mlp.experts.down_proj": torch.zeros(2, 2, 2)}, "mlp.experts.")
    assert experts.gate_up_proj.lora_A is not None and experts.down_proj.lora_A is None
    with pytest.raises(ValueError, match="weights lack the tensor mlp.down_proj.weight"):
        lora.bind(mlp.MlpWeights, {k: v for k, v in t.items() if k != "mlp.down_proj.weight"}, "mlp.")
    # an optional part is None where its first tensor is absent: a dense GLM-5 layer has no router
    dense = {"input_layernorm.weight": torch.ones(2), "post_attention_layernorm.weight": torch.ones(2),
             **{k: v for k, v in t.items()}, **{f"self_attn.{n}.weight": torch.zeros(2, 2) for n in (
                 "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_layernorm", "kv_a_layernorm")}}
    layer = lora.bind(glm5_layer.Glm5LayerWeights, dense)
    assert layer.moe is None and layer.mlp is not None and layer.self_attn.indexer is None
