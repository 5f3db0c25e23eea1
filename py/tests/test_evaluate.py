"""//py:evaluate: the loss transformers computes, a JSON last line, clear errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

from golden_cases import CASES, golden
from v4train.testing.compare import assert_rel_close

EVALUATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "evaluate.py")


def _run(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, EVALUATE, *args], capture_output=True, text=True, env=env, timeout=300,
                          cwd=cwd)


def _write_rows(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"input_ids": r}) + "\n")


@pytest.mark.parametrize("case", CASES)
def test_loss_equals_transformers_forward(case, tmp_path):
    """--cpp_ops=all (the default): every layer runs in C++; each golden checkpoint (GLM-5 with
    and without YaRN + FP8, Qwen3.5 dense, MoE, sharded and the VL checkpoint's text model)."""
    model_dir, tensors, meta = golden(case)
    data = tmp_path / "data.jsonl"
    _write_rows(data, tensors["input_ids"].tolist())
    result = _run(f"--model_dir={model_dir}", f"--data={data}", "--max_batch_tokens=50")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    rows, seq = tensors["input_ids"].shape
    assert out["tokens"] == rows * (seq - 1)
    assert_rel_close(torch.tensor(out["loss"]), torch.tensor(meta["loss"]), f"{case} evaluate loss")


def test_labels_are_used_as_given(tmp_path):
    model_dir, _, _ = golden("qwen3_5")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}) + "\n")
    out = json.loads(_run(f"--model_dir={model_dir}", f"--data={data}").stdout.splitlines()[-1])
    assert out["tokens"] == 2
    assert "v4_qwen3_5_layer_forward" in out["cpp_ops"] and not [n for n in out["cpp_ops"] if "glm5" in n or "mla" in n], \
        "the model's own ops, not the other family's"


def test_data_from_a_pipe(tmp_path):
    """--data may be a pipe or FIFO (`--data=<(zcat d.jsonl.gz)`), which has no seek: the same
    loss as from the file (it was refused: the check of its first bytes for gzip's sought back)."""
    from golden_cases import fifo_of

    model_dir, _, _ = golden("qwen3_5")
    _write_rows(tmp_path / "d.jsonl", [[1, 2, 3, 4, 5], [6, 7, 8]])
    with fifo_of(tmp_path / "fifo.jsonl", (tmp_path / "d.jsonl").read_bytes()) as fifo:
        piped = _run(f"--model_dir={model_dir}", f"--data={fifo}")
    from_file = _run(f"--model_dir={model_dir}", f"--data={tmp_path / 'd.jsonl'}")
    assert piped.returncode == 0 and from_file.returncode == 0, piped.stderr + from_file.stderr
    piped_out, file_out = (json.loads(r.stdout.splitlines()[-1]) for r in (piped, from_file))
    assert piped_out["tokens"] == 6 and piped_out["loss"] == file_out["loss"]


def test_flags_from_a_flagfile_with_comments(tmp_path):
    """The trainer's flagfiles (cli.Flagfiles): read from the user's folder, comments after values."""
    model_dir, _, _ = golden("qwen3_5")
    (tmp_path / "d.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}) + "\n")
    (tmp_path / "e.flags").write_text(f"--model_dir={model_dir}\n--data=d.jsonl  # two target tokens\n")
    result = _run("--flagfile=e.flags", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["tokens"] == 2


def test_malformed_lines_are_reported_with_file_and_line(tmp_path):
    model_dir, _, _ = golden("qwen3_5")
    data = tmp_path / "bad.jsonl"
    data.write_text('{"input_ids": [1, 2]}\n{oops\n{"input_ids": [1, 99999]}\n{"text": "hi"}\n')
    result = _run(f"--model_dir={model_dir}", f"--data={data}")
    assert result.returncode == 2
    assert f"{data}:2: not valid JSON" in result.stderr
    assert f"{data}:3: input_ids must lie in [0, 160)" in result.stderr
    assert f"{data}: 1 'text' record(s), the first at line 4, need a tokenizer" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_flags_name_the_flag(tmp_path):
    model_dir, _, _ = golden("qwen3_5")
    result = _run(f"--model_dir={model_dir}", "--data=x.jsonl", "--cpp_ops=nope")
    assert result.returncode == 2 and "--cpp_ops: unknown op(s) v4_nope" in result.stderr
    result = _run(f"--model_dir={model_dir}", "--data=x.jsonl", "--dtype=float16")
    assert result.returncode != 0 and "--dtype" in result.stderr
    result = _run(f"--model_dir={model_dir}")
    assert result.returncode != 0 and "--data is required" in result.stderr


def test_an_fp8_checkpoint_stays_fp8_and_gives_the_loss_dequantised_on_load(tmp_path):
    """--fp8=keep (the default): the FP8 golden's projections stay float8 on the device beside
    their scales (fewer bytes), and the C++ ops, dequantising them as they use them, give the very
    loss of the weights dequantised on load (--fp8=dequantize)."""
    model_dir, tensors, _ = golden("glm5_yarn_fp8")
    data = tmp_path / "data.jsonl"
    _write_rows(data, tensors["input_ids"].tolist())
    kept, dense = (json.loads(_run(f"--model_dir={model_dir}", f"--data={data}", f"--fp8={how}").stdout
                              .strip().splitlines()[-1]) for how in ("keep", "dequantize"))
    assert kept["weight_dtypes"].get("float8_e4m3fn", 0) > 0, kept["weight_dtypes"]
    assert "float8_e4m3fn" not in dense["weight_dtypes"], dense["weight_dtypes"]
    assert kept["weight_bytes"] < dense["weight_bytes"]
    assert kept["loss"] == dense["loss"], "the same values through the same products"
