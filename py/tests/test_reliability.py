"""Issue 10, end to end through //py:train: no run loses data, a fault or a damaged checkpoint
gets one line naming the file, no non-finite value trains silently. Each test names the item of
the issue it covers; each failed on the code before the fix. Bad flags, data and model files are
test_bad_input.py; the SIGKILL fault injection is test_faults.py."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from golden_cases import (BASE, CHAT, CHAT_EVAL, RUN, SMALL, copy_model, error_line, last_json, metrics,  # noqa: F401
                          run_cli, run_copy, run_train, start_cli, stopped_run)  # run_copy, stopped_run: fixtures
from v4train import data
from v4train.tokenizer import Tokenizer

CHECKPOINT_FILES = {"adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors",
                    "rng_state.safetensors", "rng_state.json", "trainer_state.json"}


def snapshot(folder) -> dict[str, bytes]:
    """Every file below folder, by relative path, with its bytes."""
    return {os.path.relpath(os.path.join(p, n), folder): open(os.path.join(p, n), "rb").read()
            for p, _, names in os.walk(folder) for n in names}


def wait_for_rows(out, n: int, proc) -> None:
    """Until metrics.jsonl of a background run has n complete rows."""
    deadline = time.time() + 300
    while time.time() < deadline:
        path = out / "metrics.jsonl"
        if path.exists() and path.read_text().count("\n") >= n:
            return
        assert proc.poll() is None, "the run ended early"
        time.sleep(0.1)
    raise AssertionError("the run wrote no metrics in 300 s")


# 1. A fresh run never mixes with an earlier one; two runs never write one output_dir.

def test_1_a_fresh_run_refuses_an_output_dir_holding_an_earlier_run(tmp_path):
    out = tmp_path / "run"
    first = run_train(*SMALL, f"--output_dir={out}", "--max_steps=6", "--save_interval=3")
    assert first.returncode == 0, first.stderr[-3000:]
    before = snapshot(out)
    again = run_train(*SMALL, f"--output_dir={out}", "--max_steps=4", "--save_interval=2")
    message = error_line(again)
    assert f"--output_dir={out} holds an earlier run (checkpoint-3, checkpoint-6, loss.png, metrics.jsonl)" in message
    assert "--resume_from=latest" in message and "--overwrite_output_dir" in message
    assert snapshot(out) == before, "the refused run changed nothing"
    # Resuming from an older checkpoint of the run would overwrite the newer one: refused too.
    older = run_train(*SMALL, f"--output_dir={out}", "--max_steps=6", "--save_interval=3",
                  f"--resume_from={out}/checkpoint-3")
    assert f"holds checkpoints newer than --resume_from={out}/checkpoint-3, which this run would overwrite " \
           "(checkpoint-6)" in error_line(older)
    assert snapshot(out) == before
    fresh = run_train(*SMALL, f"--output_dir={out}", "--max_steps=4", "--save_interval=2", "--overwrite_output_dir")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "deleted the earlier run's checkpoint-3, checkpoint-6, loss.png, metrics.jsonl" in fresh.stderr
    assert last_json(fresh.stdout)["checkpoint"] == str(out / "checkpoint-4")
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4", "loss.png", "metrics.jsonl"]
    assert [r["step"] for r in metrics(str(out))] == [1, 2, 3, 4]


def test_1_two_runs_cannot_write_one_output_dir_and_a_stale_lock_is_taken_over(tmp_path):
    out = tmp_path / "run"
    holder = start_cli("train.py", *SMALL, f"--output_dir={out}", "--max_steps=100000", stderr=subprocess.DEVNULL)
    try:
        wait_for_rows(out, 1, holder)
        second = run_train(*SMALL, f"--output_dir={out}", "--max_steps=2", "--overwrite_output_dir")
        assert f"--output_dir={out}: another run (pid {holder.pid}) is writing it" in error_line(second)
        resumed = run_train(*SMALL, f"--output_dir={out}", "--max_steps=2", "--resume_from=latest")
        assert f"--resume_from=latest: {out} has no checkpoint yet, and another run (pid {holder.pid}) is writing " \
               "it; wait for" in error_line(resumed), "not: start afresh with --overwrite_output_dir"
        assert metrics(str(out))[0]["step"] == 1, "the refused runs deleted nothing"
    finally:
        holder.kill()
        holder.wait()
    assert (out / ".lock").exists(), "the killed run's lock file stays behind"
    third = run_train(*SMALL, f"--output_dir={out}", "--max_steps=2", "--overwrite_output_dir")
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"took over the stale lock of pid {holder.pid}" in third.stderr
    assert not (out / ".lock").exists(), "a finished run removes its lock"


# 3. Non-finite values: checked in the loaded weights, and at every step.

def test_3_a_nan_weight_is_refused_at_load_naming_the_tensor(tmp_path):
    model = copy_model(tmp_path, tensors=lambda t: t["model.layers.1.self_attn.o_proj.weight"].view(-1)[7:9].fill_(
        float("nan")))
    result = run_train(*SMALL, f"--model_dir={model}", f"--output_dir={tmp_path / 'out'}", "--max_steps=2")
    assert "model.layers.1.self_attn.o_proj.weight: 2 NaN/inf value(s)" in result.stderr
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_3_a_nonfinite_step_stops_the_run_keeping_the_last_checkpoint(tmp_path):
    # lr 1e20: step 1's update makes the attention adapters huge, and step 2's attention scores inf.
    out = tmp_path / "run"
    result = run_train(*SMALL, f"--output_dir={out}", "--max_steps=6", "--save_interval=1", "--lr=1e20")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "train: stopped (--on_nonfinite=stop) at step 2: the loss is nan" in result.stderr
    assert "NaN/inf in the gradient of" in result.stderr and ", first model.layers.0.self_attn." in result.stderr
    assert f"No update was applied; the last checkpoint, {out}/checkpoint-1, is kept" in result.stderr
    assert sorted(os.listdir(out)) == ["checkpoint-1", "metrics.jsonl"]
    adapter = load_file(str(out / "checkpoint-1" / "adapter_model.safetensors"))
    assert all(torch.isfinite(t).all() for t in adapter.values())
    rows = metrics(str(out))
    assert rows[0]["step"] == 1 and torch.isfinite(torch.tensor(rows[0]["loss"]))
    assert rows[1]["step"] == 2 and "loss" not in rows[1] and rows[1]["nonfinite"].startswith("step 2: the loss is nan")


def test_3_skip_mode_skips_and_counts_and_stops_after_too_many_in_a_row(tmp_path):
    out = tmp_path / "run"
    result = run_train(*SMALL, f"--output_dir={out}", "--max_steps=8", "--lr=1e20", "--on_nonfinite=skip",
                   "--max_nonfinite_skips=3")
    assert result.returncode == 1, result.stderr[-3000:]
    for step in (2, 3):
        assert f"train: skipped step {step}: the loss is nan" in result.stderr
    assert "train: stopped (3 non-finite steps in a row, --max_nonfinite_skips=3) at step 4" in result.stderr
    assert [(r["step"], "nonfinite" in r) for r in metrics(str(out))] == [(1, False), (2, True), (3, True), (4, True)]


def test_8_a_failed_save_keeps_the_last_checkpoint_and_says_so(run_copy):
    # A file size limit makes every write past 100 kB fail as a full disk does (EFBIG for ENOSPC):
    # the adapter of checkpoint-4 (255 kB) cannot be written.
    import resource

    before = snapshot(run_copy / "checkpoint-2")
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # noqa: E731
    result = run_train(*RUN, f"--output_dir={run_copy}", "--resume_from=latest", preexec_fn=limit)
    message = error_line(result)
    assert f"writing {run_copy}/checkpoint-4 failed (" in message and "File too large" in message
    assert f"the last complete checkpoint, {run_copy}/checkpoint-2, is kept" in message
    assert snapshot(run_copy / "checkpoint-2") == before
    assert sorted(os.listdir(run_copy)) == ["checkpoint-2", "loss.png", "metrics.jsonl"], "no temporary folder left"


def test_8_a_malformed_adapter_config_is_named(run_copy):
    (run_copy / "checkpoint-2" / "adapter_config.json").write_text('{"r": 4,')
    result = run_cli("evaluate.py", f"--model_dir={BASE}", f"--data={CHAT_EVAL}",
                     f"--adapter_dir={run_copy / 'checkpoint-2'}")
    assert f"{run_copy}/checkpoint-2/adapter_config.json: not valid JSON" in error_line(result)


def _rewrite(checkpoint, name: str, content: bytes) -> None:
    """Replaces a checkpoint file and its manifest entry, as if it had been written so."""
    (checkpoint / name).write_bytes(content)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_8_a_malformed_trainer_state_is_named(run_copy):
    _rewrite(run_copy / "checkpoint-2", "trainer_state.json", b'{"step": 2,')
    result = run_train(*RUN, f"--output_dir={run_copy}", "--resume_from=latest")
    assert f"{run_copy}/checkpoint-2/trainer_state.json: not valid JSON" in error_line(result)


# 5. Checkpoints complete or absent; temporary folders of a killed write removed.

def test_5_the_next_run_removes_the_temporary_folders_of_a_killed_write(run_copy):
    stale = run_copy / ".tmp-checkpoint-4-x1y2z3w4"  # as v4train names and marks them (v4train.atomic)
    (stale / "content").mkdir(parents=True)
    (stale / ".v4train-temporary").write_text("")
    (stale / "content" / "adapter_model.safetensors").write_bytes(b"half")
    result = run_train(*RUN, f"--output_dir={run_copy}", "--resume_from=latest")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "removed 1 temporary folder(s) of an interrupted write: .tmp-checkpoint-4-x1y2z3w4" in result.stderr
    assert sorted(os.listdir(run_copy)) == ["checkpoint-2", "checkpoint-4", "loss.png", "metrics.jsonl"]


def test_5_a_checkpoint_missing_a_file_is_incomplete_whatever_else_it_holds(run_copy):
    # What a kill during the old rotation left: a checkpoint with trainer_state.json but not all its files.
    half = run_copy / "checkpoint-3"
    shutil.copytree(run_copy / "checkpoint-2", half)
    os.remove(half / "optimizer.safetensors")
    named = run_train(*RUN, f"--output_dir={run_copy}", f"--resume_from={half}")
    assert f"{half}: not a complete v4train checkpoint: optimizer.safetensors is missing" in error_line(named)
    latest = run_train(*RUN, f"--output_dir={run_copy}", "--resume_from=latest")
    assert "train: checkpoint-3 is incomplete: optimizer.safetensors is missing" in latest.stderr
    assert f"newer than --resume_from={run_copy}/checkpoint-2, which this run would overwrite (checkpoint-3)" in \
        error_line(latest)
    replaced = run_train(*RUN, f"--output_dir={run_copy}", "--resume_from=latest", "--overwrite_output_dir")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert [r["step"] for r in metrics(str(run_copy))] == [1, 2, 3, 4]


# 7. Resume: damaged files and changed flags are one line naming the file; a torn metrics line is dropped.

@pytest.mark.parametrize("name", ["optimizer.safetensors", "adapter_model.safetensors", "rng_state.safetensors"])
def test_7_resume_from_a_truncated_file_names_it(name, run_copy):
    path = run_copy / "checkpoint-2" / name
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[: size // 2])
    named = run_train(*RUN, f"--output_dir={run_copy}", f"--resume_from={run_copy / 'checkpoint-2'}")
    assert f"{name} has {size // 2} bytes, manifest.json says {size} (truncated?)" in error_line(named)
    latest = run_train(*RUN, f"--output_dir={run_copy}", "--resume_from=latest")
    assert f"--resume_from=latest: no complete checkpoint in {run_copy} (checkpoint-2 is incomplete: {name} has " \
           in error_line(latest)


def test_7_resume_from_a_changed_file_names_it(run_copy):
    path = run_copy / "checkpoint-2" / "optimizer.safetensors"
    content = bytearray(path.read_bytes())
    content[-1] ^= 0xFF
    path.write_bytes(bytes(content))
    result = run_train(*RUN, f"--output_dir={run_copy}", "--resume_from=latest")
    assert f"{path}: its content changed since it was written (sha256 differs from manifest.json)" in error_line(result)


def test_7_resume_with_another_lora_rank_names_the_flag(run_copy):
    result = run_train(*RUN, f"--output_dir={run_copy}", "--resume_from=latest", "--lora_r=8")
    assert f"--resume_from={run_copy}/checkpoint-2: its adapter_config.json has r=4, but this run has --lora_r=8" \
        in error_line(result)


def test_7_a_torn_last_metrics_line_is_dropped_on_resume(run_copy):
    with open(run_copy / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 2.1')
    result = run_train(*RUN, f"--output_dir={run_copy}", "--resume_from=latest")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in metrics(str(run_copy))] == [1, 2, 3, 4]


# 6. Signals: a checkpoint at the end of the step, then exit; a second signal exits at once.

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_6_a_signal_saves_a_checkpoint_at_the_end_of_the_step_and_exits(sig, tmp_path):
    out = tmp_path / "run"
    args = [*SMALL, f"--output_dir={out}", "--max_steps=100000"]
    proc = start_cli("train.py", *args)
    wait_for_rows(out, 2, proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=300)
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert f"train: {name}: stopping at the end of this step, with a checkpoint" in stderr
    step = metrics(str(out))[-1]["step"]
    assert f"train: stopped after step {step} ({name}), saved in {out}/checkpoint-{step}" in stderr
    assert sorted(os.listdir(out)) == [f"checkpoint-{step}", "loss.png", "metrics.jsonl"]
    assert CHECKPOINT_FILES <= set(os.listdir(out / f"checkpoint-{step}"))
    resumed = run_train(*args, "--resume_from=latest", f"--stop_at_step={step + 1}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in metrics(str(out))] == list(range(1, step + 2))


def test_6_a_second_signal_exits_at_once(tmp_path):
    out = tmp_path / "run"
    proc = start_cli("train.py", *SMALL, f"--output_dir={out}", "--max_steps=100000")
    wait_for_rows(out, 2, proc)
    proc.send_signal(signal.SIGINT)
    for line in proc.stderr:
        if "SIGINT: stopping at the end of this step" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, stderr[-3000:]
    assert "train: SIGINT again: exiting now without saving" in stderr
    for name in os.listdir(out):  # what the first signal began to save is there whole, or not at all
        if name.startswith("checkpoint-"):
            assert (out / name / "manifest.json").exists() and CHECKPOINT_FILES <= set(os.listdir(out / name))


# 10. Sequences longer than the model's positions.

def test_10_examples_are_cut_at_max_position_embeddings_and_long_eval_records_reported(tmp_path):
    model = copy_model(tmp_path, config=lambda c: c.update(max_position_embeddings=64))
    tokenizer = Tokenizer(BASE)
    train_lengths = [len(r.input_ids) for r in data.read_records(CHAT, tokenizer)]
    eval_lengths = [len(r.input_ids) for r in data.read_records(CHAT_EVAL, tokenizer)]
    over_train, over_eval = sum(n > 64 for n in train_lengths), sum(n > 64 for n in eval_lengths)
    assert over_train > sum(n > 128 for n in train_lengths) and over_eval > 0, "the data has examples of 65-128 tokens"
    result = run_train(*SMALL, f"--model_dir={model}", f"--output_dir={tmp_path / 'out'}", "--max_steps=1",
                   f"--eval_data={CHAT_EVAL}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"({over_train} truncated, 0 dropped at the model's max_position_embeddings=64, below --seq_len=128)" \
        in result.stderr
    assert f"train: {over_eval} of the {len(eval_lengths)} --eval_data records are longer than the model's " \
           "max_position_embeddings=64" in result.stderr


# Issue 15, 7: restored state is checked before it is used.

@pytest.mark.parametrize("field,value,message", [
    ("step", -1, "field step: expected the folder's step 2 (an integer >= 1), got -1"),
    ("step", "2", "field step: expected the folder's step 2 (an integer >= 1), got '2'"),
    ("optimizer_steps", 5, "field optimizer_steps: expected an integer in [0, step=2], got 5"),
    ("loader", {"epoch": 0, "cursor": 3}, "field loader: cursor 3 is not a position of this data"),
    ("loader", {"epoch": -1, "cursor": 0}, "field loader: expected {\"epoch\", \"cursor\"} of integers >= 0"),
    # The position is the one step 2 reaches: 2 micro-batches (--grad_accum=1) of 2 rows.
    ("loader", {"epoch": 10**6, "cursor": 4}, "field loader: epoch 1000000, cursor 4 is not where 2 micro-batches of 2 "
                                              "rows end (epoch 0, cursor 4)"),
    ("loader", {"epoch": 0, "cursor": 0}, "field loader: epoch 0, cursor 0 is not where 2 micro-batches"),
])
def test_15_7_a_restored_value_out_of_range_names_the_file_and_field(run_copy, field, value, message):
    path = run_copy / "checkpoint-2" / "trainer_state.json"
    state = json.loads(path.read_text())
    state[field] = value
    _rewrite(run_copy / "checkpoint-2", "trainer_state.json", json.dumps(state).encode())
    result = run_train(*RUN, f"--output_dir={run_copy}", "--resume_from=latest")
    assert f"{path}: {message}" in error_line(result)


@pytest.mark.parametrize("packing", [True, False])
def test_15_7_the_position_a_step_implies_is_where_the_loader_is(packing):
    """Loader.position_after(n) is the state after n micro-batches, across epochs whose packed row
    counts differ (the check of a restored position relies on it)."""
    recs = [data.Record([i] * (1 + i % 4), [i] * (1 + i % 4), str(i)) for i in range(11)]
    loader = data.Loader(recs, 6, packing, 2, seed=1)
    for n in range(40):
        assert loader.position_after(n) == (loader.epoch, loader.cursor), n
        loader.next()


def test_15_7_a_nonfinite_optimizer_moment_is_refused(run_copy):
    from safetensors.torch import save_file

    path = run_copy / "checkpoint-2" / "optimizer.safetensors"
    tensors = load_file(str(path))
    name = sorted(k for k in tensors if k.endswith(".exp_avg"))[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(path))
    _rewrite(run_copy / "checkpoint-2", "optimizer.safetensors", path.read_bytes())
    result = run_train(*RUN, f"--output_dir={run_copy}", "--resume_from=latest")
    assert f"{path}: {name}: holds NaN or infinite values" in error_line(result)


def test_15_7_resuming_a_finished_run_says_it_is_finished(tmp_path):
    out = tmp_path / "run"
    assert run_train(*RUN, f"--output_dir={out}").returncode == 0
    again = run_train(*RUN, f"--output_dir={out}", "--resume_from=latest")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"the run is finished: {out}/checkpoint-4 is its last step (4 of 4); nothing to train" in again.stderr
    summary = last_json(again.stdout)
    assert summary["finished"] is True and summary["final_loss"] is not None
    past = run_train(*SMALL, "--max_steps=3", f"--output_dir={out}", "--resume_from=latest")
    assert f"it is step 4, past the 3 steps of this run; give a --max_steps of at least that" in error_line(past)


def test_1_resuming_another_folder_s_checkpoint_into_a_run_s_folder_says_what_to_do(tmp_path):
    """Not 'continue it with --resume_from=latest', which the user did not mean (the QA pass)."""
    from v4train.run_dir import Claim

    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "metrics.jsonl").write_text('{"step": 1}\n')
    other = str(tmp_path / "there" / "checkpoint-2")
    with pytest.raises(ValueError) as e:
        Claim(str(tmp_path / "here"), other, overwrite=False).__enter__()
    assert str(e.value) == (f"--output_dir={tmp_path / 'here'} holds an earlier run (metrics.jsonl), and "
                            f"--resume_from={other} is another folder's checkpoint: resume it into a new --output_dir, "
                            "or replace this folder's run with --overwrite_output_dir")
    assert not (tmp_path / "here" / ".lock").exists(), "the refused claim let go of its lock"
