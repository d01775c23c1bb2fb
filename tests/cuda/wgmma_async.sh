#!/usr/bin/env bash
# The warpgroup-MMA kernels (src/cuda/gemm_q4_wg.cu) must keep their wgmmas asynchronous. When ptxas
# cannot (a wgmma on a path that depends on data, an input register defined while wgmmas are in
# flight, too few registers for the pipeline), it does not fail: it serializes every wgmma of the
# kernel and says so in an info line, "(C75xx) Potential Performance Loss". The dense prefill products
# then run ~20-30% slower with the same results, which no other test would notice (docs/roofline-cuda.md,
# thirty-seventh session). This compiles the file for sm_90a with ptxas's report and fails on any
# such line.
#   tests/cuda/wgmma_async.sh NVCC SOURCE_DIR
set -uo pipefail
NVCC=${1:?nvcc}
SRC=${2:?source dir}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
# compile NAME LOG: src/cuda/NAME.cu for sm_90a with ptxas's report in LOG; exits on an nvcc error.
compile() {
  "$NVCC" -DCHERENKOV_HAVE_CUDA=1 -I"$SRC/src" -O3 -DNDEBUG -std=c++17 \
    --generate-code=arch=compute_90a,code=[sm_90a] -Xptxas -v -x cu -c "$SRC/src/cuda/$1.cu" \
    -o "$OUT/$1.o" > "$2" 2>&1
  local rc=$?
  if [ $rc != 0 ]; then
    echo "nvcc failed on $1.cu (rc $rc):"; tail -20 "$2"; exit 1
  fi
}
compile gemm_q4_wg "$OUT/ptxas.log"
kernels=$(grep -c "Compiling entry function.*q4_wg_bulk_kernel" "$OUT/ptxas.log")
if [ "$kernels" -lt 1 ]; then
  echo "no q4_wg_bulk_kernel in ptxas's report: nothing was checked"; exit 1
fi
# One known exception: the fp16 form with four warpgroups a block (q4_wg_bulk_kernel<2, 128, true, 4,
# false, true>) has 128 registers a thread, too few for ptxas's wgmma pipeline (C7512). Serialized
# inside each warpgroup, its four warpgroups still keep the tensor cores as busy as three unserialized
# ones within ~3% a unit, and gemm_q4 takes it only where its fuller waves win (496-row chunks: in_proj,
# out_proj and o_proj 9-12% faster on an H100, docs/performance.md, forty-sixth session). Any other
# C75xx line, or another code on that kernel, still fails.
KNOWN='(C7512).*q4_wg_bulk_kernelILi2ELi128ELb1ELi4ELb0ELb1E'
if grep "(C75[0-9][0-9])" "$OUT/ptxas.log" | grep -v -E "$KNOWN" | grep -q .; then
  echo "ptxas serializes wgmmas in gemm_q4_wg.cu:"
  grep "(C75[0-9][0-9])" "$OUT/ptxas.log" | grep -v -E "$KNOWN"
  exit 1
fi
# The persistent gate-mean kernel (gemm_q4_wg_gate_mean.cu) keeps every warp's A fragments of all of K
# in registers (168 a thread, ptxas's ceiling at 384 threads): it must not be serialized either.
compile gemm_q4_wg_gate_mean "$OUT/ptxas_gm.log"
if ! grep -q "Compiling entry function.*q4_wg_gate_mean_persistent_kernel" "$OUT/ptxas_gm.log"; then
  echo "no q4_wg_gate_mean_persistent_kernel in ptxas's report: nothing was checked"; exit 1
fi
if grep -q "(C75[0-9][0-9])" "$OUT/ptxas_gm.log"; then
  echo "ptxas serializes wgmmas in gemm_q4_wg_gate_mean.cu:"; grep "(C75[0-9][0-9])" "$OUT/ptxas_gm.log"; exit 1
fi
echo "gemm_q4_wg.cu: $kernels bulk-kernel forms, no serialized wgmmas but the known four-warpgroup one;"
echo "gemm_q4_wg_gate_mean.cu: the persistent gate-mean kernel, none serialized"
