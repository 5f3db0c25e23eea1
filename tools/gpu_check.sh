#!/usr/bin/env bash
# One full run on a machine with torch and a GPU but no Bazel (the H200 machine): build the op
# modules with tools/build_ext.py; run the parity suite and the tests that need no pinned
# transformers (CPU and CUDA, fp32 and bf16); the op benchmarks; the out-of-the-box training run
# on CUDA in bf16. Logs go to ${OUT:-build/gpu_check}.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu_check}
mkdir -p "$out"
export PYTHONPATH=py:py/tests:build/ext:. PYTHONUNBUFFERED=1
status=0
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, nanobind, hypothesis; print("torch", torch.__version__, "nanobind", nanobind.__version__, "hypothesis", hypothesis.__version__)'
  g++ --version | head -1; } 2>&1 | tee "$out/env.txt"
python3 tools/build_ext.py --clean 2>&1 | tee "$out/build.log" || exit 1
python3 -m pytest -p no:cacheprovider -v --hypothesis-show-statistics parity py/tests/test_bridge.py \
  py/tests/test_ops_selection.py py/tests/test_goldens.py py/tests/test_packing.py py/tests/test_gated_delta_rule.py \
  py/tests/test_data.py py/tests/test_train_step.py >"$out/parity.log" 2>&1 || status=1
grep -E "passed|failed" "$out/parity.log" | tail -1
python3 tools/benchmark.py 2>&1 | tee "$out/benchmark.log" || status=1
run=$(mktemp -d)
python3 py/train.py --flagfile=glm5.flags --dtype=bfloat16 --device=cuda --output_dir="$run" \
  --log_interval=10 >"$out/train.log" 2>&1 || status=1
cp "$run/metrics.jsonl" "$out/train_metrics.jsonl" 2>/dev/null
cp "$run/loss.png" "$out/train_loss.png" 2>/dev/null
tail -3 "$out/train.log"
exit $status
