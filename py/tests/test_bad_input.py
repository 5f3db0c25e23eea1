"""Issue 10, items 4, 8 and 9, end to end through //py:train: bad input (flag values, files,
data lines, configs, weights, LoRA targets) stops the run before any work with one line naming
the flag, file or tensor, never a traceback. Each case failed on the code before the fix. Bad
checkpoint files at resume are in test_reliability.py."""

import gzip
import json
import os

import pytest

from golden_cases import BASE, CHAT, QWEN_BASE, SMALL, copy_model, error_line, run_cli, run_train


def _sys_or_readonly(tmp_path) -> str:
    """A folder this process cannot write: /sys for root (whom permissions do not stop), else a
    read-only one."""
    if os.geteuid() == 0:
        return "/sys"
    d = tmp_path / "readonly"
    d.mkdir()
    d.chmod(0o555)
    return str(d)


def _data_file(tmp_path, line: bytes) -> str:
    """Two good chat lines of the bundled data, then `line` as line 3."""
    good = open(CHAT, "rb").read().splitlines()[:2]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join(good + [line]) + b"\n")
    return str(path)


def _gzip(tmp_path) -> str:
    path = tmp_path / "d.jsonl.gz"
    path.write_bytes(gzip.compress(open(CHAT, "rb").read()[:2000]))
    return str(path)


def _sharded_index(tmp_path) -> str:
    model = copy_model(tmp_path)
    with open(os.path.join(model, "model.safetensors.index.json"), "w") as f:
        f.write('{"weight_map": {"model.norm.weight": "model.safetensors",')
    return model


def _int32_norm(tensors):
    tensors["model.norm.weight"] = tensors["model.norm.weight"].int()


def _qwen_model(tmp_path, **config) -> str:
    """The bundled Qwen3.5 base in tmp_path/qwen, its layer_types left to full_attention_interval,
    config.json updated with `config`."""
    import shutil

    d = os.path.join(str(tmp_path), "qwen")
    shutil.copytree(QWEN_BASE, d)
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    c.pop("layer_types", None)
    c.update(config)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f)
    return d


