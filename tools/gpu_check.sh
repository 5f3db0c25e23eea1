#!/usr/bin/env bash
# One full run on a machine with torch and a GPU but no Bazel (the H200 machine): build the op
# modules with tools/build_ext.py; the parity suite's CUDA cases and the tests that need no
# pinned transformers; the model benchmark side by side with transformers (with per-op times,
# a kernel profile and the FLOP share); the op benchmarks; the out-of-the-box training runs on
# CUDA in bf16. Logs go to ${OUT:-build/gpu_check}; the last lines printed are a summary.
#   STAGES="build parity tests model ops train" (default: all) picks stages;
#   TOKENS=4096,16384,65536 the model benchmark's sequence lengths, MODELS="glm5 qwen3_5" its proxies;
#   BENCH_ARGS="--exact" more arguments of tools/bench_model.py;
#   OPS=v4_a,v4_b the op benchmarks to run (default: all), IMPL=cpp to time the C++ ops alone;
#   PARITY_K="expr" the parity cases, as pytest -k (default: cuda, every CUDA case);
#   the stage "cpu": the CPU suite on this machine's CPU (another kind than CI's), the ops built
#     without CUDA into build/ext_cpu, at OMP_NUM_THREADS=1 and 16 (a bound that holds on one CPU
#     and thread count only fails somebody else; CPU_THREADS="16" picks; CPU_SKIP=test_fuzz leaves
#     files out, e.g. the fuzzer, whose checks are not numeric);
#   SANITIZE_K="expr" with the stage "sanitize": those parity cases under compute-sanitizer's memcheck.
#     (SANITIZE_S seconds at most, default 420)
#   the stage "mutants": tools/mutants.py --cuda, the CUDA kernels' mutations, each to be caught (run it
#     alone: its copies' builds take every core, some 200-400 s, then 10-60 s a mutation on the GPU;
#     MUTANTS=name,name picks some);
#   the stage "compare": another version beside this one (BESIDE, a tarball of its cc py parity tools,
#     made where git is: `git archive BRANCH cc py parity tools > build/gpujob/beside.tar`, carried),
#     both built side by side (ONLY=v4_a,v4_b the modules, default all; BUILD_ARGS more flags), its
#     parity cases (PARITY_K; PARITY_FILES, default parity: the files whose modules ONLY builds),
#     then the op benchmarks (OPS; IMPL, default cpp; OPS_ARGS, e.g. --profile) of both, twice in
#     alternating order (run-to-run noise); logs compare_*.log;
#   the stage "ncu": Nsight Compute of the kernels whose names match NCU_KERNELS (regexes; default the
#     GLM-5 sparse attention's three wgmma kernels), the first NCU_LAUNCHES launches of them (default 3)
#     in one forward+backward of the op benchmark's case (OPS, default v4_mla_dsa_attention; NCU_CASES,
#     default 1: 65,536 tokens), all in one process: the sections and each warp stall reason in ncu.log,
#     each kernel's SASS split at its barriers by tools/ncu_phases.py in ncu_phases.log (the table itself
#     in ncu_sass.csv.gz; the report in NCU_REPORT, default /tmp/v4train_ncu.ncu-rep; NCU_S seconds at
#     most, default 480; NCU_METRICS=a,b more metrics; NCU_IMPL=fla NCU_ARGS=--fla_unchecked the peer's
#     kernels instead (fla-core's and einops' wheels in .whl/ installed where fla is not importable);
#   the stage "fp8": issue 16's measurements under each V4TRAIN_FP8_TENSOR_CORES value of FP8_SWITCHES
#     (default "none experts_forward experts"): the MoE op's FP8 case (--cases 1 --profile), each
#     FP8 proxy of MODELS against its bf16 twin in one process (TOKENS, default 4096), and GLM-5's
#     decoder layer at full width (--full_layer); logs fp8_*.log. The e4m3 kernel's variants come from
#     the environment as the ops read it (e.g. V4TRAIN_FP8_E4M3_VARIANTS=transpose_global,wide).
#   PACK=1: at the end every file under OUT packed into OUT/logs.tar.gz alone (the device tool brings
#     back at most 8 files; an ncu stage alone writes 4).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu_check}
stages=${STAGES:-build parity tests model ops train}
mkdir -p "$out"
export PYTHONPATH=py:py/tests:build/ext:. PYTHONUNBUFFERED=1
# transformers 5.24 as a wheel carried in .whl/, where the machine's own lacks GLM-5 or Qwen3.5-MoE.
if ! python3 -c 'import transformers.models.glm_moe_dsa, transformers.models.qwen3_5_moe' 2>/dev/null && ls .whl/transformers-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/transformers-*.whl &&
    export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
