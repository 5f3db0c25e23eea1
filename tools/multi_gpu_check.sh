#!/usr/bin/env bash
# The NCCL run (issue 20) on a machine of several GPUs with torch but no Bazel, one command: build
# the op modules (tools/build_ext.py); the distributed trainer's tests on NCCL, one GPU a process
# (py/tests/test_distributed_train.py with V4TRAIN_TEST_DEVICE=cuda); then each proxy of
# tools/bench_model.py trained by //py:train on one GPU and on GPUS with expert parallelism GPUS,
# the same global batch, side by side (tools/proxy_run.py: tokens/s and their ratio, the per-step
# losses' largest difference, each layout's peak against py/plan.py); then, on 8 GPUs (or as many as
# GPUS says), GLM-5 whole from its released config (all layers, 256 experts), its base drawn at random
# in FP8 on the GPUs, expert parallel GPUS, LoRA, C++ checkpointing, FULL_STEPS steps (tools/proxy_run.py
# --config: tokens/s per GPU, rank 0's peak against py/plan.py, a step's compute and communication).
# Logs under ${OUT:-build/multi_gpu_check}.
#   GPUS=2 (default: every GPU), MODELS="glm5 qwen3_5", TOKENS=4096 (a GPU's micro-batch), STEPS=8,
#   FULL_CONFIG=testdata/released/GLM-5-FP8/config.json, FULL_STEPS=20, STAGES="build tests proxies full"
#   (default: all; "full" runs only on 8 GPUs or more unless GPUS is given).
# Without GPUs, DEVICE=cpu runs the same script on gloo (the dry run; give OVERRIDE a small config,
# and FULL_OVERRIDE one for the full stage, e.g. py/tests/golden_cases.py's GLM5_FP8_SMALL).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/multi_gpu_check}
stages=${STAGES:-build tests proxies full}
device=${DEVICE:-cuda}
mkdir -p "$out"
export PYTHONPATH=py:py/tests:build/ext:. PYTHONUNBUFFERED=1
gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
status=0
has() { [[ " $stages " == *" $1 "* ]]; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null; nvidia-smi topo -m 2>/dev/null
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)'
} 2>&1 | tee "$out/env.txt"
if has build; then
  python3 tools/build_ext.py --jobs "$(nproc)" 2>&1 | tee "$out/build.log" | tail -1 || exit 1
fi
if has tests; then
  V4TRAIN_TEST_DEVICE=$device python3 -m pytest -p no:cacheprovider -q py/tests/test_distributed_train.py \
    >"$out/tests.log" 2>&1 || status=1
  echo "distributed tests on $device: $(grep -E '[0-9]+ (passed|failed)' "$out/tests.log" | tail -1)"
fi
if has proxies; then
  for model in ${MODELS:-glm5 qwen3_5}; do
    python3 tools/proxy_run.py --model "$model" --gpus "$gpus" --tokens "${TOKENS:-4096}" --steps "${STEPS:-8}" \
      --device "$device" --dtype "${DTYPE:-bfloat16}" --override "${OVERRIDE:-{\}}" --out "$out" \
      >"$out/proxy_$model.log" 2>&1 || status=1
    grep -E '^\|' "$out/proxy_$model.log" || tail -3 "$out/proxy_$model.log"
  done
fi
if has full; then
  if [[ -n "${GPUS:-}" || $gpus -ge 8 ]]; then
    python3 tools/proxy_run.py --config "${FULL_CONFIG:-testdata/released/GLM-5-FP8/config.json}" --gpus "$gpus" \
      --tokens "${TOKENS:-4096}" --steps "${FULL_STEPS:-20}" --device "$device" --dtype "${DTYPE:-bfloat16}" \
      --override "${FULL_OVERRIDE:-{\}}" --out "$out" >"$out/full.log" 2>&1 || status=1
    grep -E '^\|' "$out/full.log" || tail -3 "$out/full.log"
  else
    echo "full: skipped, it needs 8 GPUs (this machine has $gpus; GPUS=N runs it on N)"
  fi
fi
exit $status
