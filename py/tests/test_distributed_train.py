"""//py:train with several processes (gloo on the CPU; the same code runs NCCL on GPUs): started
by --nproc_per_node through torch's launcher, data parallel with FSDP2 over the decoder layers,
the routed experts split over --expert_parallel ranks. The same global batch trains the same model
whatever the layout: per-step losses, gradient norms and the final adapter of 2 processes (data
or expert parallel) and of 4 (2 x 2) equal those of 1 process that accumulates their
micro-batches, for both bundled families; a resume continues exactly; refusals come before any
training."""

import os
import re

import pytest
import torch
from safetensors.torch import load_file

from golden_cases import BASE, CHAT, QWEN_BASE, SMALL, Payload, last_json, metrics, replace_files, run_cli
from v4train.testing.compare import assert_close, assert_rel_close

# Loopback for gloo (a test machine's hostname may not resolve to a reachable interface).
ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
# V4TRAIN_TEST_DEVICE=cuda: the same tests on NCCL, one GPU a process (tools/multi_gpu_check.sh).
DEVICE = f"--device={os.environ.get('V4TRAIN_TEST_DEVICE', 'cpu')}"
DEVICES = torch.cuda.device_count() if DEVICE == "--device=cuda" else 64  # processes the machine takes


def _train(out, *args, processes: int = 1):
    launch = [f"--nproc_per_node={processes}"] if processes > 1 else []
    result = run_cli("train.py", *SMALL, f"--output_dir={out}", DEVICE, *launch, *args, env=ENV)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _curve(out, field):
    return torch.tensor([r[field] for r in metrics(str(out))], dtype=torch.float32)  # fp32 runs


@pytest.mark.parametrize("base", [BASE, QWEN_BASE], ids=["glm5", "qwen3_5"])
def test_data_and_expert_parallel_runs_train_as_one_process_that_accumulates_their_batches(base, tmp_path):
    """One global batch of 4 micro-batches: 1 process accumulating 4; 2 processes data parallel; 2
    expert parallel (each holds 4 of the 8 experts); 4 as 2 data-parallel replicas of an
    expert-parallel pair."""
    # A large adam_eps keeps AdamW's update linear in the gradient where the gradient is small: with
    # the default, an element whose gradient cancels to rounding noise (a gathered weight's other
    # alignment changes the order of a sum) moves by +-lr whatever its value, and no bound compares it.
    args = ["--model_dir=" + base, "--max_steps=3", "--micro_batch_size=1", "--gradient_checkpointing",
            "--adam_eps=1e-3"]
    _train(tmp_path / "one", *args, "--grad_accum=4")
    expected = load_file(str(tmp_path / "one" / "checkpoint-3" / "adapter_model.safetensors"))
    for processes, ep in [(n, ep) for n, ep in ((2, 1), (2, 2), (4, 2)) if n <= DEVICES]:
        out = tmp_path / f"{processes}x{ep}"
        run = _train(out, *args, f"--grad_accum={4 // processes}", f"--expert_parallel={ep}", processes=processes)
        what = f"{processes} processes, expert parallel {ep}"
        # Whole-model quantities (compare.py's model tolerance): after an update the two layouts'
        # sums in other orders have moved the weights by rounding, and each step sums over all of them.
        for field in ("loss", "grad_norm"):
            assert_rel_close(_curve(out, field), _curve(tmp_path / "one", field), f"{what}: per-step {field}")
        assert last_json(run.stdout)["steps"] == 3 and len(run.stdout.strip().splitlines()) == 1  # rank 0 prints
        adapter = load_file(str(out / "checkpoint-3" / "adapter_model.safetensors"))  # gathered whole, PEFT's
        assert sorted(adapter) == sorted(expected)
        for key in expected:
            assert_rel_close(adapter[key], expected[key], f"{what}: final adapter {key}")
        assert os.path.exists(out / "loss.png")


