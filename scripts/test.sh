#!/usr/bin/env bash
# Builds everything (CUDA sources too when nvcc is present) and runs every test with ctest,
# then the parser fuzzers for a bounded time.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure -j"$jobs"
if [ "${CHERENKOV_SKIP_FUZZ:-0}" != 1 ]; then bash scripts/fuzz.sh "${CHERENKOV_FUZZ_SECONDS:-30}"; fi
