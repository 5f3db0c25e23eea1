"""//py:train end to end: flags, outputs, checkpoints, exact resume, the C++/reference switch."""

import json
import os

import pytest
import torch

from golden_cases import BASE, CHAT, CHAT_EVAL, SMALL, last_json, metrics, run_cli
from v4train.testing.compare import assert_close


@pytest.mark.parametrize("args,message", [
    ([], "give exactly one of --model_dir (fine-tune a checkpoint) and --model_config"),
    (["--model_dir=x", "--model_config=y", "--data=d", "--output_dir=o"], "give exactly one of --model_dir"),
    (["--model_dir=x", "--data=d", "--output_dir=o", "--finetune=full", "--lora_r=4"],
     "--lora_* flags contradict --finetune=full"),
    (["--model_dir=x", "--data=d", "--output_dir=o", "--max_steps=5", "--warmup_steps=10"],
     "--warmup_steps=10 is more than the 5 steps of this run (--max_steps=5)"),
    (["--model_dir=" + BASE, "--data=nowhere.jsonl", "--output_dir=o"], "--data=nowhere.jsonl: not found"),
    (["--model_dir=" + BASE, "--data=" + CHAT, "--output_dir=o", "--cpp_ops=rms_norm,nope"],
     "--cpp_ops: unknown op(s) v4_nope"),
    (["--model_dir=" + BASE, "--data=" + CHAT, "--output_dir=o", "--lora_target_modules=nope", "--nolora_experts"],
     "--lora_target_modules=nope: nope matches no module of glm_moe_dsa"),
    (["--model_dir=x", "--data=d", "--output_dir=o", "--nosave_base_model"],
     "--nosave_base_model: only a --model_config LoRA run writes a base (base_model/); a --model_dir checkpoint is "
     "its own base"),
    (["--model_dir=x", "--data=d", "--output_dir=o", "--max_steps=5", "--profile_step=6"],
     "--profile_step=6 is past the last step (--max_steps=5)"),
    (["--model_dir=x", "--data=d", "--output_dir=o", "--max_steps=3", "--stop_at_step=500"],
     "--stop_at_step=500 is past the last step (--max_steps=3)"),
    (["--model_dir=" + BASE, "--data=" + CHAT, "--output_dir=o", "--epochs=1", "--stop_at_step=100000"],
     "--stop_at_step=100000 is past the last of the run's"),
    (["--output_dir=o", "--max_steps=2", "--flagfile=glm5.flags"],
     "--max_steps, --output_dir given before --flagfile=glm5.flags, which sets it again"),
    (["--lr=-1"], "--lr"),
    (["--nonsense=1"], "Unknown command line flag 'nonsense'"),
    (["--flagfile=missing.flags"], "--flagfile=missing.flags: not found"),
])
def test_bad_flags_stop_before_any_work_naming_the_flag(args, message, tmp_path):
    result = run_cli("train.py", *args, cwd=str(tmp_path))
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()


def test_help_lists_the_trainer_s_flags(tmp_path):
    result = run_cli("train.py", "--help", cwd=str(tmp_path))
    assert result.returncode == 0, "help asked for is no failure (absl exits 1)"
    assert "--model_dir:" in result.stdout and "--lora_r:" in result.stdout and "--resume_from:" in result.stdout, \
        result.stdout[-2000:]


def test_bf16_on_a_cpu_without_bf16_instructions_is_said_to_be_slow(monkeypatch):
    from v4train.cli import slow_dtype_note

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert "about 10x slower than --dtype=float32" in slow_dtype_note("cpu", torch.bfloat16)
    assert slow_dtype_note("cpu", torch.float32) is None and slow_dtype_note("cuda", torch.bfloat16) is None
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert slow_dtype_note("cpu", torch.bfloat16) is None


