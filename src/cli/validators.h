// Flag helpers shared by the commands: range checks whose messages read well (CLI11's NonNegativeNumber
// and PositiveNumber print their upper bound, DBL_MAX, in full, a 300-digit number, when they refuse a
// value), and the store flags every command that loads a model takes.
#pragma once
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <string>

#include "cli/model_loader.h"

namespace ck::cli {

// The most tokens a flag may ask to generate (a context longer than any model's).
constexpr int kMaxTokensFlag = 1 << 24;

// A number >= lo, described as such in --help and in the error.
inline CLI::Validator at_least(double lo) {
  return CLI::Validator(
      [lo](std::string& s) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(s, v)) return fmt::format("expected a number, got '{}'", s);
        return v >= lo ? std::string() : fmt::format("must be at least {}, got {}", lo, s);
      },
      fmt::format("NUMBER >= {}", lo));
}

// --experts and --verify-reads: which expert records of a packed store, and how its reads are checked.
inline void add_store_options(CLI::App& app, LoadOptions& opts) {
  app.add_option("--experts", opts.expert_bits, "store only: expert records of 4 (experts.bin), 3 or 2 bits")
      ->check(CLI::IsMember({2, 3, 4}));
  app.add_option("--verify-reads", opts.verify_reads, "store only: checksum expert reads: always, sampled, never")
      ->check(CLI::IsMember({"always", "sampled", "never"}));
}

}  // namespace ck::cli