@pytest.mark.parametrize("args,message", [
    (["--nproc_per_node=2", "--expert_parallel=4"], "--expert_parallel=4 does not divide --nproc_per_node=2"),
    (["--nproc_per_node=3", "--expert_parallel=3"], "--expert_parallel=3: "),
    (["--expert_parallel=2"], "--expert_parallel=2 does not divide the 1 process(es)"),
])
def test_an_expert_parallel_that_does_not_fit_is_refused_before_training(args, message, tmp_path):
    # (the CPU on any machine: a refusal needs no GPU)
    result = run_cli("train.py", *SMALL, f"--output_dir={tmp_path / 'o'}", "--device=cpu", *args, env=ENV)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_a_two_process_run_resumes_exactly_and_refuses_another_world_size(tmp_path):
    args = ["--max_steps=4", "--save_interval=2", "--micro_batch_size=1", "--lora_dropout=0.1"]
    _train(tmp_path / "whole", *args, processes=2)
    _train(tmp_path / "split", *args, "--stop_at_step=2", processes=2)
    other = run_cli("train.py", *SMALL, f"--output_dir={tmp_path / 'split'}", DEVICE, *args,
                    "--resume_from=latest", env=ENV)
    assert other.returncode == 2 and "written by 2 process(es), this run has 1" in other.stderr, other.stderr[-2000:]
    assert "Traceback" not in other.stderr
    _train(tmp_path / "split", *args, "--resume_from=latest", processes=2)
    assert [r["step"] for r in metrics(str(tmp_path / "split"))] == [1, 2, 3, 4]
    checkpoint = tmp_path / "split" / "checkpoint-2"
    assert os.path.exists(checkpoint / "rng_state.rank1.safetensors")
    # Each rank's optimizer shards in safetensors, and no pickle anywhere (none is ever unpickled).
    files = sorted(str(f.relative_to(checkpoint)) for f in checkpoint.rglob("*") if f.is_file())
    assert {"optimizer/rank0.safetensors", "optimizer/rank1.safetensors"} <= set(files), files
    assert all(f.endswith((".safetensors", ".json", ".jinja")) for f in files), files
    for field in ("loss", "grad_norm"):  # every rank's dropout masks continue as they would have
        assert_close(_curve(tmp_path / "split", field), _curve(tmp_path / "whole", field), f"resumed {field}")


def test_launched_ranks_know_which_flags_came_from_a_flagfile(tmp_path):
    """--finetune=full after the LoRA flagfile wins over its --lora_* flags (flags.validate): in each
    launched rank too, which gets the flagfiles expanded (a review found them refused there)."""
    result = run_cli("train.py", "--flagfile=glm5.flags", "--finetune=full", "--nproc_per_node=2", "--max_steps=1",
                     "--warmup_steps=0", "--eval_interval=0", "--save_interval=0", "--seq_len=64",
                     f"--output_dir={tmp_path / 'o'}", DEVICE, cwd=str(tmp_path), env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert last_json(result.stdout)["steps"] == 1


def test_more_processes_than_gpus_is_refused_before_any_work(tmp_path):
    result = run_cli("train.py", *SMALL, f"--output_dir={tmp_path / 'o'}", "--device=cuda", "--nproc_per_node=64",
                     env=ENV)
    assert result.returncode == 2
    expected = "no CUDA device" if not torch.cuda.is_available() else "--nproc_per_node=64: this machine has"
    assert expected in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "o").exists()


def test_a_rank_killed_mid_checkpoint_ends_the_job_and_the_resume_is_exact(tmp_path):
    """kill -9 of rank 0 while it writes checkpoint-4: torchrun ends the other rank (it waits in
    the checkpoint's barrier) and the job fails within a bound; checkpoint-2 is complete and a
    resume from it trains exactly as the uninterrupted run."""
    import time

    args = ["--max_steps=6", "--save_interval=2", "--micro_batch_size=1", "--lora_dropout=0.1"]
    _train(tmp_path / "whole", *args, processes=2)
    t0 = time.time()
    killed = run_cli("train.py", *SMALL, f"--output_dir={tmp_path / 'split'}", DEVICE, "--nproc_per_node=2",
                     *args, env={**ENV, "V4TRAIN_KILL_AT": "checkpoint-write:2"})
    assert killed.returncode != 0 and time.time() - t0 < 300, killed.stderr[-3000:]
    assert sorted(p for p in os.listdir(tmp_path / "split") if p.startswith("checkpoint-")) == ["checkpoint-2"]
    _train(tmp_path / "split", *args, "--resume_from=latest", processes=2)
    for field in ("loss", "grad_norm"):
        assert_close(_curve(tmp_path / "split", field), _curve(tmp_path / "whole", field), f"resumed {field}")


