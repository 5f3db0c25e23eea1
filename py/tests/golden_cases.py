"""The golden checkpoints of testdata/models (written by tools/make_goldens.py) and how to
run v4train on them."""

import contextlib
import json
import os

import torch
from safetensors.torch import load_file

from v4train import hf_checkpoint
from v4train.model import Packed

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "testdata", "models")
CASES = sorted(d for d in os.listdir(ROOT) if os.path.exists(os.path.join(ROOT, d, "golden.json")))


def golden(case: str):
    d = os.path.join(ROOT, case)
    with open(os.path.join(d, "golden.json")) as f:
        meta = json.load(f)
    tensors = load_file(os.path.join(d, "golden.safetensors"))
    # Each parameter's gradient, by v4train's name (the VL wrapper's model.language_model.* is
    # model.*): transformers' fp32 result, the exact one (transformers in float64), and how far one
    # unit of fp32 roundoff in the weights moves the exact one (compare.assert_rel_close).
    for kind in ("grad", "grad64", "spread"):
        meta[kind + "s"] = {hf_checkpoint.canonical_key(k.removeprefix(kind + ".")): v for k, v in tensors.items()
                            if k.startswith(kind + ".")}
    meta["spreads"] = {k: v.item() for k, v in meta["spreads"].items()}
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
QWEN_BASE = os.path.join(REPO, "testdata", "qwen3_5_base")
CHAT = os.path.join(REPO, "testdata", "sft", "chat.jsonl")
CHAT_EVAL = os.path.join(REPO, "testdata", "sft", "chat_eval.jsonl")


# A small, fast //py:train run (LoRA on the bundled base, fp32) for the end-to-end tests.
SMALL = ["--model_dir=" + BASE, "--data=" + CHAT, "--dtype=float32", "--seq_len=128", "--micro_batch_size=2",
         "--lr=2e-3", "--lora_r=4", "--lora_alpha=8", "--log_interval=1"]


def _cli(script: str, args, env: dict | None) -> tuple[list[str], dict]:
    """The command line of python py/<script> args..., and its environment: this test's import
    path, plus `env`."""
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.path.abspath(p) for p in sys.path), **(env or {}))
    return [sys.executable, os.path.join(REPO, "py", script), *args], env


def run_cli(script: str, *args: str, cwd: str | None = None, env: dict | None = None, **kwargs):
    """python py/<script> args..., with this test's import path; returns the CompletedProcess."""
    import subprocess

    command, env = _cli(script, args, env)
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=600, **kwargs)


def start_cli(script: str, *args: str, env: dict | None = None, **kwargs):
    """python py/<script> args... started in the background (stdout and stderr piped, as text,
    unless kwargs say otherwise)."""
    import subprocess

    command, env = _cli(script, args, env)
    return subprocess.Popen(command, **dict(dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), **kwargs),
                            env=env)


@contextlib.contextmanager
def gloo(rank: int, size: int, init: str):
    """This process as rank `rank` of a gloo group of `size` (mp.spawn's workers), rendezvous
    through the file `init`."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # (a sandbox's hostname may not resolve)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size)
    try:
        yield
        # Both ranks done before either tears the group down: a rank that left first once aborted
        # the other ("terminate called without an active exception", SIGABRT) under CI's load.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_train(*args: str, **kwargs):
    """//py:train (run_cli) without its start-up self-check of the ops, which is tested elsewhere."""
    return run_cli("train.py", *args, "--noself_check", **kwargs)


def error_line(result, code: int = 2) -> str:
    """The error of a run that stopped on bad input: exit status `code`, no traceback, and the
    last line of stderr, which it returns, is the error."""
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(("train: ", "evaluate: ")), result.stderr[-3000:]
    return last


def copy_model(tmp_path, tensors=None, config=None, base=BASE) -> str:
    """The bundled base (GLM-5's, or QWEN_BASE) in tmp_path/model, its tensors and config.json
    edited in place by the callables given."""
    import shutil

    from safetensors.torch import save_file

    d = os.path.join(str(tmp_path), "model")
    shutil.copytree(base, d)
    if tensors:
        t = load_file(os.path.join(d, "model.safetensors"))
        tensors(t)
        save_file(t, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    if config:
        with open(os.path.join(d, "config.json")) as f:
            c = json.load(f)
        config(c)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(c, f)
    return d


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# A run of 4 steps with a checkpoint every 2, stopped after step 2: what the resume tests continue.
RUN = [*SMALL, "--max_steps=4", "--save_interval=2"]


def _stopped_run(tmp_path_factory):
    """RUN stopped after step 2: checkpoint-2 and metrics rows 1, 2 (module-scoped: run once)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    result = run_train(*RUN, f"--output_dir={out}", "--stop_at_step=2")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _run_copy(stopped_run, tmp_path):
    """A copy of the stopped run for one test to change."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(stopped_run, out)
    return out


# pytest fixtures of the tests that resume a stopped run (import them by name).
import pytest  # noqa: E402

stopped_run = pytest.fixture(scope="module", name="stopped_run")(_stopped_run)
run_copy = pytest.fixture(name="run_copy")(_run_copy)
