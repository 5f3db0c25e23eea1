"""Issue 15, security and data loss: nothing in a checkpoint or a model directory runs code or
reaches outside it, and nothing outside the run's own files is touched. Each test failed on the
code before its fix."""

import hashlib
import json
import os
import shutil

import pytest
import torch

from golden_cases import (ROOT, RUN, SMALL, Payload, error_line, replace_files, run_cli, run_copy,  # noqa: F401
                          run_train, stopped_run)

CASE = os.path.join(ROOT, "qwen3_5_moe_sharded")


def test_1_a_pickle_in_a_checkpoint_never_runs(run_copy, tmp_path):
    marker = tmp_path / "payload-ran"
    pt = tmp_path / "rng_state.pt"
    torch.save({"torch": torch.get_rng_state(), "python": Payload(str(marker))}, pt)
    checkpoint = run_copy / "checkpoint-2"
    replace_files(checkpoint, ["rng_state.safetensors", "rng_state.json"], {"rng_state.pt": pt.read_bytes()})
    result = run_train(*RUN, f"--output_dir={run_copy}", "--resume_from=latest")
    assert f"{checkpoint}/rng_state.pt: refused: not plain tensors and values" in error_line(result)
    assert not marker.exists(), "the pickle's code ran"


def test_1_an_earlier_checkpoint_of_plain_values_still_resumes(run_copy, tmp_path):
    """Checkpoints written before this change hold rng_state.pt: torch.load(weights_only=True)
    reads its tensors and Python's generator state, and the resumed run finishes."""
    import random

    pt = tmp_path / "rng_state.pt"
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, pt)
    replace_files(run_copy / "checkpoint-2", ["rng_state.safetensors", "rng_state.json"], {"rng_state.pt": pt.read_bytes()})
    result = run_train(*RUN, f"--output_dir={run_copy}", "--resume_from=latest")
    assert result.returncode == 0, result.stderr[-3000:]


def test_1_no_checkpoint_file_is_a_pickle(stopped_run):
    for name in os.listdir(stopped_run / "checkpoint-2"):
        assert not name.endswith((".pt", ".pth", ".bin", ".pkl")), name


@pytest.mark.parametrize("shard", ["../../../../etc/passwd", "/etc/passwd", "sub/../../outside.safetensors"])
def test_2_an_index_naming_a_file_outside_the_model_dir_is_refused(tmp_path, shard):
    model = tmp_path / "model"
    shutil.copytree(CASE, model)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = shard
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3, 4]}) + "\n")
    result = run_cli("evaluate.py", f"--model_dir={model}", f"--data={data}")
    line = error_line(result)
    assert f"{model}/model.safetensors.index.json: names the file {shard!r}, which is not inside {model}" in line


@pytest.mark.parametrize("absolute", [False, True])
def test_2_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(run_copy, tmp_path, absolute):
    """The manifest is read from the folder like a shard index: a listed name that leaves the
    checkpoint is never opened (before, a file named so, with its size and sha256, was read and
    the resume went on)."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"a user's file")
    checkpoint = run_copy / "checkpoint-2"
    name = str(outside) if absolute else "../../outside.bin"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": len(b"a user's file"), "sha256": hashlib.sha256(b"a user's file").hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    result = run_train(*RUN, f"--output_dir={run_copy}", f"--resume_from={checkpoint}")
    line = error_line(result)
    assert f"{checkpoint}/manifest.json: names the file {name!r}, which is not inside {checkpoint}" in line


def test_3_a_lock_that_is_a_link_is_refused_and_its_target_kept(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("a user's file\n")
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").symlink_to(precious)
    result = run_train(*RUN, f"--output_dir={out}")
    assert f"--output_dir={out}: .lock is a symbolic link, not v4train's lock file" in error_line(result)
    assert precious.read_text() == "a user's file\n"


def test_3_a_lock_that_is_a_hard_link_is_refused_and_its_target_kept(tmp_path):
    """A hard link passes for a regular file: its link count tells it from v4train's own lock."""
    precious = tmp_path / "precious.txt"
    precious.write_text("a user's file\n")
    out = tmp_path / "run"
    out.mkdir()
    os.link(precious, out / ".lock")
    result = run_train(*RUN, f"--output_dir={out}")
    assert f"--output_dir={out}: .lock is a file with 2 links (a hard link to another file)" in error_line(result)
    assert precious.read_text() == "a user's file\n"


def test_3_a_loss_png_that_is_a_link_is_replaced_not_written_through(run_copy, tmp_path):
    precious = tmp_path / "precious.png"
    precious.write_bytes(b"a user's picture")
    os.remove(run_copy / "loss.png")
    (run_copy / "loss.png").symlink_to(precious)
    result = run_train(*RUN, f"--output_dir={run_copy}", "--resume_from=latest")
    assert result.returncode == 0, result.stderr[-3000:]
    assert precious.read_bytes() == b"a user's picture"
    assert not (run_copy / "loss.png").is_symlink() and (run_copy / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_3_a_metrics_link_in_a_fresh_folder_is_refused_not_followed(tmp_path):
    """A metrics.jsonl link, dangling, in the output dir of a fresh run: one line (it counts as
    an earlier run's file), and the file it names is never created (it was a traceback)."""
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere.jsonl"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to(elsewhere)
    refused = run_train(*RUN, f"--output_dir={out}")
    assert "holds an earlier run (metrics.jsonl)" in error_line(refused), refused.stderr[-3000:]
    assert not elsewhere.exists() and "Traceback" not in refused.stderr


def test_4_only_v4trains_own_temporary_folders_are_removed(run_copy):
    """A user's folders whose names look like v4train's temporaries (.old-experiments, .tmp-notes,
    even .tmp-notes-12345678 of the exact pattern but without the marker) survive the clean-up
    that removes a killed write's folder."""
    users = [".old-experiments", ".tmp-notes", ".tmp-notes-12345678"]
    for name in users:
        (run_copy / name).mkdir()
        (run_copy / name / "results.txt").write_text(name)
    ours = run_copy / ".tmp-checkpoint-4-abcd1234"
    (ours / "content").mkdir(parents=True)
    (ours / ".v4train-temporary").write_text("")
    result = run_train(*RUN, f"--output_dir={run_copy}", "--resume_from=latest")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not ours.exists()
    for name in users:
        assert (run_copy / name / "results.txt").read_text() == name, f"{name} was touched"


def test_4_a_fresh_run_in_a_folder_of_the_users_refuses_it(tmp_path):
    """A folder holding only the user's files is not v4train's to write into without
    --overwrite_output_dir, and that flag deletes only an earlier run's outputs."""
    out = tmp_path / "run"
    (out / ".tmp-notes").mkdir(parents=True)
    (out / ".tmp-notes" / "n.txt").write_text("keep")
    refused = run_train(*RUN, f"--output_dir={out}")
    assert "holds an earlier run (.tmp-notes)" in error_line(refused)
    kept = run_train(*RUN, f"--output_dir={out}", "--overwrite_output_dir")
    assert kept.returncode == 0, kept.stderr[-3000:]
    assert (out / ".tmp-notes" / "n.txt").read_text() == "keep"

