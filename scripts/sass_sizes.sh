#!/usr/bin/env bash
# SASS size of every kernel in the CUDA objects of a build (KB, largest first), and with FUNC=substring
# the disassembly of the kernels whose mangled name contains it: how the fragments' rounding loop
# (mma_q4.cuh bf16_part, docs/roofline-cuda.md "Twenty-fourth session") was found. Runs here, no GPU.
# cuobjdump and nvdisasm are not in this machine's CUDA toolkit: they come from PyPI
# (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm), installed on first use.
#   scripts/sass_sizes.sh [BUILD_DIR]          # default build-cuda (scripts/prepare_devcarry.sh)
#   FUNC=hc_mix_row_kernel scripts/sass_sizes.sh > /tmp/mix.sass
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-build-cuda}
bindir() { python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'bin'))" 2>/dev/null; }
if [ ! -x "$(bindir)/cuobjdump" ] || [ ! -x "$(bindir)/nvdisasm" ]; then
  python3 -m pip install -q --break-system-packages nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm >&2
fi
export PATH="$(bindir):$PATH"
objs=$(find "$B" -name '*.cu.o' | sort)
[ -n "$objs" ] || { echo "sass_sizes: no CUDA objects under $B (build it with scripts/prepare_devcarry.sh)" >&2; exit 1; }
if [ -n "${FUNC:-}" ]; then
  for o in $objs; do
    cuobjdump -sass "$o" | awk -v f="$FUNC" '/Function :/ {on = index($0, f) > 0} on'
  done
  exit 0
fi
for o in $objs; do
  cuobjdump -sass "$o" | awk -v o="$(basename "$o" .cu.o)" \
    '/Function :/ {name = $3} /^ +\/\*[0-9a-f]+\*\// {n[name]++} END {for (k in n) printf "%8.2f KB  %-12s %s\n", n[k] * 16 / 1024, o, k}'
done | sort -rn | c++filt
