#!/usr/bin/env bash
# Where a decode step's time goes inside its graph, on the GPU machine, in one call (one row by default;
# CK_HOLLOW_ARGS="... --decode-rows 4 ..." for another row count; sixty-third session): the
# benchmark once per group of kernels launched empty (CK_HOLLOW, src/cuda/common.h), the step's
# time drop being what that group's work costs there (docs/performance.md, fourteenth session).
# Unpacks .devcarry/ (scripts/prepare_devcarry.sh) like gpu_check.sh; writes $OUT/hollow.txt.
#   OUT=/tmp/out bash scripts/gpu_hollow.sh
# The prompt is 8 tokens (the row path): a prefill chunk's kernels are not all hollowable and would
# read the hollowed route's garbage pairs. Groups after "experts" hollow the route and the experts
# too (their pairs would be garbage otherwise): compare them with the "RE" line. The argmax stays,
# so the next token is a real index. Env: CK_HOLLOW_ARGS (bench_cuda arguments), CK_HOLLOW_CASES.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ck_gpu_hollow}
mkdir -p "$OUT"
. scripts/devcarry_unpack.sh  # D, LD_LIBRARY_PATH
ARGS=${CK_HOLLOW_ARGS:---synth-layers 16 --no-kernels --decode-rows 1 --decode-steps 64 --decode-context 8}
RE="moe_,expert_"
ALL="embed,hc_,gemv,tc4_frag,gdn_,attn_,moe_,expert_,ple_,rmsnorm,l2norm,rope,gather"
CASES=${CK_HOLLOW_CASES:-"base: experts:expert_ RE:$RE RE+attn:$RE,attn_ RE+mix:$RE,hc_ RE+gemv:$RE,gemv,tc4_frag RE+gdn:$RE,gdn_ RE+lmhead:$RE,gemv_stream all-but-argmax:$ALL base2:"}
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(tr '\n' ' ' < "$D/COMMIT" 2>/dev/null) (built $(cat "$D/BUILT" 2>/dev/null))"
  echo "bench_cuda $ARGS --no-prefill"
} > "$OUT/hollow.txt"
for case in $CASES; do
  label=${case%%:*}
  h=${case#*:}
  echo "---- $label (CK_HOLLOW=$h)" >> "$OUT/hollow.txt"
  CK_HOLLOW=$h timeout "${CK_BENCH_TIMEOUT:-120}" "$D/bench_cuda" $ARGS --no-prefill --out "$OUT/case.txt" > "$OUT/case.log" 2>&1
  rc=$?
  grep -E "^decode" "$OUT/case.txt" >> "$OUT/hollow.txt"
  [ $rc = 0 ] || { echo "bench rc=$rc:"; grep -v "is hollow" "$OUT/case.log" | tail -3; } >> "$OUT/hollow.txt"
  echo "  hollow: $(grep -c 'is hollow' "$OUT/case.log") kernels" >> "$OUT/hollow.txt"
done
rm -f "$OUT/case.txt" "$OUT/case.log"
cat "$OUT/hollow.txt"
