"""Training checkpoints: OUTPUT_DIR/checkpoint-STEP/, written atomically.

A checkpoint holds what a user loads (a PEFT adapter, or full weights in Hugging Face layout,
plus the tokenizer files) and what an exact resume needs: optimizer moments
(optimizer.safetensors; a run of several processes: optimizer/rank{r}.safetensors, each rank's
shards), the random generators' states (rng_state.safetensors for torch's,
rng_state.json for Python's) and the step and data position (trainer_state.json). Nothing in a
checkpoint is unpickled: a checkpoint can carry no code (an older one's rng_state.pt is read with
torch.load(weights_only=True), which refuses anything but tensors and plain values). manifest.json, written last, lists every file with its size and sha256: a
checkpoint is complete when its manifest is there and every file has its listed size, and a
resume checks the checksums too. Writes go through a temporary folder renamed into place, and
the rotation renames a checkpoint away before deleting it, so a run killed at any moment leaves
every checkpoint folder complete or absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from typing import Iterable

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from v4train import hf_checkpoint, lora
from v4train.atomic import atomic_dir, kill_point, remove_dir
from v4train.distributed import SHARDED, World, assign, expert_tensor, local, local_experts
from v4train.hf_checkpoint import CheckpointError, inside, read_json

_NAME = re.compile(r"^checkpoint-(\d+)$")
STATE = "trainer_state.json"
MANIFEST = "manifest.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# The LoraConfig fields a resumed run must share with its checkpoint, and the flag of each.
LORA_FLAGS = (("r", "lora_r"), ("alpha", "lora_alpha"), ("target_modules", "lora_target_modules"),
              ("experts", "lora_experts"))


def step_of(path: str) -> int | None:
    """The step of a checkpoint-STEP folder (None for any other name)."""
    m = _NAME.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def _files(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(parent, name), folder)
                  for parent, _, names in os.walk(folder) for name in names)


def _write_manifest(folder: str) -> None:
    files = {name: {"bytes": os.path.getsize(os.path.join(folder, name)), "sha256": _sha256(os.path.join(folder, name))}
             for name in _files(folder)}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"files": files}, f, indent=1, sort_keys=True)


def _manifest(path: str) -> dict[str, dict]:
    """The manifest's entries by file name; a name that leaves the folder is refused before any
    file is looked at (the manifest is read from disk, like a shard index: hf_checkpoint.inside)."""
    manifest = os.path.join(path, MANIFEST)
    files = read_json(manifest).get("files")
    if not isinstance(files, dict) or not all(isinstance(e, dict) and isinstance(e.get("bytes"), int)
                                              and isinstance(e.get("sha256"), str) for e in files.values()):
        raise CheckpointError(f"{manifest}: expected {{\"files\": {{name: {{bytes, sha256}}}}}}")
    for name in files:
        inside(path, name, manifest)
    return files


def _incomplete(path: str) -> str | None:
    """Why the checkpoint folder `path` is not complete, or None: a missing manifest, or a listed
    file that is missing or of another size. Cheap: no file is read."""
    if not os.path.exists(os.path.join(path, MANIFEST)):
        return f"no {MANIFEST} (its write or deletion was interrupted)"
    try:
        files = _manifest(path)
    except CheckpointError as e:
        return str(e)
    for name, entry in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != entry["bytes"]:
            return f"{name} has {os.path.getsize(file)} bytes, {MANIFEST} says {entry['bytes']} (truncated?)"
    return None


def scan(output_dir: str) -> tuple[list[tuple[int, str]], dict[str, str]]:
    """The complete checkpoints of output_dir as (step, path), oldest first, and the incomplete
    checkpoint-STEP folders with why each is incomplete."""
    complete, incomplete = [], {}
    if os.path.isdir(output_dir):
        for name in os.listdir(output_dir):
            step, path = step_of(name), os.path.join(output_dir, name)
            if step is None or not os.path.isdir(path):
                continue
            why = _incomplete(path)
            if why:
                incomplete[path] = why
            else:
                complete.append((step, path))
    return sorted(complete), incomplete


def checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints of output_dir, oldest first."""
    return scan(output_dir)[0]


def latest(output_dir: str) -> str | None:
    found = checkpoints(output_dir)
    return found[-1][1] if found else None


def verify(path: str) -> None:
    """Raises CheckpointError, naming the file, unless every file of the checkpoint is as written."""
    why = _incomplete(path)
    if why:
        raise CheckpointError(f"{path}: not a complete v4train checkpoint: {why}")
    for name, entry in _manifest(path).items():
        if _sha256(os.path.join(path, name)) != entry["sha256"]:
            raise CheckpointError(f"{os.path.join(path, name)}: its content changed since it was written (sha256 "
                                  f"differs from {MANIFEST})")