# case: (tmp_path -> the flags that make it, what the one-line error must say)
BAD_INPUTS = {
    # 4. Wrong dtypes, LoRA targets and dropout.
    "int32 weight": (lambda tmp: ["--model_dir=" + copy_model(tmp, tensors=_int32_norm)],
                     "model.norm.weight: dtype int32, expected a floating-point weight"),
    "bogus LoRA target": (lambda tmp: ["--lora_target_modules=o_proj,bogus_proj"],
                          "--lora_target_modules=o_proj,bogus_proj: bogus_proj matches no module of glm_moe_dsa"),
    "LoRA dropout 1": (lambda tmp: ["--lora_dropout=1.0"], "--lora_dropout=1.0: expected a value below 1"),
    # 8. Files.
    "model_dir a file": (lambda tmp: ["--model_dir=" + CHAT],
                         f"--model_dir={CHAT}: {CHAT} is a file, expected a directory"),
    "output_dir a file": (lambda tmp: ["--output_dir=" + CHAT], f"--output_dir={CHAT}: is a file, expected a directory"),
    "output_dir not writable": (lambda tmp: ["--output_dir=" + _sys_or_readonly(tmp)], ": not writable ("),
    "invalid UTF-8": (lambda tmp: ["--data=" + _data_file(tmp, b'{"text": "caf\xff"}')],
                      "d.jsonl:3: not valid UTF-8 (byte 0xff at byte 14 of the line)"),
    "lone surrogate": (lambda tmp: ["--data=" + _data_file(tmp, b'{"text": "x\\ud800y"}')],
                       "d.jsonl:3: a string holds a lone surrogate (U+D800), which is not text"),
    "gzip data": (lambda tmp: ["--data=" + _gzip(tmp)],
                  "d.jsonl.gz: a gzip-compressed file; give the JSONL uncompressed (gunzip it first)"),
    "malformed index": (lambda tmp: ["--model_dir=" + _sharded_index(tmp)], "model.safetensors.index.json: not valid JSON"),
    "hidden_size a string": (lambda tmp: ["--model_dir=" + copy_model(tmp, config=lambda c: c.update(hidden_size="128"))],
                             'config.json: hidden_size must be an integer, got "128"'),
    # Issue 15, 8: config.json values out of range or of the wrong kind, named once at load.
    "hidden_size 0": (lambda tmp: ["--model_dir=" + copy_model(tmp, config=lambda c: c.update(hidden_size=0))],
                      "config.json: hidden_size must be an integer >= 1, got 0"),
    "top-k above the experts": (lambda tmp: ["--model_dir=" + copy_model(tmp, config=lambda c: c.update(num_experts_per_tok=99))],
                                "config.json: num_experts_per_tok must be at most n_routed_experts="),
    "negative eps": (lambda tmp: ["--model_dir=" + copy_model(tmp, config=lambda c: c.update(rms_norm_eps=-1e-5))],
                     "config.json: rms_norm_eps must be a finite number > 0, got -1e-05"),
    "a string for a dict": (lambda tmp: ["--model_dir=" + copy_model(tmp, config=lambda c: c.update(rope_parameters="yarn"))],
                            'config.json: rope_parameters must be an object, got "yarn"'),
    # Values the parser computes with, and the rotary embedding's, named by the file and the key.
    "n_group 0": (lambda tmp: ["--model_dir=" + copy_model(tmp, config=lambda c: c.update(n_group=0))],
                  "config.json: n_group must be an integer >= 1, got 0"),
    "YaRN factor -1": (lambda tmp: ["--model_dir=" + copy_model(tmp, config=lambda c: c.update(
        rope_parameters={"rope_type": "yarn", "factor": -1}))], "config.json: rope_parameters.factor must be a finite "
                                                               "number > 0, got -1"),
    "rope factor a string": (lambda tmp: ["--model_dir=" + copy_model(tmp, config=lambda c: c.update(
        rope_parameters={"rope_type": "default", "factor": "x"}))], 'config.json: rope_parameters.factor must be a '
                                                                   'finite number > 0, got "x"'),
    "max_position_embeddings -5": (lambda tmp: ["--model_dir=" + copy_model(tmp, config=lambda c: c.update(
        max_position_embeddings=-5))], "config.json: max_position_embeddings must be an integer >= 1, got -5"),
    "mlp_layer_types too short": (lambda tmp: ["--model_dir=" + copy_model(tmp, config=lambda c: c.update(
        mlp_layer_types=["dense"]))], "config.json: mlp_layer_types must have num_hidden_layers="),
    "Qwen full_attention_interval 0": (lambda tmp: ["--model_dir=" + _qwen_model(tmp, full_attention_interval=0)],
                                       "config.json: full_attention_interval must be an integer >= 1, got 0"),
    # 9. Flag values.
    "lr nan": (lambda tmp: ["--lr=nan"], "--lr=nan: expected a finite number"),
    "lr inf": (lambda tmp: ["--lr=inf"], "--lr=inf: expected a finite number"),
    "adam_beta2 1": (lambda tmp: ["--adam_beta2=1"], "--adam_beta2=1.0: expected a value below 1"),
    "adam_eps 0": (lambda tmp: ["--adam_eps=0"], "--adam_eps=0.0: expected a value > 0"),
    "max_grad_norm inf": (lambda tmp: ["--max_grad_norm=inf"], "--max_grad_norm=inf: expected a finite number"),
    # Issue 15, 6: settings that make training a no-op.
    "lora_alpha 0": (lambda tmp: ["--lora_alpha=0"], "--lora_alpha=0.0: expected a value > 0"),
    "lr 0": (lambda tmp: ["--lr=0"], "--lr=0.0: expected a value > 0 (a learning rate of 0 trains nothing)"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_4_8_9_bad_input_is_one_line_naming_it(case, tmp_path):
    make_args, message = BAD_INPUTS[case]
    args = make_args(tmp_path)
    out = [] if any(a.startswith("--output_dir=") for a in args) else [f"--output_dir={tmp_path / 'out'}"]
    result = run_train(*SMALL, "--max_steps=2", *out, *args)
    assert message in error_line(result)
    assert not (tmp_path / "out").exists(), "nothing is left behind"


def test_8_a_config_value_of_the_wrong_type_is_one_problem_not_one_per_tensor(tmp_path):
    model = copy_model(tmp_path, config=lambda c: c.update(hidden_size="128"))
    result = run_train(*SMALL, f"--model_dir={model}", f"--output_dir={tmp_path / 'out'}")
    error_line(result)
    assert "expected [" not in result.stderr and "\n  " not in result.stderr


def test_8_a_missing_tensor_is_reported_without_false_unexpected_ones(tmp_path):
    model = copy_model(tmp_path, tensors=lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    result = run_train(*SMALL, f"--model_dir={model}", f"--output_dir={tmp_path / 'out'}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "missing tensor model.layers.2.mlp.experts.5.up_proj.weight (for model.layers.2.mlp.experts.gate_up_proj)" \
        in result.stderr
    assert "unexpected tensor" not in result.stderr


def test_9_a_warmup_longer_than_the_run_names_the_flagfile(tmp_path):
    result = run_cli("train.py", "--flagfile=glm5.flags", "--max_steps=3", cwd=str(tmp_path))
    message = error_line(result)
    assert "--warmup_steps=5 (from glm5.flags) is more than the 3 steps of this run (--max_steps=3)" in message
    assert "pass a smaller --warmup_steps on the command line after the --flagfile" in message
    assert os.listdir(tmp_path) == []


# Issue 15, 9: flagfiles, tokenizers and data lines: one line naming the file (and the data line).

def _tokenizer_dir(tmp, edit) -> str:
    """The bundled base's tokenizer files in tmp/tok, tokenizer_config.json edited by `edit`
    (a callable on the parsed dict, or the raw text to write)."""
    import shutil

    d = os.path.join(str(tmp), "tok")
    os.makedirs(d, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(BASE, name), d)
    path = os.path.join(d, "tokenizer_config.json")
    if isinstance(edit, str):
        text = edit
    else:
        config = json.load(open(path))
        edit(config)
        text = json.dumps(config)
    with open(path, "w") as f:
        f.write(text)
    return d


STARTUP_INPUTS = {
    "flagfile a directory": (lambda tmp: [f"--flagfile={tmp}"], "is a directory, expected a text file"),
    "flagfile binary": (lambda tmp: [f"--flagfile={_data_file(tmp, bytes(range(128, 256)))}"],
                        "is not a text file (byte 0x"),
    "tokenizer config not JSON": (lambda tmp: [f"--tokenizer_dir={_tokenizer_dir(tmp, '{not json')}"],
                                  "tok/tokenizer_config.json: not valid JSON"),
    "template does not compile": (
        lambda tmp: [f"--tokenizer_dir={_tokenizer_dir(tmp, lambda c: c.update(chat_template='{{ x }'))}"],
        "tok/tokenizer_config.json: its chat_template does not compile"),
    "template raises": (
        lambda tmp: [f"--tokenizer_dir={_tokenizer_dir(tmp, lambda c: c.update(chat_template=RAISES))}"],
        "chat.jsonl:1 (and 1199 more line(s) alike): the chat template of"),
    "deeply nested JSON": (lambda tmp: ["--data=" + _data_file(tmp, b"[" * 100000 + b"]" * 100000)],
                           "d.jsonl:3: nested too deeply to read"),
    "no tokenizer": (lambda tmp: [f"--tokenizer_dir={tmp}"],
                     "chat.jsonl: 1200 'messages' record(s), the first at line 1, need a tokenizer"),
}
RAISES = "{{ raise_exception('this template takes no system message') }}"


@pytest.mark.parametrize("case", sorted(STARTUP_INPUTS))
def test_15_9_each_bad_file_is_one_line_naming_it_before_the_model_loads(case, tmp_path):
    make_args, message = STARTUP_INPUTS[case]
    result = run_train(*SMALL, "--max_steps=2", f"--output_dir={tmp_path / 'out'}", *make_args(tmp_path))
    assert message in error_line(result)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
    assert not (tmp_path / "out").exists(), "nothing is left behind"


# Issue 15, 10 and 11: start-up and messages.

def test_15_10_a_run_that_fails_at_start_up_leaves_nothing_that_blocks_the_rerun(tmp_path):
    broken = copy_model(tmp_path, tensors=lambda t: t.pop("model.norm.weight"))
    out = tmp_path / "out"
    failed = run_train(*SMALL, "--max_steps=1", f"--model_dir={broken}", f"--output_dir={out}")
    assert "missing tensor model.norm.weight" in error_line(failed)
    assert not out.exists() or os.listdir(out) == []
    out.mkdir(exist_ok=True)
    (out / "metrics.jsonl").write_text("")  # what an earlier version left at start-up
    rerun = run_train(*SMALL, "--max_steps=1", f"--output_dir={out}")
    assert rerun.returncode == 0, rerun.stderr[-3000:]


def test_15_10_a_model_config_lora_run_that_fails_before_its_first_step_blocks_no_rerun(tmp_path):
    """A --model_config LoRA run writes base_model/ (the adapter's base) at start-up: a run refused
    for its flags writes nothing, and a base_model/ with no step after it (a start-up that was
    interrupted) is no earlier run."""
    import shutil

    from_config = [a for a in SMALL if not a.startswith("--model_dir=")] + [f"--model_config={BASE}/config.json"]
    out = tmp_path / "out"
    failed = run_train(*from_config, "--warmup_steps=100000", f"--output_dir={out}")
    assert "--warmup_steps=100000 is more than the" in error_line(failed)
    assert not out.exists(), os.listdir(out)
    out.mkdir()
    shutil.copytree(BASE, out / "base_model")  # what a start-up stopped after writing it leaves
    rerun = run_train(*from_config, "--max_steps=1", f"--output_dir={out}")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (out / "checkpoint-1").is_dir()


def test_15_10_the_metrics_file_is_written_by_the_first_row_not_at_start(tmp_path):
    from v4train.metrics import MetricsLog

    log = MetricsLog(str(tmp_path), 0)
    assert os.listdir(tmp_path) == [], "a run that fails before its first step must leave no metrics.jsonl"
    log.write({"step": 1, "loss": 1.0})
    assert os.listdir(tmp_path) == ["metrics.jsonl"]


def test_15_10_a_plot_that_cannot_be_written_does_not_fail_the_run(tmp_path):
    out = tmp_path / "out"
    assert run_train(*SMALL, "--max_steps=2", "--save_interval=1", f"--output_dir={out}",
                     "--stop_at_step=1").returncode == 0
    os.remove(out / "loss.png")
    (out / "loss.png").mkdir()  # the write fails as on a full disk: an OSError
    result = run_train(*SMALL, "--max_steps=2", "--save_interval=1", f"--output_dir={out}", "--resume_from=latest")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"could not write {out}/loss.png" in result.stderr and "Traceback" not in result.stderr


def test_15_10_full_fine_tuning_from_a_lora_flagfile(tmp_path):
    """--finetune=full after --flagfile=glm5.flags wins over the flagfile's --lora_* flags."""
    result = run_cli("train.py", "--flagfile=glm5.flags", "--finetune=full", "--max_steps=6", "--noself_check",
                     f"--output_dir={tmp_path / 'out'}", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.exists(tmp_path / "out" / "checkpoint-6" / "model.safetensors")


def test_15_10_an_interrupt_during_start_up_is_one_line(tmp_path):
    import signal
    import time

    from golden_cases import start_cli

    proc = start_cli("train.py", *SMALL, "--max_steps=1", f"--output_dir={tmp_path / 'out'}")
    time.sleep(0.5)  # inside its imports
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, stderr[-2000:]
    assert "Traceback" not in stderr and "interrupted before the run started" in stderr


@pytest.mark.parametrize("args,message", [(["--lr=-1"], "flag --lr=-1: -1.0 is not a non-negative number"), (["--nonsense=1"], "nonsense")])
def test_15_11_flags_absl_refuses_exit_2(args, message, tmp_path):
    result = run_cli("train.py", *args, cwd=str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]


@pytest.mark.parametrize("script,args,message", [
    ("train.py", ["stray"], "train: unexpected arguments: ['stray']"),
    ("evaluate.py", [f"--data={CHAT}"], "evaluate: --model_dir is required"),
])
def test_15_11_usage_errors_exit_2_in_one_line(script, args, message, tmp_path):
    """absl's app.UsageError (a stray argument, a required flag missing) as every flag error: one
    line, exit 2 (absl prints its usage text and exits 1)."""
    result = run_cli(script, *args, cwd=str(tmp_path))
    assert error_line(result) == message
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]


@pytest.mark.parametrize("to", ["process", "another_thread"])
def test_15_10_an_interrupt_while_evaluating_is_one_line(to, tmp_path):
    """SIGINT inside evaluate's main (here while it waits for its --data, a FIFO): one line and
    128 + SIGINT, no KeyboardInterrupt traceback. CPython acts on a signal at the main thread's next
    step in Python, so a read that does not return delays it: a signal that comes in the instant
    before the main thread blocks in the read (seen once in CI: a hang), or that the kernel hands to
    another of the process's threads (torch's OpenMP workers: the second case sends it to one).
    Blank lines written to the FIFO return each read to Python without ending the file."""
    import ctypes
    import errno
    import signal
    import time

    from golden_cases import start_cli

    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    # (Two OpenMP threads, so that a worker is there to take the signal: Bazel's tests run at one.)
    proc = start_cli("evaluate.py", f"--model_dir={BASE}", f"--data={fifo}", env={"OMP_NUM_THREADS": "2"})
    deadline, writer = time.time() + 300, None
    while writer is None:  # a writer can open the FIFO once evaluate has opened it to read: main is running
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            assert e.errno == errno.ENXIO and time.time() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
    if to == "process":
        proc.send_signal(signal.SIGINT)
    else:
        thread = min(int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid)
        assert ctypes.CDLL(None, use_errno=True).tgkill(proc.pid, thread, signal.SIGINT) == 0, ctypes.get_errno()
    while proc.poll() is None and time.time() < deadline:
        try:
            os.write(writer, b"\n")
        except BrokenPipeError:  # it has just exited
            break
        time.sleep(0.1)
    os.close(writer)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, stderr[-2000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == "evaluate: interrupted before it finished; nothing was written", stderr


@pytest.mark.parametrize("flag", ["data", "eval_data"])
def test_15_11_a_pipe_for_several_processes_is_refused(flag, tmp_path):
    """One process reads a pipe once (README: `--data=<(zcat d.jsonl.gz)`); with --nproc_per_node
    each rank reads --data, so the second would wait on a FIFO no one writes: refused at start-up."""
    fifo = tmp_path / "d.jsonl"
    os.mkfifo(fifo)
    args = [a for a in SMALL if not (flag == "data" and a.startswith("--data="))]
    result = run_train(*args, f"--{flag}={fifo}", "--max_steps=1", "--nproc_per_node=2",
                       f"--output_dir={tmp_path / 'out'}")
    assert error_line(result) == (f"train: --{flag}={fifo} is not a file (a pipe?): one process reads it once, and "
                                  f"each of the 2 processes reads --{flag}; give a file")


def test_15_11_a_missing_shard_is_named_once(tmp_path):
    import shutil

    from golden_cases import ROOT

    model = tmp_path / "model"
    shutil.copytree(os.path.join(ROOT, "qwen3_5_moe_sharded"), model)
    os.remove(model / "model-00003-of-00022.safetensors")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    result = run_cli("evaluate.py", f"--model_dir={model}", f"--data={data}")
    line = error_line(result)
    assert f"{model}/model-00003-of-00022.safetensors (" in line and "tensors) is missing" in line
    assert line.count("is missing") == 1 and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("damage,truncated", [("cut", True), ("header", False)])
def test_15_11_truncation_is_said_only_of_a_truncated_file(tmp_path, damage, truncated):
    def edit(path):
        raw = open(path, "rb").read()
        open(path, "wb").write(raw[: len(raw) // 2] if damage == "cut" else raw[:9] + b"#" + raw[10:])

    model = copy_model(tmp_path)
    edit(os.path.join(model, "model.safetensors"))
    result = run_train(*SMALL, "--max_steps=1", f"--model_dir={model}", f"--output_dir={tmp_path / 'out'}")
    line = error_line(result)
    # A file that is not truncated gets no word of it (not even the old "is it truncated?").
    assert "model.safetensors" in line and ("truncated:" in line if truncated else "truncated" not in line), line


def test_15_9_the_data_is_read_before_the_model_loads(tmp_path):
    """A bad --data is reported even where the model would fail to load: it is read first."""
    broken = copy_model(tmp_path, tensors=lambda t: t.pop("model.norm.weight"))
    result = run_train(*SMALL, "--max_steps=1", f"--model_dir={broken}", f"--output_dir={tmp_path / 'out'}",
                       "--data=" + _data_file(tmp_path, b"{broken"))
    assert "d.jsonl:3: not valid JSON" in error_line(result)


# Flagfiles as users write them: one starting from another, comments after a value.

def test_a_flagfile_can_start_from_another_and_comment_its_lines(tmp_path):
    """my.flags starts from the bundled glm5.flags and overrides it; the comments after values
    are not read into them (absl alone would make a folder named 'out  # mine')."""
    (tmp_path / "my.flags").write_text("--flagfile=glm5.flags   # the bundled run\n// a comment line\n"
                                       "--max_steps=2  # short\n--warmup_steps=0\n--output_dir=out\t# mine\n--eval_interval=0\n")
    result = run_cli("train.py", "--flagfile=my.flags", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["my.flags", "out"]
    assert json.loads(result.stdout.strip().splitlines()[-1])["steps"] == 2


def test_flagfiles_nest_from_their_own_folder_and_bad_lines_name_the_file_and_line(tmp_path, monkeypatch):
    from v4train.cli import Flagfiles

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BUILD_WORKING_DIRECTORY", raising=False)
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "base.flags").write_text("--lr=1e-3\n--max_steps=10\n")
    (tmp_path / "conf" / "run.flags").write_text("# from the base\n--flagfile=base.flags\n--max_steps=3 # override\n")
    (tmp_path / "search").mkdir()
    expanded = Flagfiles(["train", "--seed=1", "--flagfile", "conf/run.flags", "--lr=2e-3"], str(tmp_path / "search"))
    assert expanded.argv == ["train", "--seed=1", "--lr=1e-3", "--max_steps=10", "--max_steps=3", "--lr=2e-3"]
    assert expanded.sources == {"max_steps": "conf/run.flags"}, "a typed --lr after the flagfile is no flagfile's"

    def refused(text, *argv):
        (tmp_path / "bad.flags").write_text(text)
        with pytest.raises(ValueError) as e:
            Flagfiles(["train", *(argv or ["--flagfile=bad.flags"])], str(tmp_path / "search"))
        return str(e.value)

    assert refused("--lr=1\nmax_steps=3\n") == "--flagfile=bad.flags:2: 'max_steps=3' is not a flag (expected " \
        "--name=value, one a line)"
    assert refused("--max_steps=1\n--flagfile=conf/base.flags\n") == "--max_steps given before " \
        "--flagfile=conf/base.flags, which sets it again (the later value wins): put --flagfile=conf/base.flags " \
        "first (bad.flags:2)"
    assert refused("--flagfile=bad.flags\n").startswith("--flagfile=bad.flags (bad.flags:1) includes itself: ")
    assert refused("\n--flagfile=nowhere.flags\n") == f"--flagfile=nowhere.flags: not found in {tmp_path} or " \
        f"{tmp_path / 'search'} (bad.flags:2)"
    assert refused("", "--flagfile") == "the command line: --flagfile needs a file name"
    # One flagfile after another overrides it, as a typed flag after one does (a review found it refused).
    (tmp_path / "conf" / "over.flags").write_text("--max_steps=7\n-lr=5e-3\n--output_dir=runs/exp \\#2  # kept\n")
    after = Flagfiles(["train", "--flagfile=conf/run.flags", "-flagfile=conf/over.flags"], str(tmp_path / "search"))
    assert after.argv[-3:] == ["--max_steps=7", "-lr=5e-3", "--output_dir=runs/exp #2"]
    assert after.sources["lr"] == "conf/over.flags"
    assert refused("-max_steps=1\n--flagfile=conf/base.flags\n").startswith("--max_steps given before")