# fla (issue 18's peer, for --impl fla and NCU_IMPL=fla) from its wheels carried in .whl/, on the path of
# the op benchmarks alone (with_fla, ncu's included): transformers takes fla where it can import it, and fla refuses on
# Hopper's Triton 3.4-3.7.0 (issue 640), so the model stage's transformers row would fail (thirtieth
# session). The line above sets PYTHONPATH, so a caller's own install would not be seen.
fla_site=
if ! python3 -c 'import fla' 2>/dev/null && ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_fla \
    .whl/fla_core-*.whl .whl/einops-*.whl && fla_site=/tmp/site_fla
fi
with_fla=(env PYTHONPATH="${fla_site:+$fla_site:}$PYTHONPATH")  # (a prefix, so that ncu runs it too)
status=0
has() { [[ " $stages " == *" $1 "* ]]; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, nanobind, hypothesis, transformers; print("torch", torch.__version__, "nanobind", nanobind.__version__, "hypothesis", hypothesis.__version__, "transformers", transformers.__version__)'
  g++ --version | head -1; nproc; } 2>&1 | tee "$out/env.txt"
if has build; then
  python3 tools/build_ext.py --clean --jobs "$(nproc)" 2>&1 | tee "$out/build.log" | tail -2 || exit 1
fi
if has parity; then
  # The CPU cases run in CI; here the CUDA ones, every op and dtype.
  python3 -m pytest -p no:cacheprovider -q --hypothesis-show-statistics parity -k "${PARITY_K:-cuda}" >"$out/parity.log" 2>&1 || status=1
  echo "parity (CUDA): $(grep -E '[0-9]+ (passed|failed)' "$out/parity.log" | tail -1)"
fi
if has sanitize; then
  # Memory errors (a misaligned or out-of-bounds access) named by kernel, in the case that made them.
  timeout "${SANITIZE_S:-420}" compute-sanitizer --tool memcheck --print-limit 10 --error-exitcode 3 \
    python3 -m pytest -p no:cacheprovider -q -x parity -k "${SANITIZE_K:-cuda}" >"$out/sanitize.log" 2>&1 || status=1
  echo "sanitize: $(grep -E 'ERROR SUMMARY|[0-9]+ (passed|failed)' "$out/sanitize.log" | tail -2 | tr '\n' ' ')"
fi
if has mutants; then
  python3 tools/mutants.py --cuda ${MUTANTS:+--only "$MUTANTS"} >"$out/mutants.log" 2>&1 || status=1
  echo "mutants: $(tail -1 "$out/mutants.log")"