def save(output_dir: str, step: int, *, model, adapters, lcfg, optimizer_state: dict[str, torch.Tensor] | None,
         optimizer_steps: int, state: dict, base_model_dir: str, tokenizer_dir: str | None, keep: int,
         rng: list[tuple[dict, dict]] | None = None, write_sharded=None,
         weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> str:
    """Writes checkpoint-STEP, then deletes the oldest complete checkpoints beyond `keep`. A write
    that fails (a full disk) raises CheckpointError saying which checkpoint is kept. Adapters and
    optimizer state come whole, and `rng` holds every rank's generators (rng_states(), default
    this process's): a run of many processes has its rank 0 write what every rank gathered; its
    optimizer state instead goes through `write_sharded(folder)`, distributed.save_sharded into the
    checkpoint's folder (distributed.SHARDED), each rank its own shards; and
    a full fine-tuning's `weights` come whole, one at a time as hf_checkpoint.write takes them
    (distributed.gathered; default: the model's own)."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    try:
        with atomic_dir(final) as tmp:
            if adapters is not None:
                lora.save_peft(model, adapters, lcfg, tmp, base_model_dir)
            else:
                hf_checkpoint.write(model, tmp, weights)
            kill_point("checkpoint-write")
            for name in TOKENIZER_FILES:
                if tokenizer_dir and os.path.exists(os.path.join(tokenizer_dir, name)):
                    shutil.copy(os.path.join(tokenizer_dir, name), tmp)
            if write_sharded is not None:
                write_sharded(tmp)
            else:
                save_file({k: v.detach().cpu().contiguous() for k, v in optimizer_state.items()},
                          os.path.join(tmp, "optimizer.safetensors"))
            for rank, (tensors, python) in enumerate(rng or [rng_states()]):
                _save_rng(tmp, tensors, python, rank)
            with open(os.path.join(tmp, STATE), "w") as f:
                json.dump(dict(state, step=step, optimizer_steps=optimizer_steps), f, indent=1, sort_keys=True)
            _write_manifest(tmp)  # last: a folder with a manifest is complete
    except (OSError, RuntimeError, SafetensorError) as e:  # torch.save and safetensors wrap the OSError
        kept = latest(output_dir)
        free = shutil.disk_usage(output_dir).free / 2**20
        raise CheckpointError(f"writing {final} failed ({e}; {free:,.0f} MiB free on its disk); "
                              + (f"the last complete checkpoint, {kept}, is kept" if kept else
                                 "there is no earlier checkpoint")) from None
    for _, old in checkpoints(output_dir)[:-keep]:
        remove_dir(old)
    return final


def _check_same_lora(path: str, lcfg: lora.LoraConfig) -> None:
    saved = lora.read_config(path)
    for field, flag in LORA_FLAGS:
        theirs, ours = getattr(saved, field), getattr(lcfg, field)
        if field == "target_modules":
            theirs, ours = ",".join(sorted(set(theirs))), ",".join(sorted(set(ours)))
        if theirs != ours:
            raise CheckpointError(f"--resume_from={path}: its {lora.ADAPTER_CONFIG} has {field}={theirs}, but this "
                                  f"run has --{flag}={ours}")


def load(path: str, *, model, adapters, lcfg, optimizer, world: World = World()) -> dict:
    """Restores weights (or adapters), optimizer moments and RNG states (this rank's, of a run of
    many processes); returns trainer_state. A full fine-tuning's weights are read as the model's
    are (hf_checkpoint.load): each rank only its experts and its FSDP2 shards' rows. Every problem
    is a CheckpointError of one line naming the file."""
    verify(path)
    state_path = os.path.join(path, STATE)
    state = read_json(state_path)
    missing = [k for k in ("step", "optimizer_steps", "loader") if k not in state]
    if missing:
        raise CheckpointError(f"{state_path}: lacks {', '.join(missing)}")
    step, optimizer_steps = state["step"], state["optimizer_steps"]
    if not _count(step) or step < 1 or step != step_of(path) and step_of(path) is not None:
        raise CheckpointError(f"{state_path}: field step: expected the folder's step"
                              f"{f' {step_of(path)}' if step_of(path) is not None else ''} (an integer >= 1), got {step!r}")
    if not _count(optimizer_steps) or optimizer_steps > step:
        raise CheckpointError(f"{state_path}: field optimizer_steps: expected an integer in [0, step={step}], "
                              f"got {optimizer_steps!r}")
    with torch.no_grad():
        if adapters is not None:
            if not os.path.exists(os.path.join(path, lora.ADAPTER_CONFIG)):
                raise CheckpointError(f"--resume_from={path}: a full fine-tuning checkpoint, but this run trains LoRA")
            _check_same_lora(path, lcfg)
            _, stored = lora.read_peft(model, path)
            for name, t in adapters.items():
                assign(t, stored[name])
        else:
            if os.path.exists(os.path.join(path, lora.ADAPTER_CONFIG)):
                raise CheckpointError(f"--resume_from={path}: a LoRA checkpoint, but this run is --finetune=full")
            experts = local_experts(model.cfg, world)
            saved, report = hf_checkpoint.load(path, torch.float32, "cpu", experts=experts, shard=world.shard)
            rows, saved_weights = report.get("rows", {}), saved.weights()
            for name, t in model.weights().items():
                if name in rows or (experts and expert_tensor(name)):  # read as this rank's part
                    local(t).copy_(rows.get(name, saved_weights[name]))
                else:
                    assign(t, saved_weights[name])
    sharded = os.path.join(path, SHARDED)
    try:
        if os.path.isdir(sharded):
            optimizer.load_sharded(path, world.rank, state["optimizer_steps"])
        else:
            optimizer.load_state(load_file(os.path.join(path, "optimizer.safetensors")), state["optimizer_steps"])
    except ValueError as e:
        where = sharded if os.path.isdir(sharded) else os.path.join(path, "optimizer.safetensors")
        raise CheckpointError(f"{where}: {e}") from None
    _load_rng(path, world.rank)
    return state


RNG_TENSORS, RNG_PYTHON, RNG_PICKLE = "rng_state.safetensors", "rng_state.json", "rng_state.pt"


def rng_states() -> tuple[dict[str, torch.Tensor], dict]:
    """This process's generators: torch's states as uint8 tensors, Python's as plain values."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    version, internal, gauss = random.getstate()
    return tensors, {"version": version, "state": list(internal), "gauss_next": gauss}


def _rank_file(name: str, rank: int) -> str:
    """Rank 0's generators in NAME (a run of one process has only those), rank r's in NAME.rank{r}."""
    stem, ext = os.path.splitext(name)
    return name if rank == 0 else f"{stem}.rank{rank}{ext}"


def _save_rng(folder: str, tensors: dict, python: dict, rank: int) -> None:
    """torch's generator states as uint8 tensors, Python's as JSON: no pickle."""
    save_file(tensors, os.path.join(folder, _rank_file(RNG_TENSORS, rank)))
    with open(os.path.join(folder, _rank_file(RNG_PYTHON, rank)), "w") as f:
        json.dump(python, f)


def _load_rng(path: str, rank: int = 0) -> None:
    """Restores the generators, each state checked first; every problem a CheckpointError naming
    the file and the field."""
    tensors_path = os.path.join(path, _rank_file(RNG_TENSORS, rank))
    if os.path.exists(tensors_path):
        try:
            states = load_file(tensors_path)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{tensors_path}: cannot be read ({e})") from None
        python_path = os.path.join(path, _rank_file(RNG_PYTHON, rank))
        saved = read_json(python_path)
        python = (saved.get("version"), saved.get("state"), saved.get("gauss_next"))
        torch_state = states.get("torch")
        cuda = [states[k] for k in sorted((k for k in states if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    else:  # a checkpoint of an earlier version: a pickle, read without running any code
        python_path = tensors_path = os.path.join(path, RNG_PICKLE)
        try:
            rng = torch.load(tensors_path, weights_only=True)
        except Exception as e:  # weights_only refuses a pickle that would build objects or call code
            raise CheckpointError(f"{tensors_path}: refused: not plain tensors and values ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200]})") from None
        if not isinstance(rng, dict):
            raise CheckpointError(f"{tensors_path}: expected a dict of generator states")
        python, torch_state, cuda = rng.get("python"), rng.get("torch"), rng.get("cuda") or []
    expected = torch.get_rng_state()
    if not (isinstance(torch_state, torch.Tensor) and torch_state.dtype == torch.uint8
            and torch_state.shape == expected.shape):
        raise CheckpointError(f"{tensors_path}: field torch: expected a uint8 tensor of {tuple(expected.shape)}, got "
                              f"{_describe(torch_state)}")
    version, internal, gauss = python if isinstance(python, (tuple, list)) and len(python) == 3 else (None, None, None)
    if not (version == 3 and isinstance(internal, (list, tuple)) and len(internal) == 625
            and all(isinstance(x, int) and 0 <= x < 2**32 for x in internal[:624]) and isinstance(internal[624], int)
            and 0 <= internal[624] <= 624 and (gauss is None or isinstance(gauss, float))):
        raise CheckpointError(f"{python_path}: field python: not a state of Python's random generator")
    torch.set_rng_state(torch_state)
    random.setstate((version, tuple(internal), gauss))
    if cuda and torch.cuda.is_available():
        if not all(isinstance(c, torch.Tensor) and c.dtype == torch.uint8 for c in cuda):
            raise CheckpointError(f"{tensors_path}: field cuda: expected uint8 tensors")
        torch.cuda.set_rng_state_all(cuda[:torch.cuda.device_count()])


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _describe(x) -> str:
    return f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
