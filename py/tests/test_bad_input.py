"""Issue 10, items 4, 8 and 9, end to end through //py:train: bad input (flag values, files,
data lines, configs, weights, LoRA targets) stops the run before any work with one line naming
the flag, file or tensor, never a traceback. Each case failed on the code before the fix. Bad
checkpoint files at resume are in test_reliability.py."""

import gzip
import os

import pytest

from golden_cases import CHAT, SMALL, copy_model, error_line, run_cli, run_train


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
    # 9. Flag values.
    "lr nan": (lambda tmp: ["--lr=nan"], "--lr=nan: expected a finite number"),
    "lr inf": (lambda tmp: ["--lr=inf"], "--lr=inf: expected a finite number"),
    "adam_beta2 1": (lambda tmp: ["--adam_beta2=1"], "--adam_beta2=1.0: expected a value below 1"),
    "adam_eps 0": (lambda tmp: ["--adam_eps=0"], "--adam_eps=0.0: expected a value > 0"),
    "max_grad_norm inf": (lambda tmp: ["--max_grad_norm=inf"], "--max_grad_norm=inf: expected a finite number"),
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