fi
if has compare; then
  beside=build/beside outdir=$(cd "$out" && pwd)
  rm -rf "$beside" && mkdir -p "$beside" && tar -xf "${BESIDE:-build/gpujob/beside.tar}" -C "$beside" || exit 1
  ln -sfn ../../testdata "$beside/testdata"
  half=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
  build() { python3 tools/build_ext.py --jobs "$half" ${ONLY:+--only "$ONLY"} ${BUILD_ARGS:-}; }
  (cd "$beside" && build >"$outdir/compare_build_beside.log" 2>&1) & pid=$!
  build >"$outdir/compare_build.log" 2>&1 || exit 1
  wait $pid || { tail -20 "$outdir/compare_build_beside.log"; exit 1; }
  (cd "$beside" && python3 -m pytest -p no:cacheprovider -q ${PARITY_FILES:-parity} -k "${PARITY_K:-cuda}") \
    >"$out/compare_parity.log" 2>&1 || status=1
  echo "compare: parity beside: $(grep -E '[0-9]+ (passed|failed|errors?)' "$out/compare_parity.log" | tail -1)"
  grep -E '^(FAILED|ERROR)' "$out/compare_parity.log" | cut -c1-300
  : >"$out/compare_ops_this.log"; : >"$out/compare_ops_beside.log"
  for order in ". $beside" "$beside ."; do
    for tree in $order; do
      name=$([ "$tree" = . ] && echo this || echo beside)
      (cd "$tree" && "${with_fla[@]}" python3 tools/benchmark.py --reps 20 --ops "${OPS:-}" --impl "${IMPL:-cpp}" ${OPS_ARGS:-}) \
        >>"$out/compare_ops_$name.log" 2>&1 || status=1
    done
  done
  for name in this beside; do echo "compare: $name"; grep -E '^\|' "$out/compare_ops_$name.log"; done
