"""Hugging Face checkpoints: config.json + safetensors (single file or sharded), read and written.

Reading maps the checkpoint's keys onto the model's weight table (v4train.models): the
`model.language_model.` prefix of the vision-language Qwen3.5 releases becomes `model.`, the
vision tower and the MTP layers are skipped (and reported), per-expert tensors are packed into
one [E, ...] tensor per projection, and FP8 weights (float8_e4m3fn with a 128x128-block
`weight_scale_inv`) are dequantised. Every problem (missing, unexpected, mis-shaped tensors, a
weight that is not floating point or holds NaN/inf, a truncated file) is collected and reported
in one error before anything is returned; a malformed JSON file or a config.json value of the
wrong type is one line naming the file.
Writing produces the layout transformers reads: per-expert keys, shards above a size limit with
model.safetensors.index.json, written to a temporary folder and renamed into place; one tensor
at a time, so that a sharded model's write gathers one tensor at a time.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import struct
from typing import Iterable

import torch
from safetensors import safe_open

from v4train.atomic import atomic_dir
from v4train.distributed import fsdp_rows
from v4train.model import CausalLM, all_specs, linear_map_names
from v4train.models import FAMILIES, ModelConfig, config_from_dict
from v4train.models.config import ConfigError
from v4train.reference.lora import FP8_BLOCK, dequantize_fp8, scale_name

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    pass


def read_json(path: str, error: type[ValueError] = CheckpointError) -> dict:
    """The JSON object in `path`; a file that is missing, unreadable, not JSON or not an object
    raises `error` naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise error(f"{path}: not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror})") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


# config.json keys read as numbers that are no field of the configs.
_NUMBER_KEYS = {"max_position_embeddings": "int", "first_k_dense_replace": "int", "index_topk_freq": "int",
                "index_skip_topk_offset": "int", "full_attention_interval": "int", "rope_theta": "float"}
_JSON_KINDS = {"int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
               "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
               "bool": ("true or false", lambda v: isinstance(v, bool))}


def _check_types(hf_config: dict, source: str) -> None:
    """Each config.json value that a config field reads must be a JSON value of the field's kind:
    hidden_size "128" fails here, in one line, not later in every tensor's shape."""
    kinds = dict(_NUMBER_KEYS)
    for cls in (f.config_class for f in FAMILIES.values()):
        kinds.update({f.name: f.type for f in dataclasses.fields(cls) if f.type in _JSON_KINDS})
    text = hf_config.get("text_config")
    for prefix, section in (("", hf_config), ("text_config.", text if isinstance(text, dict) else {})):
        for key, value in section.items():
            if key in kinds and not _JSON_KINDS[kinds[key]][1](value):
                expected = _JSON_KINDS[kinds[key]][0]
                raise ConfigError(f"{source}: {prefix}{key} must be {expected}, got {json.dumps(value)}")


def read_config(path: str) -> tuple[dict, ModelConfig]:
    """config.json as read, and the model config it describes; errors name the file."""
    hf_config = read_json(path, ConfigError)
    _check_types(hf_config, path)
    try:
        return hf_config, config_from_dict(hf_config, path)
    except ConfigError:  # names the file and the key
        raise
    # A value no check foresaw, e.g. a list for a dict: still one line naming the file, never a traceback.
    except (TypeError, LookupError, AttributeError, ArithmeticError, ValueError) as e:
        raise ConfigError(f"{path}: cannot be read as a model config ({type(e).__name__}: {e})") from None


def nonfinite(t: torch.Tensor) -> str | None:
    """'N NaN/inf values' when the tensor holds any, else None."""
    bad = int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
    return f"{bad} NaN/inf value(s)" if bad else None


