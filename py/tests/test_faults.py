"""Fault injection: //py:train killed (SIGKILL) inside a checkpoint write and inside the rotation
leaves every checkpoint folder complete or absent, and resuming after each kill ends on the loss
curve of an uninterrupted run.

The kill points are deterministic: V4TRAIN_KILL_AT=NAME[:N] makes the training process SIGKILL
itself the N-th time it passes the point NAME (v4train.atomic.kill_point)."""

import hashlib
import json
import os
import signal

import torch

from golden_cases import SMALL, metrics, run_train
from v4train.testing.compare import assert_close

# Dropout, and checkpoints every 2 of 8 steps, 2 kept: the RNG state and the rotation matter.
ARGS = [*SMALL, "--max_steps=8", "--save_interval=2", "--save_total_limit=2", "--lora_dropout=0.1"]
REQUIRED = {"adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors", "rng_state.safetensors", "rng_state.json",
            "trainer_state.json"}


def checkpoint_folders(out) -> list[str]:
    """The checkpoint-* folders of out, each checked complete: it holds every file a resume needs,
    each with the size and sha256 its manifest lists, and nothing else."""
    found = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
    for name in found:
        folder = out / name
        listed = json.loads((folder / "manifest.json").read_text())["files"]
        assert REQUIRED <= set(listed), f"{folder}: lacks {REQUIRED - set(listed)}"
        assert set(os.listdir(folder)) == set(listed) | {"manifest.json"}, folder
        for file, entry in listed.items():
            content = (folder / file).read_bytes()
            assert (len(content), hashlib.sha256(content).hexdigest()) == (entry["bytes"], entry["sha256"]), folder / file
    return found


def temporaries(out, prefix: str) -> list[str]:
    return [n for n in os.listdir(out) if n.startswith(prefix)]


def train(out, *args, kill_at: str | None = None):
    result = run_train(*ARGS, f"--output_dir={out}", *args, env={"V4TRAIN_KILL_AT": kill_at} if kill_at else None)
    expected = -signal.SIGKILL if kill_at else 0
    assert result.returncode == expected, f"exit {result.returncode}, expected {expected}:\n{result.stderr[-3000:]}"
    return result


def test_runs_killed_in_checkpoint_writes_and_the_rotation_resume_to_the_uninterrupted_loss(tmp_path):
    whole = tmp_path / "whole"
    train(whole)
    out = tmp_path / "split"

    # Inside the write of checkpoint-4: checkpoint-2 is whole, the half-written one a temporary folder.
    train(out, kill_at="checkpoint-write:2")
    assert checkpoint_folders(out) == ["checkpoint-2"]
    assert len(temporaries(out, ".tmp-checkpoint-4-")) == 1

    # Resumed, then killed inside the rotation after checkpoint-6: checkpoint-2 renamed away, not yet deleted.
    resumed = train(out, "--resume_from=latest", kill_at="remove-dir:1")
    assert "removed 1 temporary folder(s) of an interrupted write: .tmp-checkpoint-4-" in resumed.stderr
    assert checkpoint_folders(out) == ["checkpoint-4", "checkpoint-6"]
    assert len(temporaries(out, ".old-checkpoint-2-")) == 1

    # Resumed, then killed inside the write of the last checkpoint.
    train(out, "--resume_from=latest", kill_at="checkpoint-write:1")
    assert checkpoint_folders(out) == ["checkpoint-4", "checkpoint-6"]
    assert len(temporaries(out, ".tmp-checkpoint-8-")) == 1

    # Resumed to the end: the loss curve of the run that was never killed.
    train(out, "--resume_from=latest")
    assert checkpoint_folders(out) == ["checkpoint-6", "checkpoint-8"]
    assert sorted(os.listdir(out)) == ["checkpoint-6", "checkpoint-8", "loss.png", "metrics.jsonl"]
    ours, theirs = metrics(str(out)), metrics(str(whole))
    assert [r["step"] for r in ours] == list(range(1, 9))
    for key in ("loss", "grad_norm"):
        assert_close(torch.tensor([r[key] for r in ours]), torch.tensor([r[key] for r in theirs]), f"{key} per step")
