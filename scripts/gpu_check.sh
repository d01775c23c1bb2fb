#!/usr/bin/env bash
# The CUDA engine's whole check on the GPU machine, in one call: parity tests (ops, then the model on
# the oracle fixtures), `generate --backend cuda --check` on a fixture, then the benchmarks. Assumes
# .devcarry/ from scripts/prepare_devcarry.sh (binaries built on the dev machine + their libraries).
# Logs go under $OUT (at most 8 files); a short table is printed last.
#   OUT=/tmp/out bash scripts/gpu_check.sh
# Env: CK_BENCH_ARGS (default "--synth-layers 16"), CK_HF_BENCH=0 (skip tools/bench_hf.py), CK_SANITIZE=1 (compute-sanitizer memcheck on a
# test subset first), CK_TEST_TIMEOUT / CK_BENCH_TIMEOUT / CK_SANITIZE_TIMEOUT (seconds).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ck_gpu_check}
mkdir -p "$OUT"
. scripts/devcarry_unpack.sh  # D (the unpacked binaries), LD_LIBRARY_PATH
# test_cuda_ops: ~20 s since dot_tolerance runs in parallel (219 s before, over 300 s on a slower host).
TT=${CK_TEST_TIMEOUT:-300}
BT=${CK_BENCH_TIMEOUT:-150}
START=$(date +%s)

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(tr '\n' ' ' < "$D/COMMIT" 2>/dev/null) (built $(cat "$D/BUILT" 2>/dev/null))"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
  uname -r
} > "$OUT/env.txt"
cat "$OUT/env.txt"