def _files(model_dir: str) -> dict[str, str]:
    """key -> file path, from the index of a sharded checkpoint or the single file's header."""
    index = os.path.join(model_dir, INDEX)
    if os.path.exists(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: expected a weight_map of tensor name -> file name")
        return {k: inside(model_dir, v, index) for k, v in weight_map.items()}
    single = os.path.join(model_dir, SINGLE)
    if not os.path.exists(single):
        raise CheckpointError(f"{model_dir}: neither {SINGLE} nor {INDEX} found")
    with _open(single) as f:
        return {k: single for k in f.keys()}


def inside(directory: str, name: str, source: str) -> str:
    """directory/name, where `name` was read from the file `source`: a relative path that stays in
    the directory (no absolute path, no '..'), else a CheckpointError naming the file. Links the
    directory holds are the user's (a Hugging Face cache links its blobs): only the written name is
    judged."""
    parts = name.replace("\\", "/").split("/")
    if not name or os.path.isabs(name) or ".." in parts:
        raise CheckpointError(f"{source}: names the file {name!r}, which is not inside {directory}; refusing to read it")
    return os.path.join(directory, name)


def _open(path: str):
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise CheckpointError(f"{path}: cannot read safetensors file ({e}){_truncation(path)}") from None


def _truncation(path: str) -> str:
    """'; truncated: ...' where the file is shorter than its own header says, else ''."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 + n:
                return f"; truncated: {size} bytes, shorter than its {n}-byte header"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return ""
    return f"; truncated: {size} bytes, its header describes {8 + n + end}" if size < 8 + n + end else ""


_SKIP = [
    (re.compile(r"^model\.visual\."), "vision tower"),
    (re.compile(r"^(model\.)?mtp\."), "MTP layers"),
]


def canonical_key(key: str) -> str:
    """The text model's name of a checkpoint key (model.language_model.* -> model.*)."""
    return "model." + key[len("model.language_model."):] if key.startswith("model.language_model.") else key


def load(model_dir: str, dtype: torch.dtype = torch.float32, device="cpu", fp8: str = "dequantize",
         experts: tuple[int, int] | None = None, shard: tuple[int, int] | None = None) -> tuple[CausalLM, dict]:
    """The model in `dtype` on `device`, and a report {'skipped': {reason: count}}. An FP8
    checkpoint's layer weights (float8_e4m3fn with a 128 x 128-block weight_scale_inv) are
    dequantised into `dtype`, or with fp8="keep" stay float8 beside their fp32 scales (frozen
    parameters the ops dequantise just in time: half the memory of bf16). A routed experts'
    tensor packed from per-expert weights stays FP8 where its parts' rows fill whole scale blocks
    (else it is dequantised); weights outside the layers are always dequantised. `experts`
    (start, stop): only those routed experts of every MoE layer are read (an expert-parallel
    rank's: the others' tensors are neither read nor reported), their packed tensors
    [stop - start, ...].

    `shard` (rank, size): rank `rank` of `size` processes that FSDP2 shards the model over reads,
    of every tensor FSDP2 shards (all but the experts `experts` gives the rank), only the rows of
    its Shard(0) part (distributed.fsdp_rows; a packed experts' tensor's rows are experts). Such a
    tensor is on the meta device in the returned model (its whole shape, its dtype), and its rows
    are the report's 'rows' {name: rows}, which distributed.fill_shards puts into FSDP2's shards.
    A dequantised weight's rows read the scale rows that cover them; a scale kept beside an FP8
    weight is a tensor FSDP2 shards on its own, so its own rows are read."""
    hf_config, cfg = read_config(os.path.join(model_dir, "config.json"))
    files = _files(model_dir)
    absent = collections.Counter(p for p in files.values() if not os.path.exists(p))
    if absent:  # one line per missing file, not one per tensor it holds
        listed = "; ".join(f"{p} ({n} tensors) is missing" for p, n in sorted(absent.items()))
        raise CheckpointError(f"{model_dir}: {listed}; {INDEX} lists {'it' if len(absent) == 1 else 'them'}")
    reader = _Reader(files)

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

    problems, weights, rows_read, used = [], {}, {}, set()

    def put(name, tensor, whole_rows, sharded):
        """The model's tensor; of a sharded one, the rows go to `rows_read` and the model gets its shape."""
        if sharded:
            rows_read[name] = tensor
            tensor = torch.empty((whole_rows, *tensor.shape[1:]), dtype=tensor.dtype, device="meta")
        weights[name] = tensor
    fp8_maps = linear_map_names(cfg)  # (a router stays dequantised)
    for spec in all_specs(cfg):
        target = torch.float32 if spec.fp32 else dtype
        packed = spec.experts and spec.name not in available  # stored expert by expert
        keys = _expert_keys(spec) if packed else [spec.name]
        # Every key this weight is read from is accounted for, even when another one is missing.
        used.update(k for key in keys for k in (key, key + "_scale_inv") if k in available)
        # rows(n): the rows of dim 0 read of a tensor of n rows (None: whole)
        sharded = shard is not None and not (spec.experts and experts)
        rows = (lambda n: experts) if spec.experts and experts else \
            (lambda n: fsdp_rows(n, *shard)) if sharded else None
        start, stop = rows(spec.shape[0]) if rows else (0, spec.shape[0])
        if packed:  # the rows of a packed tensor are experts
            keys = keys[start * len(spec.experts):stop * len(spec.experts)]
        missing = [k for k in keys if k not in available]
        if missing:
            more = f", and {len(missing) - 1} more" if len(missing) > 1 else ""
            problems.append(f"missing tensor {missing[0]} "
                            + (f"(for {spec.name}{more})" if packed else str(list(spec.shape))))
            continue
        keep = fp8 == "keep" and spec.name in fp8_maps  # the linear maps the ops take FP8 for
        part = (stop - start, *spec.shape[1:])
        try:
            if not packed and reader.shape(available[spec.name]) != spec.shape:  # (the header's: nothing read)
                problems.append(f"{spec.name}: shape {list(reader.shape(available[spec.name]))}, expected "
                                f"{list(spec.shape)}")
                continue
            t, scale = (_read_experts(dataclasses.replace(spec, shape=part), keys, available, reader, keep) if packed
                        else _read_weight(spec.name, available, reader, keep, rows))
            scale_rows = None if scale is None or not sharded else \
                spec.shape[0] if len(spec.shape) > 2 else reader.shape(available[scale_name(spec.name)])[0]
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if tuple(t.shape) != part:
            problems.append(f"{spec.name}: shape {list(t.shape)}, expected {list(part)}")
            continue
        where = f" (in rows {start}..{stop - 1}, rank {shard[0]}'s)" if sharded else ""
        if scale is not None:  # kept in FP8: its values as stored, its scales in fp32
            put(spec.name, t.to(device), spec.shape[0], sharded)
            put(scale_name(spec.name), scale.to(device, torch.float32), scale_rows, sharded)
            bad = nonfinite(t.float()) or nonfinite(scale)
            if bad:
                problems.append(f"{spec.name}: {bad}{where}")
            continue
        cast = t.to(device=device, dtype=target)
        put(spec.name, cast, spec.shape[0], sharded)
        bad = nonfinite(cast)
        if bad:
            problems.append(f"{spec.name}: {bad}{where}" + (f" once cast to {target}" if nonfinite(t) is None else ""))
    unexpected = sorted(set(available) - used)
    problems += [f"unexpected tensor {k}" for k in unexpected[:20]]
    if len(unexpected) > 20:
        problems.append(f"... and {len(unexpected) - 20} more unexpected tensors")
    if problems:
        listed = problems[0] if len(problems) == 1 else "\n  " + "\n  ".join(problems)  # one problem, one line
        raise CheckpointError(f"{model_dir}: cannot be loaded as {cfg.model_type}: {listed}")
    report = {"skipped": skipped}
    if shard is not None:
        report["rows"] = rows_read
    return CausalLM(cfg, weights, hf_config), report


class _Reader:
    """A checkpoint's tensors by key, each file opened once: a tensor's shape (from the file's
    header, nothing read), the tensor whole, or a range of its rows (dim 0, read alone). Every
    failure is a CheckpointError naming the file."""

    def __init__(self, files: dict[str, str]):
        self.files, self.handles = files, {}

    def _call(self, key, what):
        path = self.files[key]
        try:
            if path not in self.handles:
                if not os.path.exists(path):
                    raise CheckpointError(f"{path}: listed in {INDEX} but missing")
                self.handles[path] = _open(path)
            return what(self.handles[path])
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {key} ({e}){_truncation(path)}") from None

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._call(key, lambda f: f.get_slice(key).get_shape()))

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor `key`, or its rows rows[0]..rows[1] - 1."""
        if rows is None:
            return self._call(key, lambda f: f.get_tensor(key))
        return self._call(key, lambda f: f.get_slice(key)[rows[0]:rows[1]])


def _read_weight(key, available, reader: _Reader, keep: bool = False,
                 rows=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the tensor `key` in floating point, None), an FP8 weight dequantised with its
    weight_scale_inv; or, with `keep`, (the FP8 weight, its scales). rows(n): the rows (start,
    stop) read of a tensor of n rows, the weight's and a kept scale's (an [E, ...] tensor's scale
    has its E rows too); None: whole. A dequantised [out, in] weight's rows read the rows of
    128 x 128 blocks that hold them."""
    part = rows(reader.shape(available[key])[0]) if rows else None
    t = reader.read(available[key], part)
    if not t.is_floating_point():
        raise CheckpointError(f"{key}: dtype {str(t.dtype).removeprefix('torch.')}, expected a floating-point weight")
    if t.dtype != torch.float8_e4m3fn:
        return t, None
    scale_key = scale_name(key)
    if scale_key not in available:
        raise CheckpointError(f"{key}: float8 weight without {scale_key}")
    if part is None or keep or t.dim() > 2:
        scale = reader.read(available[scale_key], rows(reader.shape(available[scale_key])[0]) if rows else None)
        return (t, scale) if keep else (dequantize_fp8(t, scale, torch.float32), None)
    # The block rows over the weight's rows, the weight padded to the first block's first row:
    # a shard boundary need not fall on a block's.
    first, pad = divmod(part[0], FP8_BLOCK)
    scale = reader.read(available[scale_key], (first, -(-part[1] // FP8_BLOCK)))
    padded = t.new_zeros(pad + t.shape[0], *t.shape[1:])
    padded[pad:] = t
    return dequantize_fp8(padded, scale, torch.float32)[pad:], None


def _expert_keys(spec) -> list[str]:
    """The per-expert checkpoint keys of a packed [E, ...] weight, expert by expert."""
    prefix = spec.name[: spec.name.rindex("experts.") + len("experts.")]
    return [f"{prefix}{e}.{proj}.weight" for e in range(spec.shape[0]) for proj in spec.experts]


def _read_experts(spec, keys, available, reader: _Reader,
                  keep: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packs the per-expert tensors `keys` (possibly FP8) into spec's [E, ...] tensor: (it, None), or
    with `keep`, where every part is FP8 and fills whole 128-row scale blocks (so that the packed
    scales are the parts' scales side by side), (the FP8 tensor, its [E, ...] scales)."""
    parts = [_read_weight(key, available, reader, keep) for key in keys]
    n = len(spec.experts)

    def pack(tensors):  # expert e's parts along dim 0, the experts stacked
        return torch.stack([torch.cat(tensors[e * n:(e + 1) * n], dim=0) for e in range(spec.shape[0])])
    if keep and all(s is not None and w.shape[0] % FP8_BLOCK == 0 for w, s in parts):
        return pack([w for w, _ in parts]), pack([s for _, s in parts])
    return pack([w if s is None else dequantize_fp8(w, s, torch.float32) for w, s in parts]), None


# safetensors' names of the dtypes a model's tensors have
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.float8_e4m3fn: "F8_E4M3"}


def _hf_tensors(spec, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The model's tensor `t` of `spec` under transformers' on-disk names: a packed experts'
    tensor split per expert (views of t)."""
    if not spec.experts:
        return [(spec.name, t)]
    prefix = spec.name[: spec.name.rindex("experts.") + len("experts.")]
    return [(f"{prefix}{e}.{proj}.weight", part) for e in range(t.shape[0])
            for proj, part in zip(spec.experts, t[e].chunk(len(spec.experts), dim=0))]


def write(model: CausalLM, out_dir: str, weights: Iterable[tuple[str, torch.Tensor]] | None = None,
          max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes config.json and safetensors shards (+ index when more than one) into out_dir, in
    transformers' layout: the model's weights, or `weights`, the same tensors whole as (name,
    tensor) in model.weights() order (a sharded model's: distributed.gathered gathers each as it
    is taken). Each tensor is written and let go before the next is taken, so a write holds one
    tensor beyond the model, never a copy of it; each file's header comes first, from the shapes
    and dtypes, and a tensor's per-expert parts stay in one file (files follow model order)."""
    like = model.weights()  # the shapes and dtypes written (a DTensor's are its whole tensor's)
    files, size = [[]], 0
    for spec in all_specs(model.cfg):
        n = like[spec.name].numel() * like[spec.name].element_size()
        if files[-1] and size + n > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(spec)
        size += n
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(_hf_config_for_save(model), f, indent=2, sort_keys=True)
    source = iter(weights) if weights is not None else ((name, t.detach()) for name, t in like.items())
    names = [SINGLE] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                              for i in range(len(files))]
    weight_map = {}
    for name, specs in zip(names, files):
        keys = _write_file(os.path.join(out_dir, name), specs, like, source)
        weight_map.update({k: name for k in keys})
    if len(files) > 1:
        total = sum(t.numel() * t.element_size() for t in like.values())
        with open(os.path.join(out_dir, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


def _write_file(path: str, specs, like: dict[str, torch.Tensor], source) -> list[str]:
    """One safetensors file of the model's tensors of `specs`: the header (from `like`'s shapes
    and dtypes), then each tensor's bytes as `source` yields it. Returns the keys written."""
    header, offset = {}, 0
    for spec in specs:
        meta = torch.empty(like[spec.name].shape, dtype=like[spec.name].dtype, device="meta")
        for key, part in _hf_tensors(spec, meta):
            if part.dtype not in _DTYPES:
                raise ValueError(f"{key}: cannot be written in safetensors as {part.dtype}")
            n = part.numel() * part.element_size()
            header[key] = {"dtype": _DTYPES[part.dtype], "shape": list(part.shape),
                           "data_offsets": [offset, offset + n]}
            offset += n
    text = json.dumps({**header, "__metadata__": {"format": "pt"}}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # (as safetensors pads its header)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for spec in specs:
            name, t = next(source)
            if name != spec.name or t.shape != like[spec.name].shape or t.dtype != like[spec.name].dtype:
                raise RuntimeError(f"write: {spec.name} {list(like[spec.name].shape)} expected, given {name} "
                                   f"{list(t.shape)} {t.dtype}")
            for _, part in _hf_tensors(spec, t.detach()):
                f.write(part.contiguous().cpu().view(-1).view(torch.uint8).numpy())
            t = part = None  # let go before the next is taken (gathered)
    return list(header)


def save(model: CausalLM, out_dir: str, max_shard_bytes: int = 5 * 2**30,
         weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
    """`write`, atomically: out_dir is complete or untouched."""
    with atomic_dir(out_dir) as tmp:
        write(model, tmp, weights, max_shard_bytes=max_shard_bytes)


def _hf_config_for_save(model: CausalLM) -> dict:
    """config.json of the saved text model: a VL wrapper's text_config becomes the whole config."""
    d = dict(model.hf_config)
    if "text_config" in d:
        d = dict(d["text_config"], model_type=model.cfg.model_type)
        if model.family.architecture:
            d.setdefault("architectures", [model.family.architecture(model.cfg)])
    d.pop("quantization_config", None)  # written unquantised
    # The weights' dtype (most of their elements'), which transformers' dtype="auto" loads them in: a
    # bf16 fine-tune of a float32 base is no float32 checkpoint.
    counts = collections.Counter()
    for t in model.weights().values():
        counts[t.dtype] += t.numel()
    main = max(counts, key=counts.get, default=None)
    if main in (torch.float32, torch.bfloat16, torch.float16):
        d["dtype"] = str(main).removeprefix("torch.")
        if "torch_dtype" in d:  # (transformers 4's name, in configs it wrote)
            d["torch_dtype"] = d["dtype"]
    config_from_dict(d, "config to save")  # must read back
    return d
