"""Progress, metrics.jsonl and the loss curve."""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch

from v4train.atomic import replace_file, replacing


def peak_memory_mib(device: str) -> float:
    """Peak memory so far: allocated CUDA memory, or the process' peak RSS on the CPU."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """A one-line progress bar on a terminal; plain log lines otherwise."""

    def __init__(self, total_steps: int, start_step: int, stream=sys.stderr):
        self.total, self.start_step, self.stream = total_steps, start_step, stream
        self.tty = stream.isatty()
        self.t0 = time.time()

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float, extra: str = "") -> None:
        done = step - self.start_step
        eta = (time.time() - self.t0) / max(done, 1) * (self.total - step)
        text = (f"step {step}/{self.total} loss {loss:.4f} lr {lr:.3g} tok/s {tokens_per_s:,.0f} "
                f"ETA {_duration(eta)}{extra}")
        if self.tty:
            width = 24
            filled = int(width * step / max(self.total, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\033[K")
            if step == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
        self.stream.flush()


def _read_rows(path: str) -> list[dict]:
    """The rows of a metrics.jsonl. A torn last line (the run was killed while appending it) is
    dropped; any other malformed line is an error naming file:line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    rows = []
    for i, (n, line) in enumerate(lines):
        try:
            row = json.loads(line)
            if not (isinstance(row, dict) and isinstance(row.get("step"), int)):
                raise ValueError("expected an object with an integer step")
        except ValueError as e:
            if i == len(lines) - 1 and not line.endswith("\n"):
                break
            raise ValueError(f"{path}:{n}: not a metrics row ({e})") from None
        rows.append(row)
    return rows


class MetricsLog:
    """OUTPUT_DIR/metrics.jsonl: one JSON object per logged step (appended, so a resumed run
    continues it; lines past the resume step are dropped first, in an atomic rewrite). In a run of
    many processes only rank 0's writes (`writes`); the others keep their rows in memory."""

    def __init__(self, output_dir: str, resume_step: int, writes: bool = True):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.rows, self.writes = [], writes
        if writes and os.path.exists(self.path):  # written by the first row: a run that failed before it leaves none
            self.rows = [r for r in _read_rows(self.path) if r["step"] <= resume_step]
            replace_file(self.path, "".join(json.dumps(r) + "\n" for r in self.rows))

    def write(self, row: dict) -> None:
        self.rows.append(row)
        if not self.writes:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def plot(self, path: str) -> None:
        import logging

        import matplotlib

        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in self.rows if "loss" in r], [r["loss"] for r in self.rows if "loss" in r], label="train loss")
        evals = [r for r in self.rows if "eval_loss" in r]
        if evals:
            ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        try:
            with replacing(path) as tmp:  # never through a loss.png that links to a user's file
                fig.savefig(tmp, dpi=100, format="png")
        finally:
            plt.close(fig)