def test_a_rank_whose_optimizer_shards_cannot_be_written_fails_the_checkpoint_on_every_rank(tmp_path):
    """Rank 1's write of its optimizer shards fails (an OSError, as a full disk gives) in
    checkpoint-4: every rank learns it in the write's collective, rank 0 says which checkpoint is kept,
    no rank waits for another, and checkpoint-2 stays the last complete one."""
    args = ["--max_steps=6", "--save_interval=2", "--micro_batch_size=1"]
    result = run_cli("train.py", *SMALL, f"--output_dir={tmp_path / 'o'}", DEVICE, "--nproc_per_node=2", *args,
                     env={**ENV, "V4TRAIN_KILL_AT": "optimizer-shards:2:raise", "V4TRAIN_KILL_RANK": "1"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(r"writing \S*checkpoint-4 failed \(rank 1: fault injected at optimizer-shards .*\); the last "
                     r"complete checkpoint, \S*checkpoint-2, is kept", result.stderr), result.stderr[-3000:]
    assert sorted(p for p in os.listdir(tmp_path / "o") if p.startswith("checkpoint-")) == ["checkpoint-2"]


def test_an_optimizer_folder_of_torch_distributed_checkpoint_is_refused_unread(tmp_path):
    """A checkpoint whose optimizer/ holds torch.distributed.checkpoint's files (an earlier v4train
    wrote them so), its .metadata a pickle, the manifest rewritten to match as someone who can write
    the folder would: the resume stops on one line naming the folder, and the pickle's code never
    runs (torch.distributed.checkpoint's load unpickles .metadata with pickle.load)."""
    import pickle

    args = ["--max_steps=4", "--save_interval=2", "--micro_batch_size=1"]
    _train(tmp_path / "run", *args, "--stop_at_step=2", processes=2)
    checkpoint, marker = tmp_path / "run" / "checkpoint-2", tmp_path / "payload-ran"
    replace_files(checkpoint, ["optimizer/rank0.safetensors", "optimizer/rank1.safetensors"],
                  {"optimizer/.metadata": pickle.dumps(Payload(str(marker))), "optimizer/__0_0.distcp": b""})
    result = run_cli("train.py", *SMALL, f"--output_dir={tmp_path / 'run'}", DEVICE, "--nproc_per_node=2", *args,
                     "--resume_from=latest", env=ENV)
    assert result.returncode == 2 and f"{checkpoint}/optimizer: holds torch.distributed.checkpoint's files" \
        in result.stderr, result.stderr[-3000:]
    assert not marker.exists(), "the pickle's code ran"
    # The launcher: the first failed rank's status, said in one line, no traceback of its own.
    assert re.search(r"train: rank [01] of 2 exited with status 2; the job is stopped", result.stderr), result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]

@pytest.mark.parametrize("action", ["raise", "hang"])
def test_a_rank_that_fails_or_hangs_ends_the_job(action, tmp_path):
    """Rank 1 raises (its error on the console) or hangs at its second step: rank 0, waiting in the
    next collective, is ended by torchrun or by --collective_timeout_s; no process is left and the
    job fails in bounded time."""
    import time

    t0 = time.time()
    result = run_cli("train.py", *SMALL, f"--output_dir={tmp_path / 'o'}", DEVICE, "--nproc_per_node=2",
                     "--max_steps=4", "--micro_batch_size=1", "--collective_timeout_s=20",
                     env={**ENV, "V4TRAIN_KILL_AT": f"step:2:{action}", "V4TRAIN_KILL_RANK": "1"})
    assert result.returncode != 0 and time.time() - t0 < 240, result.stderr[-3000:]
    if action == "raise":
        assert "fault injected at step" in result.stderr
    else:
        assert "timed out" in result.stderr.lower() or "timeout" in result.stderr.lower(), result.stderr[-3000:]


# A sitecustomize module for the processes of a //py:train run (the test's import path is their
# PYTHONPATH), writing to $V4TRAIN_TEST_PROBES/rank{RANK}.gathers the most tensors
# DTensor.full_tensor gathered that were alive at once, and to .../rank{RANK}.whole the key of
# every tensor read whole from a safetensors file.
PROBES = """
import os, weakref
if os.environ.get("V4TRAIN_TEST_PROBES") and "RANK" in os.environ:
    import safetensors
    from torch.distributed.tensor import DTensor
    out = os.path.join(os.environ["V4TRAIN_TEST_PROBES"], "rank" + os.environ["RANK"])
    full_tensor, live, most = DTensor.full_tensor, [0], [0]

    def gone():
        live[0] -= 1

    def counted(self, *args, **kwargs):
        t = full_tensor(self, *args, **kwargs)
        live[0] += 1
        weakref.finalize(t, gone)
        if live[0] > most[0]:
            most[0] = live[0]
            with open(out + ".gathers", "w") as f:
                f.write(str(most[0]))
        return t
    DTensor.full_tensor = counted
    opened = safetensors.safe_open

    class Logged:  # safe_open's handle, each tensor read whole noted
        def __init__(self, *args, **kwargs):
            self.handle = opened(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.handle, name)

        def get_tensor(self, key):
            with open(out + ".whole", "a") as f:
                f.write(key + "\\n")
            return self.handle.get_tensor(key)
    safetensors.safe_open = Logged
"""


def test_full_fine_tuning_over_two_expert_parallel_processes_trains_as_one(tmp_path, monkeypatch):
    """--finetune=full: every weight FSDP2's or (the experts) expert parallel; the checkpoint's
    weights (gathered whole, transformers' layout) and the losses equal one process's; the save
    holds one gathered tensor at a time on each rank (rank 0 writes each before the next gather);
    a resume from checkpoint-1 continues exactly; no rank reads, of the base or of the checkpoint,
    a weight whole but its own experts' (the rest: its FSDP2 shards' rows)."""
    import shutil

    args = ["--finetune=full", "--max_steps=2", "--micro_batch_size=1", "--adam_eps=1e-3", "--lr=1e-3",
            "--save_interval=1"]
    full = [a for a in SMALL if not a.startswith("--lora")]
    probes = tmp_path / "site"
    probes.mkdir()
    (probes / "sitecustomize.py").write_text(PROBES)
    monkeypatch.syspath_prepend(str(probes))
    env = {**ENV, "V4TRAIN_TEST_PROBES": str(probes)}
    runs = {}
    for name, extra, n in (("one", ["--grad_accum=2"], 1), ("two", ["--expert_parallel=2"], 2)):
        launch = [f"--nproc_per_node={n}"] if n > 1 else []
        result = run_cli("train.py", *full, f"--output_dir={tmp_path / name}", DEVICE, *args, *extra, *launch,
                         env=env)
        assert result.returncode == 0, result.stderr[-4000:]
        runs[name] = load_file(str(tmp_path / name / "checkpoint-2" / "model.safetensors"))
    for field in ("loss", "grad_norm"):
        assert_rel_close(_curve(tmp_path / "two", field), _curve(tmp_path / "one", field), f"per-step {field}")
    assert sorted(runs["two"]) == sorted(runs["one"])
    for key, t in runs["one"].items():
        assert_rel_close(runs["two"][key], t, f"final weight {key}")
    for rank in (0, 1):  # (the file is there: the save gathered)
        most = int((probes / f"rank{rank}.gathers").read_text())
        assert most == 1, f"rank {rank} held {most} gathered tensors at once while saving"
    shutil.copytree(tmp_path / "two", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint-2")
    result = run_cli("train.py", *full, f"--output_dir={tmp_path / 'resumed'}", DEVICE, *args, "--expert_parallel=2",
                     "--nproc_per_node=2", "--resume_from=latest", env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    resumed = load_file(str(tmp_path / "resumed" / "checkpoint-2" / "model.safetensors"))
    for key, t in runs["two"].items():
        assert_close(resumed[key], t, f"resumed weight {key}")
    for rank in (0, 1):  # the base's and checkpoint-1's weights (and the generators' states)
        whole = (probes / f"rank{rank}.whole").read_text().split()
        experts = [re.search(r"\.experts\.(\d+)\.", k) for k in whole]  # rank r's: 4r .. 4r + 3
        others = [k for k, e in zip(whole, experts)
                  if k.startswith(("model.", "lm_head.")) and not (e and int(e.group(1)) // 4 == rank)]
        assert not others, f"rank {rank} read {len(others)} tensor(s) whole besides its experts', first {others[0]}"


def test_an_fp8_base_trains_lora_over_two_expert_parallel_processes_as_one(tmp_path):
    """The Qwen3.5 base quantised as its released FP8 checkpoint (--fp8=keep: float8 maps with their
    scales, which FSDP2 shards and gathers as any weight): 2 expert-parallel processes equal 1."""
    from golden_cases import copy_model
    from v4train.reference.lora import quantize_fp8, scale_name

    def quantise(t):
        for name in [n for n in t if n.endswith(("in_proj_qkv.weight", "in_proj_z.weight", "out_proj.weight",
                                                   "o_proj.weight", "shared_expert.down_proj.weight"))]:
            t[name], t[scale_name(name)] = quantize_fp8(t[name])
    base = copy_model(tmp_path, tensors=quantise, base=QWEN_BASE)
    stored = load_file(os.path.join(base, "model.safetensors"))
    assert sum(t.dtype == torch.float8_e4m3fn for t in stored.values()) >= 8  # kept so by --fp8=keep (default)
    args = ["--model_dir=" + base, "--max_steps=3", "--micro_batch_size=1", "--adam_eps=1e-3"]
    _train(tmp_path / "one", *args, "--grad_accum=2")
    _train(tmp_path / "two", *args, "--expert_parallel=2", processes=2)
    for field in ("loss", "grad_norm"):
        assert_rel_close(_curve(tmp_path / "two", field), _curve(tmp_path / "one", field), f"per-step {field}")
