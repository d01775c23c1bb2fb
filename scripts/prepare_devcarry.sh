#!/usr/bin/env bash
# Builds the CUDA binaries HERE (sm_90) and fills .devcarry/ for scripts/gpu_check.sh, which runs them on
# the GPU machine (Ubuntu 24.04, glibc 2.39: our glibc-2.36 binaries run there, but our Debian -dev
# libraries are not installed, so their shared libraries travel in .devcarry/lib; libc/libm/ld-linux
# and the driver's libcuda stay behind). .devcarry/ is ignored through .git/info/exclude.
#   scripts/prepare_devcarry.sh            # build dir: build-cuda (BUILD_DIR=... to change)
set -euo pipefail
cd "$(dirname "$0")/.."
B=${BUILD_DIR:-build-cuda}
grep -qx '/.devcarry/' .git/info/exclude 2>/dev/null || echo '/.devcarry/' >> .git/info/exclude

# CMake 3.25 does not know nvcc 13's C++20 flag: tell it (newer CMake ignores these).
cmake -S . -B "$B" -G Ninja -DCHERENKOV_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20 \
  -DCMAKE_EXE_LINKER_FLAGS=-Wl,--as-needed >/dev/null
ninja -C "$B" cherenkov test_cuda_ops test_cuda_model ck_engine

# bench_cuda is not a CMake target (CMake globs src/ and tests/ only): linked here against the libraries.
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
g++ -std=c++20 -O2 -Wall -Wextra -Wno-unused-parameter -fopenmp -DCHERENKOV_HAVE_CUDA=1 -Isrc -I"$CUDA_HOME/include" \
  bench/e2e/bench_cuda.cpp bench/kernels/kernels.cpp -o "$B/bench_cuda" -Wl,--as-needed \
  "$B/libck_engine.a" "$B/libck_cuda.a" "$B/libck_cuda_sm90a.a" "$B/libck_cpu.a" "$B/libck_store.a" "$B/libck_format.a" "$B/libck_util.a" \
  -lfmt -lxxhash -luring -L"$CUDA_HOME/lib64" -lcudart -ldl -lpthread
# The instruction-fetch lab (bench/kernels/icache_lab.cu): CUDA runtime only.
"$CUDA_HOME/bin/nvcc" -O3 -arch=sm_90 -std=c++17 bench/kernels/icache_lab.cu -o "$B/icache_lab"
# The weight-layout lab (bench/kernels/gemv_layout_lab.cu): CUDA runtime only.
"$CUDA_HOME/bin/nvcc" -O3 -arch=sm_90 -std=c++17 -Isrc bench/kernels/gemv_layout_lab.cu -o "$B/gemv_layout_lab"
# The persistent-step lab (bench/kernels/persistent_step_lab.cu): CUDA runtime only, ~1 MB, so it
# travels even with CK_NO_LABS=1.
"$CUDA_HOME/bin/nvcc" -O3 -arch=sm_90 -std=c++17 -Isrc bench/kernels/persistent_step_lab.cu -o "$B/persistent_step_lab"

# Stage, then pack: the working tree that travels with the call is limited to 64 MiB, and ICU's data
# library alone is 30 MB (7 MB compressed). gpu_check.sh unpacks the bundle.
S=.devcarry/stage
rm -rf .devcarry
mkdir -p $S/lib
# CK_NO_LABS=1 leaves the two labs behind: the tree and the carry must stay under 64 MiB, and with an
# older bench_cuda beside the new one (CK_PREV_BENCH) they no longer fit with the labs (2026-12-06).
BINS="cherenkov test_cuda_ops test_cuda_model bench_cuda persistent_step_lab"
[ "${CK_NO_LABS:-0}" = 1 ] || BINS="$BINS icache_lab gemv_layout_lab"
# CK_DEVCARRY_SKIP="a b": binaries left behind (the tree plus the carry must stay under 64 MiB: with
# CK_PREV_BENCH, e.g. CK_DEVCARRY_SKIP="persistent_step_lab test_cuda_model" for an A/B call).
for skip in ${CK_DEVCARRY_SKIP:-}; do BINS=$(echo " $BINS " | sed "s/ $skip / /"); done
for b in $BINS; do
  cp "$B/$b" $S/
  strip --strip-${CK_STRIP:-debug} $S/$b
