#include "util/parallel.h"

#include <atomic>
#include <thread>
#include <vector>

namespace ck {

Status parallel_for(size_t n, int threads, const std::function<Status(size_t, int)>& fn) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::vector<Status> errors(threads);
  auto worker = [&](int id) {
    for (size_t i; !failed && (i = next.fetch_add(1)) < n;) {
      Status st = fn(i, id);
      if (!st.ok()) { errors[id] = st; failed = true; return; }
    }
  };
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) pool.emplace_back(worker, i);
  for (auto& t : pool) t.join();
  for (auto& e : errors) TRY(e);
  return {};
}

}  // namespace ck
