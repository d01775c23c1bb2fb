#!/usr/bin/env bash
# Instruction counts of the kernels of one CUDA source, compiled here for sm_90 as the build does, so a
# change can be checked to leave a kernel's default instance alone. Why: the one-row mix lost 3.7% at one
# row to 936 instructions of branches that were off (docs/roofline-cuda.md, fifty-sixth session); its
# instruction fetch is on the step's critical path, so new forms of such kernels are template instances
# and the default's count (and SASS) should not move.
#   scripts/sass_size.sh src/cuda/hc_mix.cu                 # every kernel: instructions, name
#   scripts/sass_size.sh src/cuda/hc_mix.cu 'true, 4>'      # those whose demangled name contains this
#   CK_SASS_DUMP=/tmp/k.sass scripts/sass_size.sh FILE NAME # and the first match's SASS, to diff
# cuobjdump and the nvdisasm it runs are not part of the compile-only toolkit here: they come from PyPI
# (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) into ~/.cache/cherenkov/nvtools the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:?usage: scripts/sass_size.sh FILE.cu [name-filter]}
FILTER=${2:-}
[ -f "$SRC" ] || { echo "sass_size: no such file: $SRC" >&2; exit 2; }
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
CUOBJDUMP=$(command -v cuobjdump || true)
[ -n "$CUOBJDUMP" ] || [ ! -x "$CUDA_HOME/bin/cuobjdump" ] || CUOBJDUMP=$CUDA_HOME/bin/cuobjdump
if [ -z "$CUOBJDUMP" ] || ! command -v nvdisasm >/dev/null && [ ! -x "$(dirname "$CUOBJDUMP")/nvdisasm" ]; then
  T=${XDG_CACHE_HOME:-$HOME/.cache}/cherenkov/nvtools
  if [ -z "$(find "$T"/nvidia -path '*/bin/nvdisasm' 2>/dev/null | head -1)" ]; then
    mkdir -p "$T"
    python3 -m pip download -q --no-deps -d "$T" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm >&2 ||
      { echo "sass_size: cuobjdump is not installed and could not be fetched from PyPI" >&2; exit 3; }
    for w in "$T"/*.whl; do python3 -m zipfile -e "$w" "$T"; done
    chmod +x "$T"/nvidia/cu*/bin/*
  fi
  CUOBJDUMP=$(find "$T"/nvidia -path '*/bin/cuobjdump' | head -1)
fi
PATH=$(dirname "$CUOBJDUMP"):$PATH  # (cuobjdump runs nvdisasm)
export PATH
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$CUDA_HOME/bin/nvcc" -DCHERENKOV_HAVE_CUDA=1 -DFMT_SHARED -Isrc -O3 -DNDEBUG \
  --generate-code=arch=compute_90,code=sm_90 -std=c++20 -cubin "$SRC" -o "$TMP/k.cubin"
"$CUOBJDUMP" -sass "$TMP/k.cubin" > "$TMP/k.sass"
# One count per function: the lines that hold an instruction ("/*0120*/  OPCODE ...").
awk -v out="$TMP/funcs" '
  /Function : / { name = $NF; file = out "." ++n; print name > (out ".names"); next }
  n && /^[ \t]+\/\*[0-9a-f]+\*\/[ \t]/ { print > file }
' "$TMP/k.sass"
[ -f "$TMP/funcs.names" ] || { echo "sass_size: no kernels in $SRC" >&2; exit 4; }
i=0
dumped=0
while read -r mangled; do
  i=$((i + 1))
  name=$(echo "$mangled" | c++filt)
  case "$name" in *"$FILTER"*) ;; *) continue ;; esac
  count=$(wc -l < "$TMP/funcs.$i" 2>/dev/null || echo 0)
  printf '%7d  %s\n' "$count" "$name"
  if [ -n "${CK_SASS_DUMP:-}" ] && [ "$dumped" = 0 ]; then
    # Addresses and encodings dropped, so two builds' dumps diff by instruction.
    sed -E 's#^[ \t]+/\*[0-9a-f]+\*/[ \t]+##; s#[ \t]*/\*.*\*/[ \t]*$##' "$TMP/funcs.$i" > "$CK_SASS_DUMP"
    dumped=1
  fi
done < "$TMP/funcs.names"
