// Counter-based random numbers for the synthetic checkpoint writer (src/store/synth.cpp): any block
// of any tensor can be generated on its own, from (seed, tensor name, block index), so the output is
// the same whatever the thread count or the order in which blocks are written.
#pragma once
#include <cstdint>
#include <string_view>

namespace ck::store {

// splitmix64's finalizer: a bijective mix of 64 bits, used to derive independent stream seeds.
inline uint64_t mix64(uint64_t v) {
  v += 0x9E3779B97F4A7C15ull;
  v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9ull;
  v = (v ^ (v >> 27)) * 0x94D049BB133111EBull;
  return v ^ (v >> 31);
}

// FNV-1a of a name, mixed with the seed: one independent stream per tensor.
inline uint64_t stream_seed(uint64_t seed, std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
  return mix64(seed ^ mix64(h));
}

// wyrand: one 64x64->128 multiply per output, fast enough that generation outruns the disk.
struct WyRand {
  uint64_t state;
  explicit WyRand(uint64_t s) : state(s) {}
  uint64_t next() {
    state += 0xa0761d6478bd642full;
    __uint128_t t = static_cast<__uint128_t>(state) * (state ^ 0xe7037ed1a0b428dbull);
    return static_cast<uint64_t>(t >> 64) ^ static_cast<uint64_t>(t);
  }
  // Uniform in [0, 1) with 24 bits.
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }
};

// Uniform in [0, 1) from one hashed counter (for per-element values that must be random-access).
inline float hash_uniform(uint64_t stream, uint64_t counter) {
  return static_cast<float>(mix64(stream ^ mix64(counter)) >> 40) * (1.0f / 16777216.0f);
}

}  // namespace ck::store