if [ "${CK_SANITIZE:-0}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  timeout "${CK_SANITIZE_TIMEOUT:-60}" stdbuf -oL compute-sanitizer --tool memcheck --error-exitcode 9 "$D/test_cuda_ops" \
    --gtest_filter='CudaOps.Gemv*:CudaOps.Expert*:CudaOps.Router*:CudaOps.Topk*:CudaOps.LayerPieces*:CudaOps.Matvec*' \
    > "$OUT/sanitize.log" 2>&1
  echo "sanitize rc=$?" | tee -a "$OUT/sanitize.log" | tail -1
fi

run_test() {  # name, log
  timeout "$TT" stdbuf -oL "$D/$1" --gtest_color=no > "$OUT/$2" 2>&1
  local rc=$?
  echo "$1 rc=$rc" >> "$OUT/$2"
  echo "$rc"
}
RC_OPS=$(run_test test_cuda_ops tests_ops.log)
RC_MODEL=$(run_test test_cuda_model tests_model.log)

FX=$(ls -d tests/fixtures/oracle/*/ 2>/dev/null | head -1)
if [ ! -x "$D/cherenkov" ]; then  # (a bundle made with CK_DEVCARRY_SKIP="cherenkov ...", to fit 64 MiB)
  echo "generate: skipped (the bundle has no cherenkov binary)" > "$OUT/generate.log"
elif [ -n "$FX" ]; then
  IDS=$(python3 -c "import numpy as np,sys; print(','.join(str(int(v)) for v in np.load(sys.argv[1])[:24]))" "$FX/prompt_ids.npy" 2>/dev/null)
  if [ -n "$IDS" ]; then
    # (--prefill-chunk 16: a 16-row tensor-core chunk, then the row path, each step against the CPU.)
    timeout 60 stdbuf -oL "$D/cherenkov" generate --model "$FX" --prompt-ids "$IDS" --max-tokens 8 --backend cuda --check \
      --prefill-chunk 16 \
      > "$OUT/generate.log" 2>&1
    echo "generate rc=$? (fixture $FX)" >> "$OUT/generate.log"
    # A model that does not fit the GPU (CK_DEVICE_MEMORY_GB caps the free memory counted): --backend
    # cuda fails with one error naming the sizes; --backend auto runs it on the CPU with a warning.
    { echo "---- CK_DEVICE_MEMORY_GB=0.001, --backend cuda (expect rc=1 and the sizes)"
      CK_DEVICE_MEMORY_GB=0.001 timeout 60 "$D/cherenkov" generate --model "$FX" --prompt-ids "$IDS" --max-tokens 2 \
        --backend cuda 2>&1 | tail -2
      echo "fit-check cuda rc=${PIPESTATUS[0]}"
      echo "---- CK_DEVICE_MEMORY_GB=0.001, --backend auto (expect rc=0 and the CPU engine)"
      CK_DEVICE_MEMORY_GB=0.001 timeout 120 "$D/cherenkov" generate --model "$FX" --prompt-ids "$IDS" --max-tokens 2 \
        2>&1 | grep -E "using the CPU engine|error" | head -2
      echo "fit-check auto rc=${PIPESTATUS[0]}"
    } >> "$OUT/generate.log" 2>&1
  fi
fi

export CK_CUBLAS=${CK_CUBLAS:-$(ls /usr/local/cuda/lib64/libcublas.so.13* /usr/local/cuda/lib64/libcublas.so* 2>/dev/null | head -1)}
if [ -z "$CK_CUBLAS" ]; then
  CK_CUBLAS=$(python3 -c "import nvidia.cublas as m, os, glob; print((glob.glob(os.path.join(list(m.__path__)[0], 'lib', 'libcublas.so*')) or [''])[0])" 2>/dev/null)
fi
timeout "$BT" stdbuf -oL "$D/bench_cuda" ${CK_BENCH_ARGS:---synth-layers 16} --out "$OUT/bench.txt" > "$OUT/bench.log" 2>&1
RC_BENCH=$?
echo "bench rc=$RC_BENCH (CK_CUBLAS=$CK_CUBLAS)" >> "$OUT/bench.log"

# The peer: Hugging Face transformers on the same geometry (bf16 weights), when torch is installed.
if [ "${CK_HF_BENCH:-1}" = 1 ] && python3 -c "import transformers, torch" 2>/dev/null; then
  timeout "${CK_HF_TIMEOUT:-240}" stdbuf -oL python3 tools/bench_hf.py ${CK_HF_ARGS:---layers 16 --prefill 512,2048} \
    > "$OUT/bench_hf.log" 2>&1
  echo "bench_hf rc=$?" >> "$OUT/bench_hf.log"
fi

# If the default (v2) kernels failed a parity test, check and time the reference schedule (v1) too, so
# the run still says what works; its output goes to the end of bench.log.
if [ "$RC_OPS" != 0 ] || [ "$RC_MODEL" != 0 ]; then
  {
    echo "================ fallback: CK_GEMV=v1 ================"
    CK_GEMV=v1 timeout "$TT" stdbuf -oL "$D/test_cuda_model" --gtest_color=no 2>&1 | grep -E '^\[  (PASSED|FAILED) |worst rel L2'
    CK_GEMV=v1 timeout "$BT" stdbuf -oL "$D/bench_cuda" ${CK_BENCH_ARGS:---synth-layers 16} --no-kernels --prefill 512 2>&1
  } >> "$OUT/bench.log" 2>&1
fi

summ() {  # gtest log -> its summary lines ("[  PASSED  ] 9 tests." ...)
  grep -h -E '^\[ +(PASSED|FAILED|SKIPPED) +\] [0-9]+ test' "$1" 2>/dev/null | tr '\n' ' '
}
{
  echo "================ gpu_check summary ($(( $(date +%s) - START )) s) ================"
  head -2 "$OUT/env.txt"
  echo "test_cuda_ops    rc=$RC_OPS    $(summ "$OUT/tests_ops.log")"
  echo "test_cuda_model  rc=$RC_MODEL    $(summ "$OUT/tests_model.log")"
  grep -h '^\[  FAILED  \] [A-Za-z]' "$OUT/tests_ops.log" "$OUT/tests_model.log" 2>/dev/null | sort -u | head -20
  grep -h 'worst rel L2' "$OUT/tests_model.log" 2>/dev/null | head -12
  [ -f "$OUT/generate.log" ] && grep -h -E '^check:|rc=|^generate: skipped' "$OUT/generate.log" | tail -6
  echo "bench rc=$RC_BENCH"
  cat "$OUT/bench.txt" 2>/dev/null | grep -v '^kernel' 
  grep -h '^kernel' "$OUT/bench.txt" 2>/dev/null | grep -E 'rows 1 |experts' 
  grep -h -E '^hf|rc=' "$OUT/bench_hf.log" 2>/dev/null
} | tee "$OUT/summary.txt"
