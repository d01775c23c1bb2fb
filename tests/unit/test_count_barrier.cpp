// The one-row mix's count barrier (src/cuda/count_barrier.h), on the CPU: launches of N blocks on a count
// that atom.inc wraps at a multiple of N (the atomic orders the arrivals, whichever blocks they are),
// from zero and across the 32-bit wrap that a GPU test never reaches. In every launch exactly the last arrival is the last, no waiter is
// released by any count it can read before the last arrival, every waiter is released by the count after
// it, and the next launch finds the count at a multiple of N.
#include <gtest/gtest.h>

#include <vector>

#include "cuda/count_barrier.h"

namespace {

using ck::cuda::count_barrier_base;
using ck::cuda::count_barrier_last;
using ck::cuda::count_barrier_released;
using ck::cuda::count_barrier_wrap;

// PTX atom.inc: old >= bound ? 0 : old + 1.
unsigned atom_inc(unsigned& word, unsigned bound) {
  const unsigned old = word;
  word = old >= bound ? 0 : old + 1;
  return old;
}

// `launches` launches of n blocks on the count, starting at `count`; fails the test on the first fault.
void run_launches(unsigned n, unsigned count, int launches) {
  const unsigned bound = count_barrier_wrap(n);
  ASSERT_EQ((static_cast<unsigned long long>(bound) + 1) % n, 0u) << "the wrap is not a multiple of " << n;
  ASSERT_GT(static_cast<unsigned long long>(bound) + 1 + n, 0xffffffffull) << "a larger multiple of n fits";
  for (int l = 0; l < launches; ++l) {
    ASSERT_EQ(count % n, 0u) << "launch " << l << " of " << n << " blocks began at " << count;
    std::vector<unsigned> bases;  // the waiters' bases, in arrival order
    int lasts = 0;
    for (unsigned i = 0; i < n; ++i) {
      const unsigned old = atom_inc(count, bound);
      const unsigned base = count_barrier_base(old, n);
      if (count_barrier_last(old, n)) {
        ++lasts;
        EXPECT_EQ(i, n - 1) << "arrival " << i << " of " << n << " took itself for the last";
      } else {
        bases.push_back(base);
      }
      // Every count a waiter can read before the last arrival keeps it waiting.
      if (i + 1 < n) {
        for (unsigned b : bases) ASSERT_FALSE(count_barrier_released(count, b, n)) << "released early at " << count;
      }
    }
    EXPECT_EQ(lasts, 1);
    for (unsigned b : bases) ASSERT_TRUE(count_barrier_released(count, b, n)) << "not released at " << count;
  }
}

TEST(CountBarrier, LaunchesFromZero) {
  for (unsigned n : {1u, 2u, 3u, 40u, 80u, 132u}) {
    SCOPED_TRACE(n);
    run_launches(n, 0, 50);
  }
}

TEST(CountBarrier, LaunchesAcrossTheWrap) {
  for (unsigned n : {1u, 2u, 3u, 7u, 40u, 80u, 132u, 1024u}) {
    SCOPED_TRACE(n);
    const unsigned m_minus_1 = count_barrier_wrap(n);
    // Start a few launches before the wrap: the count at a multiple of n below M.
    const unsigned start = m_minus_1 + 1 - 5 * n;
    run_launches(n, start, 10);
  }
}

// A waiter waits at every count inside its launch's window [base, base + n) and leaves at the next one
// (base + n, or 0 where that is M). Launches on one barrier never overlap (each kernel waits for the one
// before), so a waiter reads no later launch's counts.
TEST(CountBarrier, WaitsInsideItsWindowOnly) {
  for (unsigned n : {3u, 80u}) {
    const unsigned m = count_barrier_wrap(n) + 1;
    for (unsigned base : {0u, n, m - n}) {
      for (unsigned i = 0; i < n; ++i) {
        const unsigned v = base + i;  // (base + i < m: base is at most m - n)
        EXPECT_FALSE(count_barrier_released(v, base, n)) << "n " << n << " base " << base << " count " << v;
      }
      EXPECT_TRUE(count_barrier_released(base + n == m ? 0 : base + n, base, n)) << "n " << n << " base " << base;
    }
  }
}

}  // namespace
