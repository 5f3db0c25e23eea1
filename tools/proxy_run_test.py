"""tools/proxy_run.py's dry runs on the CPU (gloo): a small proxy trained by //py:train in one
process and in two with expert parallelism 2, on the same global batch, gives the same per-step
losses; the released GLM-5 config, shrunk, trains on two from a random FP8 base that each rank
drew its part of; the reports have what issue 20's NCCL runs read from them."""

import json
import os
import subprocess
import sys

import pytest

from golden_cases import GLM5_FP8_SMALL, assert_each_rank_drew_its_part

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_CONFIG = {"architectures", "model_type", "dtype"}
ENV = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def proxy_run(*args: str, env: dict = ENV) -> dict:
    """tools/proxy_run.py's JSON result (its run checked to end well)."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "proxy_run.py"), "--device", "cpu", *args],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    print(done.stdout)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["glm5", "qwen3_5"])
def test_the_expert_parallel_run_trains_as_the_one_process_run(model, tmp_path):
    with open(os.path.join(ROOT, "testdata", "sft", f"{model}_config.json")) as f:
        small = {k: v for k, v in json.load(f).items() if k not in NOT_CONFIG}
    result = proxy_run("--model", model, "--gpus", "2", "--tokens", "128", "--steps", "3", "--dtype", "float32",
                       "--override", json.dumps(small), "--out", str(tmp_path))
    one, two = result["losses"]["1"], result["losses"]["2"]
    assert len(one) == len(two) == 3
    # fp32, the same rows: the losses agree to the whole-model tolerance (compare.py's 1e-5).
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(one, two)), (one, two)
    assert {"tokens_per_s", "speedup", "peak_bytes", "planned_bytes", "peak_over_plan"} <= set(result)
    assert result["planned_bytes"]["2"] < result["planned_bytes"]["1"]  # each process holds half the experts


# A sitecustomize for the processes torchrun starts (their PYTHONPATH's first entry): each notes
# the pieces v4train.random_init drew (tensor, rows, the tensor's rows), one JSON line a piece, in
# $V4TRAIN_TEST_PROBES/rank{RANK}.draws.
PROBE = """
import json, os, sys
if os.environ.get("V4TRAIN_TEST_PROBES") and "RANK" in os.environ:
    sys.path.insert(0, os.path.join({root!r}, "py"))
    from v4train import random_init
    draw_rows, out = random_init.draw_rows, os.path.join(os.environ["V4TRAIN_TEST_PROBES"], "rank" + os.environ["RANK"])

    def noted(spec, rows, device, seed):
        with open(out + ".draws", "a") as f:
            f.write(json.dumps([spec.name, list(rows), spec.shape[0]]) + "\\n")
        return draw_rows(spec, rows, device, seed)
    random_init.draw_rows = noted
"""


def test_the_released_glm5_trains_whole_from_a_random_fp8_base_each_rank_drawing_its_part(tmp_path):
    """issue 20's 8-GPU run of GLM-5, dry: the released config shrunk (3 layers, 8 experts, widths of
    128-row blocks), 2 gloo processes at expert parallel 2, the base drawn at random in FP8 on the
    devices, LoRA, C++ checkpointing, bf16: it trains with finite losses, each rank drew only its
    experts and its FSDP2 rows (instrumented), and the report has tokens/s per process, rank 0's
    peak against the planner, and the profiled step's compute and communication."""
    probes = tmp_path / "probes"
    probes.mkdir()
    (probes / "sitecustomize.py").write_text(PROBE.format(root=ROOT))
    env = {**ENV, "V4TRAIN_TEST_PROBES": str(probes),
           "PYTHONPATH": os.pathsep.join([str(probes), *sys.path])}
    result = proxy_run("--config", "testdata/released/GLM-5-FP8/config.json", "--gpus", "2", "--tokens", "128",
                       "--steps", "4", "--dtype", "bfloat16", "--override", json.dumps(GLM5_FP8_SMALL),
                       "--out", str(tmp_path), env=env)
    assert result["steps"] == 4 and all(0 < loss < 10 for loss in result["losses"]), result["losses"]
    drawn = [[json.loads(line) for line in (probes / f"rank{r}.draws").read_text().splitlines()] for r in (0, 1)]
    assert_each_rank_drew_its_part([[(n, tuple(rows), total) for n, rows, total in d] for d in drawn],
                                   GLM5_FP8_SMALL["n_routed_experts"], 2)
    assert result["tokens_per_s_per_gpu"] > 0 and result["planned_bytes"] > 0 and result["peak_bytes_rank0"] > 0
    split = result["profile"]
    assert split["compute_s"] > 0 and split["communication_s"] > 0  # gloo's all-gathers, all-to-alls, all-reduces
    # compute, the communication it does not hide and the rest are the step (to rounding)
    assert abs(split["compute_s"] + split["exposed_communication_s"] + split["other_s"] - split["step_s"]) < 1e-3
