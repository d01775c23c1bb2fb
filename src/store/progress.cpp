// Progress reporting for store jobs; see progress.h. One mutex guards printing only: threads add
// bytes with an atomic and skip the report when another thread holds the lock.
#include "store/progress.h"

#include <sys/resource.h>

#include <fmt/format.h>

#include "util/log.h"

namespace ck::store {

std::string format_bytes(uint64_t b) {
  if (b >= 1000000000ull) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1000000ull) return fmt::format("{:.1f} MB", b / 1e6);
  if (b >= 1000ull) return fmt::format("{:.1f} kB", b / 1e3);
  return fmt::format("{} B", b);
}

namespace {
double process_cpu_seconds() {
  rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}
}  // namespace

double Progress::cpu_seconds() const { return process_cpu_seconds() - cpu_start_; }

Progress::Progress(std::string label, uint64_t total_bytes, double interval_s)
    : label_(std::move(label)), total_(total_bytes), interval_s_(interval_s) {
  start_ = last_ = std::chrono::steady_clock::now();
  cpu_start_ = process_cpu_seconds();
}

double Progress::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Progress::add(uint64_t bytes) {
  done_.fetch_add(bytes);
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return;  // another thread is reporting; skipping a line is harmless
  auto now = std::chrono::steady_clock::now();
  if (std::chrono::duration<double>(now - last_).count() < interval_s_) return;
  last_ = now;
  print(false);
}

void Progress::print(bool final) {
  double s = seconds();
  uint64_t d = done_.load();
  double rate = s > 0 ? d / s : 0;
  if (final) {
    double cpu = cpu_seconds();
    LOG_INF("store", "{}: {} in {:.1f} s, {}/s ({:.1f} CPU s, {}/CPU s)", label_, format_bytes(d), s,
            format_bytes(static_cast<uint64_t>(rate)), cpu, format_bytes(static_cast<uint64_t>(cpu > 0 ? d / cpu : 0)));
    return;
  }
  double eta = rate > 0 && total_ > d ? (total_ - d) / rate : 0;
  LOG_INF("store", "{}: {} / {} ({:.0f}%), {}/s, ETA {:.0f} s", label_, format_bytes(d), format_bytes(total_),
          total_ ? 100.0 * d / total_ : 100.0, format_bytes(static_cast<uint64_t>(rate)), eta);
}

double Progress::finish() {
  std::lock_guard<std::mutex> lock(mu_);
  print(true);
  return seconds();
}

}  // namespace ck::store
