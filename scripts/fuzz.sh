#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/) with clang and runs each for a bounded time.
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET]
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-30}
ls tests/fuzz/fuzz_*.cpp >/dev/null 2>&1 || { echo "fuzz: no targets"; exit 0; }
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCHERENKOV_FUZZ=ON -DCHERENKOV_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
for src in tests/fuzz/fuzz_*.cpp; do
  name=$(basename "$src" .cpp)
  cmake --build build-fuzz -j"$(nproc)" --target "$name" >/dev/null
  corpus=tests/fuzz/corpus/${name#fuzz_}
  work=$(mktemp -d)
  [ -d "$corpus" ] && cp -r "$corpus"/. "$work"/
  echo "fuzz: $name for ${secs}s"
  ./build-fuzz/"$name" -max_total_time="$secs" -rss_limit_mb=2048 -print_final_stats=0 "$work" 2>&1 | tail -2
  rm -rf "$work"
done
echo "fuzz: ok"
