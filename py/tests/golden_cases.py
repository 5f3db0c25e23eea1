"""The golden checkpoints of testdata/models (written by tools/make_goldens.py) and how to
run v4train on them."""

import json
import os

import torch
from safetensors.torch import load_file

from v4train import hf_checkpoint
from v4train.models.causal_lm import Packed

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "testdata", "models")
CASES = sorted(d for d in os.listdir(ROOT) if os.path.exists(os.path.join(ROOT, d, "golden.json")))


def golden(case: str):
    d = os.path.join(ROOT, case)
    with open(os.path.join(d, "golden.json")) as f:
        meta = json.load(f)
    tensors = load_file(os.path.join(d, "golden.safetensors"))
    # Each parameter's gradient, by v4train's name (the VL wrapper's model.language_model.* is
    # model.*): transformers' fp32 result, and the exact one (transformers in float64).
    for kind in ("grad", "grad64"):
        meta[kind + "s"] = {hf_checkpoint.canonical_key(k.removeprefix(kind + ".")): v for k, v in tensors.items()
                            if k.startswith(kind + ".")}
    return d, tensors, meta


def trainable(name: str) -> bool:
    """Parameters in transformers (e_score_correction_bias is a buffer there)."""
    return not name.endswith("e_score_correction_bias")


def run(model, input_ids: torch.Tensor):
    """Logits [B, S, V] and the mean loss with labels = input_ids, gradients accumulated."""
    batch = Packed.from_rows(input_ids)
    for name, p in model.named_parameters():
        p.requires_grad_(trainable(name))
    hidden_logits = model.logits(batch)
    loss = model.loss(batch, batch.num_targets)
    loss.backward()
    return hidden_logits.reshape(*input_ids.shape, -1), loss


REPO = os.path.dirname(os.path.dirname(ROOT))
BASE = os.path.join(REPO, "testdata", "glm5_base")
CHAT = os.path.join(REPO, "testdata", "sft", "chat.jsonl")
CHAT_EVAL = os.path.join(REPO, "testdata", "sft", "chat_eval.jsonl")


def run_cli(script: str, *args: str, cwd: str | None = None):
    """python py/<script> args..., with this test's import path; returns the CompletedProcess."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.path.abspath(p) for p in sys.path))
    return subprocess.run([sys.executable, os.path.join(REPO, "py", script), *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
