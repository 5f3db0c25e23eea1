"""tools/proxy_run.py's dry run on the CPU (gloo): a small GLM-5 proxy trained by //py:train in one
process and in two with expert parallelism 2, on the same global batch, gives the same per-step
losses, and the report has what issue 20's NCCL run reads from it."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_CONFIG = {"architectures", "model_type", "dtype"}


@pytest.mark.parametrize("model", ["glm5", "qwen3_5"])
def test_the_expert_parallel_run_trains_as_the_one_process_run(model, tmp_path):
    with open(os.path.join(ROOT, "testdata", "sft", f"{model}_config.json")) as f:
        small = {k: v for k, v in json.load(f).items() if k not in NOT_CONFIG}
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "proxy_run.py"), "--model", model, "--gpus", "2",
                           "--tokens", "128", "--steps", "3", "--device", "cpu", "--dtype", "float32",
                           "--override", json.dumps(small), "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    one, two = result["losses"]["1"], result["losses"]["2"]
    assert len(one) == len(two) == 3
    # fp32, the same rows: the losses agree to the whole-model tolerance (compare.py's 1e-5).
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(one, two)), (one, two)
    assert {"tokens_per_s", "speedup", "peak_bytes", "planned_bytes", "peak_over_plan"} <= set(result)
    assert result["planned_bytes"]["2"] < result["planned_bytes"]["1"]  # each process holds half the experts
