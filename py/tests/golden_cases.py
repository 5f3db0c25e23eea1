"""The golden checkpoints of testdata/models (written by tools/make_goldens.py) and how to
run v4train on them."""

import contextlib
import hashlib
import json
import os
import sys

import torch
from safetensors.torch import load_file

from v4train import distributed, hf_checkpoint
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


# The released GLM-5 config (FP8 quantization_config and all) shrunk for the CPU: 3 layers (1 dense,
# 2 MoE of 8 experts, top-2), widths that are multiples of FP8's 128-row blocks except
# kv_a_proj_with_mqa's 128 + 64 rows (a partial block, as the release's 512 + 64).
RELEASED_GLM5 = os.path.join(REPO, "testdata", "released", "GLM-5-FP8", "config.json")
GLM5_FP8_SMALL = {"num_hidden_layers": 3, "mlp_layer_types": ["dense", "sparse", "sparse"],
                  "indexer_types": ["full"] * 3, "layer_types": ["indexed_attention"] * 3, "hidden_size": 256,
                  "intermediate_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 8,
                  "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 256,
                  "kv_lora_rank": 128, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 128,
                  "head_dim": 64, "index_n_heads": 4, "index_head_dim": 128, "index_topk": 64, "vocab_size": 512}


def small_glm5_fp8() -> dict:
    """The released GLM-5 config.json with GLM5_FP8_SMALL's changes."""
    with open(RELEASED_GLM5) as f:
        return dict(json.load(f), **GLM5_FP8_SMALL)


def assert_each_rank_drew_its_part(drawn: list[list], experts: int, ep: int) -> None:
    """drawn[r]: rank r's draws of a random base, (tensor, (start, stop), the tensor's rows) of each
    piece that v4train.random_init.draw_rows drew (instrumented). Each rank drew exactly its rows of
    each tensor: of a routed experts' tensor (rows are experts) its expert-parallel rank's, of any
    other its FSDP2 shard's (none of another rank's, and never a tensor whole unless it is the
    rank's); between the ranks every row of every tensor once."""
    size, rows_of = len(drawn), {}
    for rank, log in enumerate(drawn):
        assert log, f"rank {rank} drew nothing"
        mine = {}
        for name, (start, stop), n in log:
            mine.setdefault(name, (n, []))[1].extend(range(start, stop))
        for name, (n, rows) in mine.items():
            per = experts // ep
            start, stop = (rank % ep * per, (rank % ep + 1) * per) if distributed.expert_tensor(name) else \
                distributed.fsdp_rows(n, rank, size)
            assert sorted(rows) == list(range(start, stop)), \
                f"rank {rank} drew rows {min(rows)}..{max(rows)} of {name} ({n} rows; a packed experts' tensor's rows " \
                f"are experts), its own are {start}..{stop - 1}"
            rows_of.setdefault(name, [n, []])[1] += rows
    for name, (n, rows) in rows_of.items():
        assert sorted(rows) == list(range(n)), f"{name}: the ranks drew its rows {sorted(rows)[:8]}..., not each once"


# A small, fast //py:train run (LoRA on the bundled base, fp32) for the end-to-end tests.
SMALL = ["--model_dir=" + BASE, "--data=" + CHAT, "--dtype=float32", "--seq_len=128", "--micro_batch_size=2",
         "--lr=2e-3", "--lora_r=4", "--lora_alpha=8", "--log_interval=1"]


def _cli(script: str, args, env: dict | None) -> tuple[list[str], dict]:
    """The command line of python py/<script> args..., and its environment: this test's import
    path, plus `env`."""
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
def fifo_of(path, data: bytes):
    """A FIFO at `path` that a thread fills with `data` once a reader opens it (what a
    `--data=<(zcat d.jsonl.gz)` hands the trainer); on leaving, a writer whose reader never came or
    stopped reading is let go, so that a failed run does not hang the test."""
    import threading
    import time

    os.mkfifo(path)

    def feed():
        try:
            with open(path, "wb") as f:
                f.write(data)
        except BrokenPipeError:  # the reader left before the end
            pass

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        yield path
    finally:
        if writer.is_alive():
            reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (its open returns; its writes drain here)
            while writer.is_alive():
                try:
                    os.read(reader, 1 << 16)
                except BlockingIOError:
                    time.sleep(0.01)
            os.close(reader)
        writer.join()


@contextlib.contextmanager
def gloo(rank: int, size: int, init: str):
    """This process as rank `rank` of a gloo group of `size` (mp.spawn's workers), rendezvous
    through the file `init`. A worker whose body passes exits at the block's end (os._exit(0)), so
    nothing after the `with` runs; one that raises leaves as before."""
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
    distributed.exit_process(0)  # a worker that passed: gloo's threads and Python's finalisation race


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


def replace_files(checkpoint, remove: list[str], add: dict[str, bytes]) -> None:
    """Files of a checkpoint removed and added, the manifest rewritten to match (as an attacker
    who can write the folder would: the manifest guards against damage, not against intent)."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for name in remove:
        os.remove(checkpoint / name)
        del manifest["files"][name]
    for name, content in add.items():
        (checkpoint / name).write_bytes(content)
        manifest["files"][name] = {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


class Payload:
    """Unpickled, it would run a shell command (touch `marker`): what a hostile pickle in a
    checkpoint can carry (rng_state.pt, torch.distributed.checkpoint's .metadata)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


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