done
for b in $BINS; do ldd "$B/$b" | awk '/=>/{print $3}'; done | sort -u |
  grep -v -E '/(libc|libm|libdl|libpthread|librt|libcuda)\.so|ld-linux' | while read -r lib; do
  cp -L "$lib" $S/lib/
done
# ICU's data library (30 MB; libicuuc needs its one symbol to load) is replaced by a stub of the same
# name: the working tree plus the carry must stay under 64 MiB, and nothing the GPU check runs reads ICU
# data (only the tokenizer and chat templates do, and they run on the dev machine and in CI).
for f in $S/lib/libicudata.so.*; do
  [ -e "$f" ] || continue
  ver=$(basename "$f" | sed -E 's/libicudata\.so\.([0-9]+).*/\1/')
  echo "const char icudt${ver}_dat[64] = {0};" > /tmp/icudata_stub.c
  gcc -shared -fPIC -o "$f" -Wl,-soname,"$(basename "$f")" /tmp/icudata_stub.c
done
# CK_PREV_BENCH=FILE: an older build's bench_cuda travels too, as bench_cuda_prev, so one call can
# compare two builds (scripts/gpu_ab.sh: a case with CK_BENCH_BIN=bench_cuda_prev).
# CK_PREV_BENCH2=FILE: a third build, as bench_cuda_prev2.
if [ -n "${CK_PREV_BENCH:-}" ]; then
  cp "$CK_PREV_BENCH" $S/bench_cuda_prev
  strip --strip-${CK_STRIP:-debug} $S/bench_cuda_prev
fi
if [ -n "${CK_PREV_BENCH2:-}" ]; then
  cp "$CK_PREV_BENCH2" $S/bench_cuda_prev2
  strip --strip-debug $S/bench_cuda_prev2
fi
git rev-parse HEAD > $S/COMMIT
if git status --porcelain --untracked-files=all -- src/cuda src/engine/session.h src/cli/model_loader.h src/cli/model_loader.cpp src/cli/cmd_generate.cpp tests/parity/test_cuda_ops.cpp tests/parity/test_cuda_model.cpp bench/e2e bench/kernels scripts/gpu_check.sh scripts/prepare_devcarry.sh | grep -q .; then
  echo "(with uncommitted changes)" >> $S/COMMIT
fi
date -u +%Y-%m-%dT%H:%M:%SZ > $S/BUILT
du -sh $S
# One thread and a 128 MiB dictionary: the binaries carry the same CUDA fatbin, and only a window that
# spans them all stores it once (10 MB at -T0 -6, 5.3 MB with -9's 64 MiB). The x86 filter turns the host
# code's relative calls into absolute ones, so two builds of one program share more of their text; names
# sorted, so bench_cuda_prev follows bench_cuda (8.89 MB before both, 8.67 MB after, 2026-12-07).
tar -C $S --sort=name -cf - . | xz -T1 --x86 --lzma2=preset=9,dict=128MiB > .devcarry/bundle.tar.xz
rm -rf $S
ls -la .devcarry
# What a device call will carry: the tracked and untracked files as the disk counts them, plus this
# bundle. Over 64 MiB the call is refused before it starts (2026-12-07: 56.5 MiB of tree and an 8.3 MB
# bundle with every binary were refused); leave out what the call does not run (CK_DEVCARRY_SKIP).
TREE_KB=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
BUNDLE_KB=$(du -k .devcarry/bundle.tar.xz | cut -f1)
echo "carry: tree ${TREE_KB} KiB + bundle ${BUNDLE_KB} KiB = $(( (TREE_KB + BUNDLE_KB) / 1024 )) MiB (the limit: 64 MiB)"
if [ $(( TREE_KB + BUNDLE_KB )) -ge $(( 64 * 1024 )) ]; then
  echo "prepare_devcarry: the tree and the bundle are over 64 MiB: a device call would be refused;" \
    "leave binaries out with CK_DEVCARRY_SKIP (e.g. \"cherenkov persistent_step_lab\")" >&2
  exit 4
fi
