// Progress lines on stderr for long store jobs (synth, pack, verify): bytes done of the total, rate
// and ETA, at most one line every `interval_s` seconds, whatever thread adds bytes.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace ck::store {

class Progress {
 public:
  Progress(std::string label, uint64_t total_bytes, double interval_s = 2.0);
  void add(uint64_t bytes);
  // Prints the final line (total bytes, seconds, mean rate); returns the seconds elapsed.
  double finish();
  double seconds() const;
  // Process CPU time (user + system) since construction: on a shared machine, bytes per CPU second
  // says what the code can do when the wall clock says what the neighbours allowed.
  double cpu_seconds() const;
  uint64_t done() const { return done_.load(); }

 private:
  void print(bool final);
  std::string label_;
  uint64_t total_;
  double interval_s_;
  std::atomic<uint64_t> done_{0};
  std::chrono::steady_clock::time_point start_, last_;
  double cpu_start_ = 0;
  std::mutex mu_;
};

// "1.23 GB" (decimal units: disk bandwidth is quoted that way).
std::string format_bytes(uint64_t bytes);

}  // namespace ck::store
