#!/usr/bin/env bash
# The CUDA engine on oracle fixtures of random geometry (tools/sweep_oracle.py), on the GPU machine:
# the Hugging Face implementation there writes N fixtures (its CPU, several at once), then
# test_cuda_model runs every oracle test on them (CK_ORACLE_FIXTURES), the CPU reference included
# (CudaOracle.MatchesCpuReference). Assumes .devcarry/ (scripts/prepare_devcarry.sh), like gpu_check.sh.
#   OUT=/tmp/out CK_SWEEP_COUNT=24 bash scripts/gpu_sweep.sh
# Env: CK_SWEEP_COUNT (default 24), CK_SWEEP_SEED (first draw, default 1), CK_SWEEP_JOBS (default: cores - 2),
# CK_SWEEP_DIR (fixtures already made: skips the generation), CK_SWEEP_TIMEOUT (seconds a phase, default 240).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ck_gpu_sweep}
mkdir -p "$OUT"
. scripts/devcarry_unpack.sh  # D (the unpacked binaries), LD_LIBRARY_PATH
T=${CK_SWEEP_TIMEOUT:-240}
DIR=${CK_SWEEP_DIR:-}
if [ -z "$DIR" ]; then
  DIR=$(mktemp -d /tmp/ck-sweep.XXXXXX)
  JOBS=${CK_SWEEP_JOBS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}
  timeout "$T" python3 tools/sweep_oracle.py --out "$DIR" --count "${CK_SWEEP_COUNT:-24}" --seed "${CK_SWEEP_SEED:-1}" --bits 2,3,4,8 \
    --jobs "$JOBS" > "$OUT/sweep_make.log" 2>&1
  echo "sweep_oracle rc=$?" >> "$OUT/sweep_make.log"
  grep -E "^done|rc=" "$OUT/sweep_make.log"
fi
echo "fixtures: $(ls -d "$DIR"/*/ 2>/dev/null | wc -l) in $DIR"
CK_ORACLE_FIXTURES="$DIR" timeout "$T" stdbuf -oL "$D/test_cuda_model" --gtest_color=no --gtest_filter='Oracle/CudaOracle.*' \
  > "$OUT/sweep_tests.log" 2>&1
echo "test_cuda_model rc=$? (CK_ORACLE_FIXTURES=$DIR)" | tee -a "$OUT/sweep_tests.log"
grep -E "^\[  (PASSED|FAILED)|tests ran" "$OUT/sweep_tests.log" | tail -12
