#!/usr/bin/env bash
# One full run on a machine with torch and a GPU but no Bazel (the H200 machine): build the op
# modules with tools/build_ext.py, run the parity suite and the bridge tests (CPU and CUDA, fp32
# and bf16), then the op benchmarks. Logs go to ${OUT:-build/gpu_check}.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu_check}
mkdir -p "$out"
export PYTHONPATH=py:build/ext:. PYTHONUNBUFFERED=1
status=0
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c 'import torch, nanobind, hypothesis; print("torch", torch.__version__, "nanobind", nanobind.__version__, "hypothesis", hypothesis.__version__)'; g++ --version | head -1; } 2>&1 | tee "$out/env.txt"
python3 tools/build_ext.py --clean 2>&1 | tee "$out/build.log" || exit 1
python3 -m pytest -p no:cacheprovider -v --hypothesis-show-statistics parity py/tests 2>&1 | tee "$out/parity.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" || status=1
grep -qE "[0-9]+ passed" "$out/parity.log" && ! grep -qE "[0-9]+ (failed|error)" "$out/parity.log" || status=1
python3 tools/benchmark.py 2>&1 | tee "$out/benchmark.log" || status=1
exit $status
