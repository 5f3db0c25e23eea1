"""Training checkpoints: OUTPUT_DIR/checkpoint-STEP/, written atomically.

A checkpoint holds what a user loads (a PEFT adapter, or full weights in Hugging Face layout,
plus the tokenizer files) and what an exact resume needs: optimizer moments
(optimizer.safetensors), RNG states (rng_state.pt) and the step and data position
(trainer_state.json). A run killed at any moment leaves the last complete checkpoint intact.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

from v4train import hf_checkpoint, lora
from v4train.atomic import atomic_dir

_NAME = re.compile(r"^checkpoint-(\d+)$")
STATE = "trainer_state.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints of output_dir, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _NAME.match(name)
        if m and os.path.exists(os.path.join(output_dir, name, STATE)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return sorted(found)


def latest(output_dir: str) -> str | None:
    found = checkpoints(output_dir)
    return found[-1][1] if found else None


def save(output_dir: str, step: int, *, model, adapters, lcfg, optimizer, state: dict, base_model_dir: str,
         tokenizer_dir: str | None, keep: int) -> str:
    final = os.path.join(output_dir, f"checkpoint-{step}")
    with atomic_dir(final) as tmp:
        if adapters is not None:
            lora.save_peft(model, adapters, lcfg, tmp, base_model_dir)
        else:
            hf_checkpoint.write(model, tmp)
        for name in TOKENIZER_FILES:
            if tokenizer_dir and os.path.exists(os.path.join(tokenizer_dir, name)):
                shutil.copy(os.path.join(tokenizer_dir, name), tmp)
        save_file({k: v.detach().cpu().contiguous() for k, v in optimizer.state_tensors().items()},
                  os.path.join(tmp, "optimizer.safetensors"))
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, os.path.join(tmp, "rng_state.pt"))
        with open(os.path.join(tmp, STATE), "w") as f:  # written last: its presence marks completeness
            json.dump(dict(state, step=step, optimizer_steps=optimizer.step_count), f, indent=1, sort_keys=True)
    for _, old in checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(path: str, *, model, adapters, optimizer) -> dict:
    """Restores weights (or adapters), optimizer moments and RNG states; returns trainer_state."""
    state_path = os.path.join(path, STATE)
    if not os.path.exists(state_path):
        raise ValueError(f"--resume_from={path}: not a complete v4train checkpoint (no {STATE})")
    with open(state_path) as f:
        state = json.load(f)
    with torch.no_grad():
        if adapters is not None:
            if not os.path.exists(os.path.join(path, lora.ADAPTER_CONFIG)):
                raise ValueError(f"--resume_from={path}: a full fine-tuning checkpoint, but this run trains LoRA")
            _, stored = lora.read_peft(model, path)
            if set(stored) != set(adapters):
                raise ValueError(f"--resume_from={path}: its adapters differ from this run's LoRA flags")
            for name, t in adapters.items():
                t.copy_(stored[name])
        else:
            if os.path.exists(os.path.join(path, lora.ADAPTER_CONFIG)):
                raise ValueError(f"--resume_from={path}: a LoRA checkpoint, but this run is --finetune=full")
            saved, _ = hf_checkpoint.load(path, torch.float32, "cpu")
            saved_weights = saved.weights()
            for name, t in model.weights().items():
                t.copy_(saved_weights[name])
    optimizer.load_state(load_file(os.path.join(path, "optimizer.safetensors")), state["optimizer_steps"])
    rng = torch.load(os.path.join(path, "rng_state.pt"), weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state
