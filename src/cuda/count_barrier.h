// The arithmetic of the one-row mix's grid barrier as one wrapping count (hc_mix.cu grid_barrier_count),
// host and device, so the CPU unit test (tests/unit/test_count_barrier.cpp) checks what the kernel runs,
// across the wrap that a GPU test never reaches (~53 M mixes, ~40 minutes of decode at 80 blocks).
//
// Every block of a launch adds one to the count with atom.inc bounded by count_barrier_wrap(N): the
// count runs 0 .. M - 1 and then 0 again, M a multiple of the grid's N blocks, so each launch finds it
// at a multiple of N (it starts zeroed, and every launch on it has N blocks). A block's arrival returns
// old = base + i, i < N; the block with i = N - 1 arrives last, and the others are released once the
// count has left [base, base + N): it reaches base + N, or wraps to 0 where base + N = M.
#pragma once

#if defined(__CUDACC__)
#define CK_COUNT_HD __host__ __device__ __forceinline__
#else
#define CK_COUNT_HD inline
#endif

namespace ck::cuda {

// atom.inc's bound for n blocks: M - 1, M the largest multiple of n that fits 32 bits.
CK_COUNT_HD unsigned count_barrier_wrap(unsigned n) { return (0xffffffffu / n) * n - 1; }
// The count when this launch began, from a block's arrival (atom.inc's old value).
CK_COUNT_HD unsigned count_barrier_base(unsigned old, unsigned n) { return old - old % n; }
// Whether the block whose arrival returned old is its launch's last (it waits for no one).
CK_COUNT_HD bool count_barrier_last(unsigned old, unsigned n) { return old % n == n - 1; }
// Whether the count v, read by a waiter whose launch began at base, says every block has arrived.
CK_COUNT_HD bool count_barrier_released(unsigned v, unsigned base, unsigned n) { return v - base >= n; }

}  // namespace ck::cuda
