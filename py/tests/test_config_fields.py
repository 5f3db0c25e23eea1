"""The model configs and a layer call's Batch and LayerOptions are written once per language, and
these must agree: every field the C++ ops read (the X(type, name, default) lists of
cc/common/config.h, cc/common/layer_call.h and cc/models/<family>/config.h, which both declare the
C++ structs and drive the casters) is a field of the Python dataclass of the same name, of the
matching kind."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest

from v4train import layer_call
from v4train.models import config
from v4train.models.glm5.config import Glm5Config
from v4train.models.qwen3_5.config import Qwen35Config

CC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "cc")
# C++ field type -> the annotation of the Python dataclass field
KINDS = {"int64_t": "int", "double": "float", "bool": "bool", "std::string": "str",
         "std::vector<std::string>": "tuple[str, ...]", "std::optional<double>": "float | None", "Rope": "Rope",
         "at::Tensor": "torch.Tensor"}
# the X list -> (the header that holds it, the Python dataclass)
LISTS = {"V4_ROPE_FIELDS": ("common/config.h", config.Rope),
         "V4_BATCH_FIELDS": ("common/layer_call.h", layer_call.Batch),
         "V4_LAYER_OPTIONS_FIELDS": ("common/layer_call.h", layer_call.LayerOptions),
         "V4_GLM5_CONFIG_FIELDS": ("models/glm5/config.h", Glm5Config),
         "V4_QWEN35_CONFIG_FIELDS": ("models/qwen3_5/config.h", Qwen35Config)}


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
        elif python[name] != KINDS[cpp_type]:
            out.append(f"{cls.__name__}.{name} is {python[name]}, C++ reads {cpp_type} ({KINDS[cpp_type]})")
    return out


@pytest.mark.parametrize("macro", sorted(LISTS))
def test_every_cpp_field_is_a_python_field_of_its_kind(macro):
    assert cpp_fields(macro), f"no X(...) entries found for {macro} in cc/{LISTS[macro][0]}"
    assert disagreements(macro, LISTS[macro][1]) == []


def test_a_disagreement_is_found():
    @dataclasses.dataclass
    class Wrong:
        theta: int  # C++ reads a double
        dim: int
    found = disagreements("V4_ROPE_FIELDS", Wrong)
    assert "Wrong.theta is int, C++ reads double (float)" in found
    assert any("has no field factor" in d for d in found)
