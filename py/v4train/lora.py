"""LoRA adapters: added to a model as parameters beside the weights they adapt (the names of
v4train.reference.lora.adapter_names), their scaling and dropout on each decoder layer; saved and
loaded in PEFT's format.

Targets are module names matched as PEFT does (a target t matches module m when m == t or m
ends with "." + t); `experts` adds an adapter to each routed expert of the fused expert
tensors (PEFT's `target_parameters` mlp.experts.gate_up_proj / mlp.experts.down_proj). The
router, the DSA indexer and the norms are never adapted.

PEFT layout (peft 0.21, transformers 5.x models), per adapted module m:
  base_model.model.<m>.lora_A.weight [r, in], .lora_B.weight [out, r]
and for the fused experts of a layer (E experts, rank r each, packed along the rank axis):
  base_model.model.<layer>.mlp.experts.base_layer.lora_A.weight [E*r, H]   (gate_up_proj; row e*r + k)
  base_model.model.<layer>.mlp.experts.base_layer.lora_B.weight [2I, E*r]  (column k*E + e)
  base_model.model.<layer>.mlp.experts.lora_A.weight [E*r, I]              (down_proj)
  base_model.model.<layer>.mlp.experts.lora_B.weight [H, E*r]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import torch
from safetensors.torch import load_file, save_file

from v4train.hf_checkpoint import nonfinite, read_json
from v4train.model import CausalLM, layer_prefix, put_parameter
from v4train.reference.lora import adapter_names

EXPERT_TENSORS = ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")  # PEFT's order: down_proj outermost
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    r: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]
    experts: bool

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def _matches(module: str, targets) -> bool:
    return any(module == t or module.endswith("." + t) for t in targets)


def _adaptable(model: CausalLM, spec) -> bool:
    return spec.name.endswith(".weight") and len(spec.shape) == 2 and \
        not any(x in spec.name for x in model.family.lora_excluded)


def targeted(model: CausalLM, lcfg: LoraConfig, layer: int) -> list:
    """The layer's weight specs that get an adapter."""
    out = []
    for spec in model.family.layer_specs(model.cfg, layer):
        if spec.experts:
            if lcfg.experts:
                out.append(spec)
        elif _adaptable(model, spec) and _matches(layer_prefix(layer) + spec.name.removesuffix(".weight"),
                                                  lcfg.target_modules):
            out.append(spec)
    return out


def has_experts(model: CausalLM) -> bool:
    """Whether the model has routed experts (what --lora_experts adapts)."""
    return any(spec.experts for i in range(len(model.layers)) for spec in model.family.layer_specs(model.cfg, i))


def _modules(model: CausalLM) -> list[str]:
    """Every module a LoRA target can name, by full name (model.layers.{i}.self_attn.o_proj)."""
    return [layer_prefix(i) + s.name.removesuffix(".weight") for i in range(len(model.layers))
            for s in model.family.layer_specs(model.cfg, i) if _adaptable(model, s)]


def _in_a_layer(modules: list[str]) -> list[str]:
    """The modules' names within a layer (without model.layers.{i}.), each once."""
    return sorted({m.split(".", 3)[3] for m in modules})


def expand_targets(model: CausalLM, names) -> tuple[str, ...]:
    """--lora_target_modules as targets: 'attention' becomes those of the family's attention
    projections that this model has (a Qwen3.5 model may have no linear-attention layer);
    'all-linear' (PEFT's name) every linear map of the layers that LoRA adapts here (the routers,
    the DSA indexer and the routed experts' own tensors, which --lora_experts adapts, are no target)."""
    modules = _modules(model)
    attention = [a for a in model.family.attention_targets if any(_matches(m, [a]) for m in modules)]
    every = _in_a_layer(modules)
    return tuple(t for name in names for t in {"attention": attention, "all-linear": every}.get(name, [name]))


def adapter_shapes(model: CausalLM, lcfg: LoraConfig,
                   source: str = "--lora_target_modules") -> dict[str, tuple[tuple[int, ...], int]]:
    """{full adapter name: (shape, fan_in)} of every adapter the config asks for. Fails when a
    target matches no module (naming it, the `source` of the targets, and what could be targeted)."""
    modules = _modules(model)
    unmatched = [t for t in lcfg.target_modules if not any(_matches(m, [t]) for m in modules)]
    out = {}
    for i in range(len(model.layers)):
        for spec in targeted(model, lcfg, i):
            *lead, out_f, in_f = spec.shape  # [E, out, in] for fused experts
            shapes = ((*lead, lcfg.r, in_f), (*lead, out_f, lcfg.r))
            for name, shape in zip(adapter_names(spec.name), shapes):
                out[layer_prefix(i) + name] = (shape, in_f)
    if unmatched or not out:
        what = f"{', '.join(unmatched)} matches no module" if unmatched else "nothing to adapt"
        candidates = _in_a_layer(modules)
        raise ValueError(f"{source}={','.join(lcfg.target_modules)}: {what} of {model.cfg.model_type}; modules: "
                         f"{', '.join(candidates)}")
    return out


def add_adapters(model: CausalLM, lcfg: LoraConfig, dtype: torch.dtype, device, seed: int) -> dict[str, torch.Tensor]:
    """Creates the adapters (A: PEFT's kaiming-uniform, B: zeros) as parameters of the model,
    beside the weights they adapt; sets each layer's LoRA scaling and dropout.

    Returns them by full name (model.layers.{i}.<module>.lora_A|B). Fails when the targets
    match nothing, naming what could have been targeted.
    """
    gen = torch.Generator().manual_seed(seed)
    adapters = {}
    for name, (shape, fan_in) in adapter_shapes(model, lcfg).items():
        if name.endswith("lora_A"):
            bound = 1 / math.sqrt(fan_in)
            t = torch.empty(shape).uniform_(-bound, bound, generator=gen).to(device=device, dtype=dtype)
        else:
            t = torch.zeros(shape, device=device, dtype=dtype)
        adapters[name] = put_parameter(model, name, t, requires_grad=True)
    for layer in model.layers:
        layer.lora_scaling = lcfg.scaling
        layer.lora_dropout = lcfg.dropout
    return adapters


