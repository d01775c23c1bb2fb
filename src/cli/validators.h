// Range checks for numeric flags whose messages read well: CLI11's NonNegativeNumber and
// PositiveNumber print their upper bound, DBL_MAX, in full (a 300-digit number) when they refuse a value.
#pragma once
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <string>

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

}  // namespace ck::cli
