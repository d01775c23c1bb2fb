// parallel_for: a fixed set of threads pulls item indices from a shared counter (items differ in cost,
// so a static split would leave threads idle). Used by the packer and the store checker.
#pragma once
#include <cstddef>
#include <functional>

#include "util/status.h"

namespace ck {

// Runs fn(item, thread) for items [0, n) on `threads` threads. After the first error no new item
// starts; that error is returned once every thread has stopped.
Status parallel_for(size_t n, int threads, const std::function<Status(size_t item, int thread)>& fn);

}  // namespace ck