def test_lora_run_writes_metrics_plot_checkpoints_and_summary(tmp_path):
    out = tmp_path / "run"
    result = run_cli("train.py", *SMALL, f"--output_dir={out}", "--max_steps=6", "--save_interval=2",
                     "--save_total_limit=2", "--eval_data=" + CHAT_EVAL, "--eval_interval=3")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = last_json(result.stdout)
    assert summary["steps"] == 6 and summary["final_loss"] < summary["first_loss"]
    assert summary["first_step"] == 1 and summary["eval_step"] == 6
    rows = metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_mib"} <= set(rows[0])
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6]
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(out)) == ["checkpoint-4", "checkpoint-6", "loss.png", "metrics.jsonl"]
    adapter = json.loads((out / "checkpoint-6" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == os.path.abspath(BASE)
    assert adapter["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert {"adapter_model.safetensors", "optimizer.safetensors", "rng_state.safetensors", "rng_state.json", "trainer_state.json",
            "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out / "checkpoint-6"))


def test_data_from_a_pipe_trains_as_from_the_file(tmp_path):
    """--data may be a pipe or FIFO (`--data=<(zcat d.jsonl.gz)`), read once: the first step's loss
    as from the file."""
    from golden_cases import fifo_of, run_train

    args = [a for a in SMALL if not a.startswith("--data=")] + ["--max_steps=1"]
    with fifo_of(tmp_path / "chat.jsonl", open(CHAT, "rb").read()) as fifo:
        piped = run_train(*args, f"--data={fifo}", f"--output_dir={tmp_path / 'piped'}")
    from_file = run_train(*args, f"--data={CHAT}", f"--output_dir={tmp_path / 'file'}")
    assert piped.returncode == 0 and from_file.returncode == 0, piped.stderr[-3000:] + from_file.stderr[-3000:]
    assert last_json(piped.stdout)["first_loss"] == last_json(from_file.stdout)["first_loss"]


def test_resumed_run_continues_the_same_loss_curve(tmp_path):
    # Dropout and several epochs' worth of shuffling make the RNG and data position matter.
    args = [*SMALL, "--max_steps=8", "--save_interval=4", "--lora_dropout=0.1", "--grad_accum=2"]
    whole = run_cli("train.py", *args, f"--output_dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run_cli("train.py", *args, f"--output_dir={tmp_path / 'split'}", "--stop_at_step=4")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "stopped after step 4" in first.stderr
    assert (last_json(first.stdout)["steps"], last_json(first.stdout)["first_step"]) == (4, 1)  # not the run's 8
    again = run_cli("train.py", *args, f"--output_dir={tmp_path / 'split'}", "--resume_from=latest", "--stop_at_step=4")
    assert again.returncode == 2 and "--stop_at_step=4: --resume_from=" in again.stderr, again.stderr[-2000:]
    assert "is already at step 4" in again.stderr and "Traceback" not in again.stderr
    other = run_cli("train.py", *args, f"--output_dir={tmp_path / 'split'}", "--resume_from=latest", "--seq_len=64")
    assert other.returncode == 2 and "the checkpoint was made on other data or rows (" in other.stderr, \
        other.stderr[-2000:]
    assert "seq_len 128 there, 64 here" in other.stderr and "Traceback" not in other.stderr
    second = run_cli("train.py", *args, f"--output_dir={tmp_path / 'split'}", "--resume_from=latest")
    assert second.returncode == 0, second.stderr[-3000:]
    assert (last_json(second.stdout)["steps"], last_json(second.stdout)["first_step"]) == (8, 5)
    assert f"resuming {tmp_path / 'split' / 'checkpoint-4'}: step 4 of 8 done" in second.stderr
    a, b = metrics(str(tmp_path / "whole")), metrics(str(tmp_path / "split"))
    assert [r["step"] for r in b] == list(range(1, 9))
    assert_close(torch.tensor([r["loss"] for r in b]), torch.tensor([r["loss"] for r in a]), "resumed loss curve")
    assert_close(torch.tensor([r["grad_norm"] for r in b]), torch.tensor([r["grad_norm"] for r in a]), "grad norms")


def test_eval_data_without_target_tokens_is_refused_naming_it(tmp_path):
    # Its mean loss would divide by no tokens (it printed 0.0); //py:evaluate refuses the same file.
    evals = tmp_path / "prompts_only.jsonl"
    evals.write_text(json.dumps({"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}) + "\n")
    result = run_cli("train.py", *SMALL, f"--output_dir={tmp_path / 'o'}", "--max_steps=2", f"--eval_data={evals}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"--eval_data={evals}: no target tokens" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()


def test_cpp_and_reference_paths_train_alike(tmp_path):
    runs = {}
    for cpp in ("none", "all"):
        result = run_cli("train.py", *SMALL, f"--output_dir={tmp_path / cpp}", "--max_steps=3", f"--cpp_ops={cpp}")
        assert result.returncode == 0, result.stderr[-3000:]
        runs[cpp] = torch.tensor([r["loss"] for r in metrics(str(tmp_path / cpp))])
    from v4train import ops
    from v4train.models import FAMILIES

    qwen = {op.name for op in FAMILIES["qwen3_5"].ops}  # the GLM-5 model's line names no Qwen3.5 op
    assert "C++ ops: " + ", ".join(sorted(ops.resolve("all").cpp - qwen)) + ";" in result.stderr
    assert "v4_glm5_layer_forward" in result.stderr and "v4_qwen3_5_layer_forward" not in result.stderr
    assert_close(runs["all"], runs["none"], "loss, C++ vs reference")


def test_full_finetuning_from_a_config_saves_hf_weights(tmp_path):
    out = tmp_path / "full"
    result = run_cli("train.py", "--model_config=" + os.path.join(os.path.dirname(CHAT), "glm5_config.json"),
                     "--tokenizer_dir=" + os.path.join(os.path.dirname(CHAT), "tokenizer"), "--data=" + CHAT,
                     "--finetune=full", "--dtype=float32", "--seq_len=128", "--micro_batch_size=2", "--max_steps=2",
                     f"--output_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    from v4train import hf_checkpoint

    model, _ = hf_checkpoint.load(str(out / "checkpoint-2"))
    assert model.cfg.model_type == "glm_moe_dsa"


def test_lora_from_a_config_saves_a_loadable_base(tmp_path):
    out = tmp_path / "lora_random"
    sft = os.path.dirname(CHAT)
    result = run_cli("train.py", "--model_config=" + os.path.join(sft, "glm5_config.json"),
                     "--tokenizer_dir=" + os.path.join(sft, "tokenizer"), "--data=" + CHAT, "--dtype=float32",
                     "--seq_len=128", "--micro_batch_size=2", "--max_steps=1", f"--output_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    adapter = json.loads((out / "checkpoint-1" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(out / "base_model")
    from v4train import hf_checkpoint, lora

    model, _ = hf_checkpoint.load(adapter["base_model_name_or_path"])
    lora.load_peft(model, str(out / "checkpoint-1"), torch.float32, "cpu")


@pytest.mark.parametrize("schedule,warmup,total,expected", [
    # Hugging Face's decay (progress (step - 1 - warmup) / (total - warmup)), by hand:
    ("cosine", 0, 4, [1.0, 0.5 * (1 + 0.7071067811865476), 0.5, 0.5 * (1 - 0.7071067811865476)]),
    ("linear", 0, 4, [1.0, 0.75, 0.5, 0.25]),
    ("cosine", 2, 4, [0.5, 1.0, 1.0, 0.5]),
    ("linear", 1, 3, [1.0, 1.0, 0.5]),
    ("cosine", 0, 1, [1.0]),
    ("constant", 3, 5, [1 / 3, 2 / 3, 1.0, 1.0, 1.0]),
])
def test_every_step_of_a_schedule_trains(schedule, warmup, total, expected):
    """With min_lr 0, every step of the run has lr > 0: the last one too, and a run of one step
    trains at --lr (the schedule gave the last step min_lr before)."""
    from v4train.optim import lr_at

    got = [lr_at(step, 1.0, 0.0, warmup, total, schedule) for step in range(1, total + 1)]
    assert got == pytest.approx(expected, rel=1e-12)
    assert all(lr > 0 for lr in got)


def test_the_first_and_the_last_step_change_the_adapter(tmp_path):
    """--max_steps=2, a checkpoint after each step: step 1 moves the adapter away from its
    initialisation (B = 0), step 2 (the last) moves it again."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    result = run_cli("train.py", *SMALL, f"--output_dir={out}", "--max_steps=2", "--save_interval=1",
                     "--save_total_limit=2")
    assert result.returncode == 0, result.stderr[-3000:]
    first, last = (load_file(str(out / f"checkpoint-{s}" / "adapter_model.safetensors")) for s in (1, 2))
    b_names = [n for n in first if "lora_B" in n]
    assert b_names and any(first[n].abs().sum() > 0 for n in b_names), "step 1 left every B at zero"
    assert any(not torch.equal(first[n], last[n]) for n in first), "the last step changed nothing"


def test_a_trainer_runs_from_a_run_config_without_flags(tmp_path, capsys):
    """v4train.trainer: a RunConfig built directly (no absl), a Trainer run: what a library user,
    or a distributed launcher, does."""
    import signal

    from v4train.trainer import RunConfig, Trainer

    before = signal.getsignal(signal.SIGINT)
    cfg = RunConfig(data=CHAT, output_dir=str(tmp_path / "out"), model_dir=BASE, dtype=torch.float32, max_steps=2,
                    seq_len=128, micro_batch_size=2, lr=2e-3, lora_r=4, lora_alpha=8, self_check=False)
    assert Trainer(cfg).run() == 0
    summary = last_json(capsys.readouterr().out)
    assert summary["steps"] == 2 and summary["checkpoint"] == str(tmp_path / "out" / "checkpoint-2")
    assert summary["final_loss"] < summary["first_loss"] + 1.0
    assert signal.getsignal(signal.SIGINT) is before, "the run leaves the signal handlers as it found them"


def test_full_fine_tuning_of_a_base_kept_in_fp8_is_refused_naming_fp8_dequantize(tmp_path):
    from golden_cases import error_line, golden, run_train

    model_dir, tensors, _ = golden("glm5_yarn_fp8")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in tensors["input_ids"].tolist()))
    result = run_train(f"--model_dir={model_dir}", f"--data={data}", "--finetune=full", "--dtype=float32",
                       "--max_steps=1", "--warmup_steps=0", f"--output_dir={tmp_path / 'run'}")
    assert "--fp8=dequantize" in error_line(result)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_lora_on_a_base_kept_in_fp8_trains_as_on_the_base_dequantised_on_load(tmp_path):
    """The same run with the FP8 golden kept in FP8 and dequantised on load: the same losses step by
    step (the ops dequantise the very values the loader would)."""
    from golden_cases import golden, run_train

    model_dir, tensors, _ = golden("glm5_yarn_fp8")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in tensors["input_ids"].tolist()))
    losses = {}
    for how in ("keep", "dequantize"):
        out = tmp_path / how
        result = run_train(f"--model_dir={model_dir}", f"--data={data}", "--dtype=float32", "--max_steps=3",
                           "--warmup_steps=0", "--micro_batch_size=1", f"--fp8={how}", f"--output_dir={out}")
        assert result.returncode == 0, result.stderr[-3000:]
        losses[how] = [row["loss"] for row in metrics(str(out))]
    assert len(losses["keep"]) == 3 and losses["keep"] == losses["dequantize"], losses


def test_a_logged_row_s_loss_is_the_mean_over_its_interval(tmp_path):
    """--log_interval=2 logged the second step's loss alone (the QA pass); HF's Trainer, and now
    v4train, log the mean over the steps since the last row."""
    every = run_cli("train.py", *SMALL, "--max_steps=4", f"--output_dir={tmp_path / 'every'}")
    paired = run_cli("train.py", *SMALL, "--max_steps=4", "--log_interval=2", f"--output_dir={tmp_path / 'paired'}")
    assert every.returncode == 0 and paired.returncode == 0, paired.stderr[-2000:]
    losses = [r["loss"] for r in metrics(str(tmp_path / "every"))]
    rows = metrics(str(tmp_path / "paired"))
    assert [r["step"] for r in rows] == [2, 4]
    assert_close(torch.tensor([r["loss"] for r in rows], dtype=torch.float64),
                 torch.tensor([(losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2], dtype=torch.float64),
                 "the rows' losses")
    assert last_json(paired.stdout)["final_loss"] == losses[3], "the summary's final loss is the last step's"