fi
if has ncu; then
  # One process for all the kernels (one a process paid the start each time); the launches in order.
  kernels=$(echo ${NCU_KERNELS:-sparse_forward_wgmma sparse_backward_wgmma indexer_scores_wgmma} | tr ' ' '|')
  report=${NCU_REPORT:-/tmp/v4train_ncu}
  stalls=$(for r in barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait not_selected selected \
    lg_throttle dispatch_stall membar no_instruction imc_miss drain branch_resolving misc tex_throttle; do
    printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," "$r"; done)
  timeout "${NCU_S:-480}" ncu --clock-control none -k "regex:($kernels)" -c "${NCU_LAUNCHES:-3}" --section SpeedOfLight \
    --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section InstructionStats --metrics "${stalls%,}${NCU_METRICS:+,$NCU_METRICS}" --import-source yes \
    -f -o "$report" "${with_fla[@]}" python3 tools/benchmark.py --ops "${OPS:-v4_mla_dsa_attention}" --impl "${NCU_IMPL:-cpp}" \
    ${NCU_ARGS:-} --cases "${NCU_CASES:-1}" --once >"$out/ncu.log" 2>&1 || status=1
  ncu -i "$report.ncu-rep" >>"$out/ncu.log" 2>&1 || status=1
  ncu -i "$report.ncu-rep" --page source --csv --print-source sass 2>>"$out/ncu.log" | gzip >"$out/ncu_sass.csv.gz"
  python3 tools/ncu_phases.py "$out/ncu_sass.csv.gz" >"$out/ncu_phases.log" 2>&1 || status=1
  echo "ncu:"; grep -E "^  [A-Za-z_].*Context|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued" "$out/ncu.log"
  grep -E "instructions, .* stall samples" "$out/ncu_phases.log"
fi
if has cpu; then
  python3 tools/build_ext.py --no-cuda --out build/ext_cpu --jobs "$(nproc)" >"$out/build_cpu.log" 2>&1 || exit 1
  # One pytest per file, in parallel (all cores at 1 thread each; 4 at a time at 16 threads).
  files="$(ls parity/test_*.py | grep -vE "${CPU_SKIP:-^$}") py/tests/test_goldens.py py/tests/test_layers_cpp.py tools/bench_model_test.py"
  for threads in ${CPU_THREADS:-1 16}; do
    logs=$(mktemp -d)  # (few files come back from $OUT: one log per thread count)
    echo $files | tr ' ' '\n' | xargs -P $(( $(nproc) / threads > 0 ? $(nproc) / threads : 1 )) -I{} sh -c \
      "OMP_NUM_THREADS=$threads PYTHONPATH=py:py/tests:build/ext_cpu:.:/tmp/site python3 -m pytest -p no:cacheprovider -q {} \
       -k 'not cuda' >$logs/\$(basename {} .py).log 2>&1" || status=1
    for f in "$logs"/*.log; do echo "== $(basename "$f")"; cat "$f"; done >"$out/cpu_$threads.log"
    echo "CPU suite, $threads threads: $(grep -hoE '[0-9]+ passed' "$out/cpu_$threads.log" | awk '{s+=$1} END {print s+0}') passed," \
      "$(grep -hoE '[0-9]+ failed' "$out/cpu_$threads.log" | awk '{s+=$1} END {print s+0}') failed"
    grep -h '^FAILED' "$out/cpu_$threads.log" | cut -c1-300
  done
fi
if has tests; then
  python3 -m pytest -p no:cacheprovider -q py/tests/test_bridge.py py/tests/test_ops_selection.py \
    py/tests/test_goldens.py py/tests/test_packing.py py/tests/test_gated_delta_rule.py py/tests/test_data.py \
    py/tests/test_train_step.py py/tests/test_flop_share.py py/tests/test_layers_cpp.py >"$out/tests.log" 2>&1 || status=1
  echo "tests: $(grep -E '[0-9]+ (passed|failed)' "$out/tests.log" | tail -1)"
fi
if has model; then
  for model in ${MODELS:-glm5 qwen3_5}; do
    python3 tools/bench_model.py --model "$model" --profile --tokens "${TOKENS:-4096,16384,65536}" ${BENCH_ARGS:-} \
      --out "$out/bench_$model.json" >"$out/bench_$model.log" 2>&1 || status=1
    echo "$model:"; grep -E '^\|' "$out/bench_$model.log"; grep -E 'loss difference|loss in float64|FLOP share' "$out/bench_$model.log"
  done
fi
if has fp8; then
  switches=${FP8_SWITCHES:-none experts_forward experts}
  : >"$out/fp8_moe.log"; : >"$out/fp8_layer.log"
  for s in $switches; do
    echo "== V4TRAIN_FP8_TENSOR_CORES=$s" >>"$out/fp8_moe.log"
    V4TRAIN_FP8_TENSOR_CORES=$s python3 tools/benchmark.py --reps 20 --ops v4_glm5_moe --impl cpp --cases 1 --profile \
      >>"$out/fp8_moe.log" 2>&1 || status=1
  done
  : >"$out/fp8_proxy.log"
  for model in ${MODELS:-glm5 qwen3_5}; do
    python3 tools/bench_model.py --model "$model" --fp8 --tokens "${TOKENS:-4096}" --fp8_tensor_cores $switches \
      --out "$out/fp8_$model.json" >>"$out/fp8_proxy.log" 2>&1 || status=1
  done
  for s in $switches; do
    echo "== V4TRAIN_FP8_TENSOR_CORES=$s" >>"$out/fp8_layer.log"
    V4TRAIN_FP8_TENSOR_CORES=$s python3 tools/bench_model.py --full_layer --tokens 4096 >>"$out/fp8_layer.log" 2>&1 ||
      status=1
  done
  echo "fp8:"; grep -E '^(==|\|)' "$out/fp8_moe.log"; grep -E '^\||^at |weight bytes' "$out/fp8_proxy.log"
  grep -E '^(==|\|)' "$out/fp8_layer.log"
fi
if has ops; then
  "${with_fla[@]}" python3 tools/benchmark.py --reps 20 --ops "${OPS:-}" --impl "${IMPL:-reference,cpp}" >"$out/benchmark.log" 2>&1 || status=1
  grep -E '^\|' "$out/benchmark.log"
fi
if has train; then
  for model in glm5 qwen3_5; do
    run=$(mktemp -d)
    python3 py/train.py --flagfile=$model.flags --dtype=bfloat16 --device=cuda --output_dir="$run" \
      --log_interval=10 >"$out/train_$model.log" 2>&1 || status=1
    cp "$run/metrics.jsonl" "$out/train_${model}_metrics.jsonl" 2>/dev/null
    echo "train $model: $(tail -1 "$out/train_$model.log" | cut -c1-300)"
  done
fi
if [ -n "${PACK:-}" ]; then  # one file for all the logs (the device tool brings back 8 files at most)
  pack=$(mktemp -d)/logs.tar.gz
  tar -czf "$pack" -C "$out" . && rm -rf "${out:?}"/* && mv "$pack" "$out/logs.tar.gz" || status=1
fi
exit $status
