#!/usr/bin/env bash
# A/B runs of bench_cuda on the GPU machine, one per case, in one device call: each case is
# "label:VAR=value,VAR2=value" (environment switches such as CK_ATTN_HEADS or CK_PDL; "label:" for
# none). Unpacks .devcarry/ (scripts/prepare_devcarry.sh) like gpu_check.sh. Writes $OUT/ab.txt: each
# case's figure lines (decode, mtp, prefill, profile). CK_AB_TESTS=1 first runs test_cuda_ops under
# each case (its prefill and expert tests), so every variant measured is also checked.
# CK_BENCH_BIN=bench_cuda_prev in a case runs an older build's benchmark (scripts/prepare_devcarry.sh
# with CK_PREV_BENCH). Decode only: `--no-prefill` in CK_AB_ARGS (builds before 238e6dd lack it:
# give them `--prefill 32`, the smallest; a bare `--prefill` would take this script's `--out` as its sizes).
# CK_AB_CHUNK=N in a case adds `--prefill-chunk N` to its bench_cuda arguments (chunk sizes as cases).
#   CK_AB_CASES="heads: per-head:CK_ATTN_HEADS=0" CK_AB_ARGS="--synth-layers 16 --prefill 2048" \
#     OUT=/tmp/out bash scripts/gpu_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ck_gpu_ab}
mkdir -p "$OUT"
. scripts/devcarry_unpack.sh  # D, LD_LIBRARY_PATH
export CK_CUBLAS=${CK_CUBLAS:-$(ls /usr/local/cuda/lib64/libcublas.so.13* /usr/local/cuda/lib64/libcublas.so* 2>/dev/null | head -1)}
ARGS=${CK_AB_ARGS:---synth-layers 16 --no-kernels --decode-steps 0 --prefill 512,2048}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(tr '\n' ' ' < "$D/COMMIT" 2>/dev/null) (built $(cat "$D/BUILT" 2>/dev/null))"
  echo "bench_cuda $ARGS"
} > "$OUT/ab.txt"
for case in ${CK_AB_CASES:-base:}; do
  label=${case%%:*}
  envs=${case#*:}
  echo "---- $label (${envs:-no switches})" >> "$OUT/ab.txt"
  ( IFS=','; for kv in $envs; do [ -n "$kv" ] && export "$kv"; done; IFS=$' \t\n'
    if [ "${CK_AB_TESTS:-0}" = 1 ]; then
      timeout 150 "$D/test_cuda_ops" --gtest_color=no --gtest_filter='CudaOps.Prefill*:CudaOps.Grouped*' 2>&1 |
        grep -E "PASSED|FAILED|rel_l2" >> "$OUT/ab.txt"
    fi
    timeout "${CK_BENCH_TIMEOUT:-150}" "$D/${CK_BENCH_BIN:-bench_cuda}" $ARGS ${CK_AB_CHUNK:+--prefill-chunk $CK_AB_CHUNK} --out "$OUT/case.txt" > "$OUT/case.log" 2>&1
    rc=$?
    grep -E "^(decode|graph|mtp|prefill|profile|hc_mix|experts)" "$OUT/case.txt" >> "$OUT/ab.txt"
    grep -o "(built .* s, uploaded .* s)" "$OUT/case.log" >> "$OUT/ab.txt"  # the model's build and upload times
    [ $rc = 0 ] || { echo "bench rc=$rc:"; tail -5 "$OUT/case.log"; } >> "$OUT/ab.txt"
  )
done
rm -f "$OUT/case.txt" "$OUT/case.log"
cat "$OUT/ab.txt"
