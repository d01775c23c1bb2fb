#!/usr/bin/env bash
# Nsight Compute on one kernel of bench_cuda, on the GPU machine (the binaries of .devcarry/, unpacked
# by scripts/devcarry_unpack.sh). Warm caches and the GPU's own clocks (--cache-control none
# --clock-control none), so durations are those of a real run; the warp-state and scheduler sections
# say why the kernel stalls. Appends the kernel's SASS.
#   CK_NCU_KERNEL=regex:gemv_q_kernel CK_NCU_SKIP=0 OUT=/tmp/out bash scripts/gpu_ncu.sh
# Env: CK_NCU_KERNEL (ncu -k filter), CK_NCU_SKIP (launches of it to skip), CK_NCU_COUNT (launches to
# profile), CK_NCU_ARGS (bench_cuda arguments), CK_NCU_SASS (a function-name pattern for cuobjdump).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ck_gpu_ncu}
mkdir -p "$OUT"
. scripts/devcarry_unpack.sh  # D, LD_LIBRARY_PATH
CUDA_BIN=${CUDA_BIN:-/usr/local/cuda/bin}
NCU=$(command -v ncu || echo "$CUDA_BIN/ncu")
# CK_NCU_DURATIONS=1: only each kernel's duration, as CSV ($OUT/ncu_durations.csv), for every launch
# in the window (graph nodes one by one): where a decode step's or a prefill's GPU time goes, summed
# per kernel name by scripts/ncu_sum.py.
if [ "${CK_NCU_DURATIONS:-0}" = 1 ]; then
  timeout "${CK_NCU_TIMEOUT:-400}" "$NCU" --cache-control none --clock-control none --metrics gpu__time_duration.sum \
    --csv --print-units base -k "${CK_NCU_KERNEL:-regex:.}" --launch-skip "${CK_NCU_SKIP:-0}" \
    --launch-count "${CK_NCU_COUNT:-1000}" "$D/bench_cuda" ${CK_NCU_ARGS:---synth-layers 16 --no-prefill --decode-rows 1 --decode-steps 0 --no-kernels} \
    > "$OUT/ncu_durations.csv" 2> "$OUT/ncu_durations.log"
  echo "ncu rc=$?" >> "$OUT/ncu_durations.log"
  python3 scripts/ncu_sum.py "$OUT/ncu_durations.csv"
  echo "---- one decode step (between embed_wide_kernel launches), per kernel and grid"
  python3 scripts/ncu_sum.py "$OUT/ncu_durations.csv" --step embed_wide --by-grid --top 40 || true
  exit 0
fi
# CK_NCU_SOURCE=1: warp-state samples every 32 cycles per SASS instruction of the kernel (CK_NCU_CACHE=all:
# L2 flushed before each of its replays, for kernels whose bytes are not in L2 in a real step)
# ($OUT/ncu_source.csv, the source page as CSV): where its warps wait, instruction by instruction;
# the usual sections in $OUT/ncu_source_details.txt. CK_NCU_NAME_BASE=demangled lets CK_NCU_KERNEL
# name template arguments (regex:q4_tile_kernel<1).
if [ "${CK_NCU_SOURCE:-0}" = 1 ]; then
  timeout "${CK_NCU_TIMEOUT:-240}" "$NCU" --cache-control "${CK_NCU_CACHE:-none}" --clock-control none --section SourceCounters \
    --section WarpStateStats --section SpeedOfLight --section Occupancy --section SchedulerStats \
    --section InstructionStats --section MemoryWorkloadAnalysis --warp-sampling-interval 0 \
    --kernel-name-base "${CK_NCU_NAME_BASE:-function}" -k "${CK_NCU_KERNEL:-regex:gemv_q_kernel}" \
    --launch-skip "${CK_NCU_SKIP:-0}" --launch-count 1 -f -o /tmp/ck_ncu_source \
    "$D/bench_cuda" ${CK_NCU_ARGS:---synth-layers 1 --no-prefill --decode-steps 2} > "$OUT/ncu_source.log" 2>&1
  echo "ncu rc=$?" >> "$OUT/ncu_source.log"
  "$NCU" --import /tmp/ck_ncu_source.ncu-rep --page source --print-source sass --csv > "$OUT/ncu_source.csv" 2>> "$OUT/ncu_source.log"
  "$NCU" --import /tmp/ck_ncu_source.ncu-rep > "$OUT/ncu_source_details.txt" 2>&1
  grep -E "Duration|Throughput|Warp Cycles|Issued Ipc|Eligible|Registers|Occupancy" "$OUT/ncu_source_details.txt" | head -30
  exit 0
fi
timeout "${CK_NCU_TIMEOUT:-240}" "$NCU" --cache-control none --clock-control none \
  -k "${CK_NCU_KERNEL:-regex:gemv_q_kernel}" --launch-skip "${CK_NCU_SKIP:-0}" --launch-count "${CK_NCU_COUNT:-1}" \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
  --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section InstructionStats \
  "$D/bench_cuda" ${CK_NCU_ARGS:---synth-layers 1 --no-prefill --decode-steps 2} > "$OUT/ncu.txt" 2>&1
echo "ncu rc=$?" >> "$OUT/ncu.txt"
# The SASS of the functions whose mangled name contains CK_NCU_SASS, appended (one file comes back).
if [ -n "${CK_NCU_SASS:-}" ]; then
  echo "================ SASS (${CK_NCU_SASS})" >> "$OUT/ncu.txt"
  "$CUDA_BIN/cuobjdump" -sass "$D/bench_cuda" 2>&1 | awk -v pat="${CK_NCU_SASS}" '
    /Function :/ { on = index($0, pat) > 0 } on' >> "$OUT/ncu.txt"
fi
grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issued Ipc|No Eligible|Stall|Block Size|Grid Size|Executed Ipc|Warp Cycles Per Issued" "$OUT/ncu.txt" | head -60