def _adapted(name: str) -> tuple[str, str]:
    """(the adapted weight's name, "lora_A" or "lora_B") of the adapter tensor `name`."""
    which = name[-len("lora_A"):]
    base = name[: -len(".lora_A")]
    return (base if name[-len("_lora_A")] == "_" else base + ".weight"), which


def _is_expert(name: str) -> bool:
    return _adapted(name)[0].endswith(EXPERT_TENSORS)


def _peft_key(name: str) -> str:
    """The PEFT key of the adapter tensor `name`."""
    weight, which = _adapted(name)
    if _is_expert(name):  # gate_up_proj is wrapped inside down_proj's ParamWrapper: base_layer
        module = weight[: weight.rindex("mlp.experts.")] + "mlp.experts" + (".base_layer" if weight.endswith("gate_up_proj") else "")
    else:
        module = weight.removesuffix(".weight")
    return f"base_model.model.{module}.{which}.weight"


def _peft_tensors(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in adapters.items():
        t = t.detach().float().cpu()
        if _is_expert(name):
            E = t.shape[0]
            if name.endswith("lora_A"):  # [E, r, in] -> [E*r, in], row e*r + k
                t = t.reshape(E * t.shape[1], t.shape[2])
            else:  # [E, out, r] -> [out, r*E], column k*E + e
                t = t.permute(1, 2, 0).reshape(t.shape[1], -1)
        out[_peft_key(name)] = t.contiguous()
    return out


def save_peft(model: CausalLM, adapters: dict[str, torch.Tensor], lcfg: LoraConfig, out_dir: str,
              base_model_dir: str) -> None:
    """adapter_config.json + adapter_model.safetensors in out_dir (which must exist)."""
    has_modules = any(not _is_expert(n) for n in adapters)
    has_experts = any(_is_expert(n) for n in adapters)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "peft_version": "0.21.2",
        "base_model_name_or_path": os.path.abspath(base_model_dir),
        # peft refuses a dropout on adapters of parameters (the fused experts: "lora.ParamWrapper does
        # not work with lora_dropout != 0"); a dropout acts in training only, so the adapter says 0.
        "r": lcfg.r, "lora_alpha": lcfg.alpha, "lora_dropout": 0.0 if has_experts else lcfg.dropout, "bias": "none",
        "target_modules": sorted(set(lcfg.target_modules)) if has_modules else [],
        "target_parameters": list(EXPERT_TENSORS) if has_experts else [],
        "fan_in_fan_out": False, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
    }
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_file(_peft_tensors(adapters), os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})


def read_config(adapter_dir: str) -> LoraConfig:
    """The LoraConfig of a PEFT adapter's adapter_config.json; errors name the file."""
    path = os.path.join(adapter_dir, ADAPTER_CONFIG)
    config = read_json(path)
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{path}: only plain LoRA adapters (no DoRA, no rank/alpha patterns) are supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError(f"{path}: target_modules as a regex is not supported; list module names")
    if not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise ValueError(f"{path}: target_modules must be a list of module names, got {json.dumps(targets)}")

    def number(key, default=None):
        value = config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: {key} must be a number, got {json.dumps(value)}")
        return value

    return LoraConfig(r=int(number("r")), alpha=float(number("lora_alpha")), dropout=float(number("lora_dropout", 0.0)),
                      target_modules=tuple(targets), experts=bool(config.get("target_parameters")))


def read_peft(model: CausalLM, adapter_dir: str) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter (as save_peft writes it): its config and tensors by v4train name."""
    lcfg = read_config(adapter_dir)
    shapes = adapter_shapes(model, lcfg, source=os.path.join(adapter_dir, ADAPTER_CONFIG) + ": target_modules")
    stored = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
    keys = {name: _peft_key(name) for name in shapes}
    problems = [f"missing {keys[n]}" for n in shapes if keys[n] not in stored]
    problems += [f"unexpected {k}" for k in sorted(set(stored) - set(keys.values()))]
    out = {}
    for name, (shape, _) in shapes.items():
        if keys[name] not in stored:
            continue
        v = stored[keys[name]]
        if _is_expert(name):
            E = shape[0]
            v = v.reshape(E, -1, v.shape[1]) if name.endswith("lora_A") else v.reshape(v.shape[0], -1, E).permute(2, 0, 1)
        if tuple(v.shape) != shape:
            problems.append(f"{keys[name]}: shape {list(stored[keys[name]].shape)} does not fit {list(shape)}")
        elif nonfinite(v):
            problems.append(f"{keys[name]}: {nonfinite(v)}")
        out[name] = v
    if problems:
        raise ValueError(f"{adapter_dir}: the adapter does not fit {model.cfg.model_type}:\n  " + "\n  ".join(problems[:20]))
    return lcfg, out


def load_peft(model: CausalLM, adapter_dir: str, dtype: torch.dtype, device) -> tuple[LoraConfig, dict]:
    """Adds the adapter of adapter_dir to the model; returns its config and tensors."""
    lcfg, stored = read_peft(model, adapter_dir)
    adapters = add_adapters(model, lcfg, dtype, device, seed=0)
    with torch.no_grad():
        for name, t in adapters.items():
            t.copy_(stored[name])
    return lcfg, adapters
