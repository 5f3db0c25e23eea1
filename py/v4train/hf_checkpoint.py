"""Hugging Face checkpoints: config.json + safetensors (single file or sharded), read and written.

Reading maps the checkpoint's keys onto the model's weight table (v4train.models): the
`model.language_model.` prefix of the vision-language Qwen3.5 releases becomes `model.`, the
vision tower and the MTP layers are skipped (and reported), per-expert tensors are packed into
one [E, ...] tensor per projection, and FP8 weights (float8_e4m3fn with a 128x128-block
`weight_scale_inv`) are dequantised. Every problem (missing, unexpected, mis-shaped tensors, a
truncated file) is collected and reported in one error before anything is returned.
Writing produces the layout transformers reads: per-expert keys, shards above a size limit with
model.safetensors.index.json, written to a temporary folder and renamed into place.
"""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from v4train.atomic import atomic_dir
from v4train.models import config_from_dict, load_config
from v4train.models.causal_lm import CausalLM, all_specs

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FP8_BLOCK = 128


class CheckpointError(ValueError):
    pass


def _files(model_dir: str) -> dict[str, str]:
    """key -> file path, from the index of a sharded checkpoint or the single file's header."""
    index = os.path.join(model_dir, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map")
        return {k: os.path.join(model_dir, v) for k, v in weight_map.items()}
    single = os.path.join(model_dir, SINGLE)
    if not os.path.exists(single):
        raise CheckpointError(f"{model_dir}: neither {SINGLE} nor {INDEX} found")
    with _open(single) as f:
        return {k: single for k in f.keys()}


def _open(path: str):
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise CheckpointError(f"{path}: cannot read safetensors file ({e}); is it truncated?") from None


_SKIP = [
    (re.compile(r"^model\.visual\."), "vision tower"),
    (re.compile(r"^(model\.)?mtp\."), "MTP layers"),
]


def canonical_key(key: str) -> str:
    """The text model's name of a checkpoint key (model.language_model.* -> model.*)."""
    return "model." + key[len("model.language_model."):] if key.startswith("model.language_model.") else key


def _dequant_fp8(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """w * scale_inv per 128x128 block (DeepSeek-V3 / GLM-5 FP8 checkpoints)."""
    rows, cols = w.shape
    s = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return w.float() * s


def load(model_dir: str, dtype: torch.dtype = torch.float32, device="cpu") -> tuple[CausalLM, dict]:
    """The model in `dtype` on `device`, and a report {'skipped': {reason: count}}."""
    cfg = load_config(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        hf_config = json.load(f)
    files = _files(model_dir)
    handles: dict[str, object] = {}

    def read(key):
        path = files[key]
        if path not in handles:
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: listed in {INDEX} but missing")
            handles[path] = _open(path)
        try:
            return handles[path].get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {key} ({e}); is the file truncated?") from None

    available = {}  # canonical key -> checkpoint key
    skipped: dict[str, int] = {}
    layer_re = re.compile(r"^model\.layers\.(\d+)\.")
    for key in files:
        reason = next((why for pattern, why in _SKIP if pattern.search(key)), None)
        canon = canonical_key(key)
        m = layer_re.match(canon)
        if reason is None and m and int(m.group(1)) >= cfg.num_hidden_layers:
            reason = "layers past num_hidden_layers (MTP)"
        if reason:
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            available[canon] = key

    problems, weights, used = [], {}, set()
    for spec in all_specs(cfg):
        target = torch.float32 if spec.fp32 else dtype
        try:
            if spec.experts and spec.name not in available:
                t, keys = _read_experts(spec, available, read)
                used.update(keys)
            elif spec.name in available:
                t, keys = _read_weight(spec.name, available, read)
                used.update(keys)
            else:
                problems.append(f"missing tensor {spec.name} {list(spec.shape)}")
                continue
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if tuple(t.shape) != spec.shape:
            problems.append(f"{spec.name}: shape {list(t.shape)}, expected {list(spec.shape)}")
            continue
        weights[spec.name] = t.to(device=device, dtype=target)
    unexpected = sorted(set(available) - used)
    problems += [f"unexpected tensor {k}" for k in unexpected[:20]]
    if len(unexpected) > 20:
        problems.append(f"... and {len(unexpected) - 20} more unexpected tensors")
    if problems:
        raise CheckpointError(f"{model_dir}: the checkpoint does not match its config ({cfg.model_type}):\n  "
                              + "\n  ".join(problems))
    return CausalLM(cfg, weights, hf_config), {"skipped": skipped}


def _read_weight(key, available, read):
    """The tensor `key` in floating point (an FP8 weight dequantised with its weight_scale_inv),
    and the checkpoint keys it used."""
    t = read(available[key])
    if t.dtype != torch.float8_e4m3fn:
        return t, [key]
    scale_key = key + "_scale_inv"
    if scale_key not in available:
        raise CheckpointError(f"{key}: float8 weight without {scale_key}")
    return _dequant_fp8(t, read(available[scale_key])), [key, scale_key]


def _read_experts(spec, available, read):
    """Pack mlp.experts.{e}.{proj}.weight (possibly FP8) into spec's [E, ...] tensor."""
    prefix = spec.name[: spec.name.rindex("experts.") + len("experts.")]
    per_expert, keys = [], []
    for e in range(spec.shape[0]):
        parts = []
        for proj in spec.experts:
            key = f"{prefix}{e}.{proj}.weight"
            if key not in available:
                raise CheckpointError(f"missing tensor {key} (for {spec.name})")
            t, used = _read_weight(key, available, read)
            keys += used
            parts.append(t)
        per_expert.append(torch.cat(parts, dim=0))
    return torch.stack(per_expert), keys


def to_hf_tensors(model: CausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under transformers' on-disk names: experts unpacked per expert."""
    out = {}
    weights = model.weights()
    for spec in all_specs(model.cfg):
        t = weights[spec.name].detach()
        if spec.experts:
            prefix = spec.name[: spec.name.rindex("experts.") + len("experts.")]
            for e in range(t.shape[0]):
                for proj, part in zip(spec.experts, t[e].chunk(len(spec.experts), dim=0)):
                    out[f"{prefix}{e}.{proj}.weight"] = part
        else:
            out[spec.name] = t
    return out


def write(model: CausalLM, out_dir: str, max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes config.json and safetensors shards (+ index when more than one) into out_dir."""
    tensors = {k: v.contiguous().cpu() for k, v in to_hf_tensors(model).items()}
    shards, current, size = [], {}, 0
    for key in sorted(tensors):
        n = tensors[key].numel() * tensors[key].element_size()
        if current and size + n > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = tensors[key]
        size += n
    shards.append(current)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(_hf_config_for_save(model), f, indent=2, sort_keys=True)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, SINGLE), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, name), metadata=meta)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


def save(model: CausalLM, out_dir: str, max_shard_bytes: int = 5 * 2**30) -> None:
    """`write`, atomically: out_dir is complete or untouched."""
    with atomic_dir(out_dir) as tmp:
        write(model, tmp, max_shard_bytes)


def _hf_config_for_save(model: CausalLM) -> dict:
    """config.json of the saved text model: a VL wrapper's text_config becomes the whole config."""
    d = dict(model.hf_config)
    if "text_config" in d:
        d = dict(d["text_config"], model_type=model.cfg.model_type)
        d.setdefault("architectures", ["Qwen3_5MoeForCausalLM" if model.cfg.is_moe else "Qwen3_5ForCausalLM"])
    d.pop("quantization_config", None)  # written unquantised
    config_from_dict(d, "config to save")  # must read back
    return d
