// Test helpers: the oracle fixtures under tests/fixtures/ (tools/make_oracle_fixtures.py writes them)
// and relative-error measures. Header-only so every test binary can include it.
#pragma once
#include <dirent.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "util/file.h"
#include "util/npy.h"

namespace ck::test {

struct Fixture {
  std::string dir;
  std::vector<int32_t> prompt;
  std::vector<float> logits;      // (T, vocab)
  std::vector<int32_t> greedy;    // (N)
  std::vector<float> margins;     // (N)
  std::vector<float> mtp_logits;  // (T-1, vocab) when the fixture has them
};

inline std::string source_dir() { return CK_SOURCE_DIR; }

// Every fixture directory (one holding prompt_ids.npy) under tests/fixtures/<group>/. For the group
// "oracle", CK_ORACLE_FIXTURES=DIR reads DIR instead: fixtures of random geometry that
// tools/sweep_oracle.py writes, so every test over the oracle fixtures runs on those configs too.
inline std::vector<std::string> fixture_dirs(const std::string& group) {
  std::vector<std::string> out;
  std::string root = source_dir() + "/tests/fixtures/" + group;
  if (const char* env = std::getenv("CK_ORACLE_FIXTURES"); group == "oracle" && env && *env) root = env;
  if (DIR* d = opendir(root.c_str())) {
    while (dirent* e = readdir(d)) {
      std::string n = e->d_name;
      if (n[0] == '.') continue;
      std::string p = root + "/" + n;
      if (file_exists(p + "/prompt_ids.npy")) out.push_back(p);
    }
    closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

inline Result<Fixture> load_fixture(const std::string& dir) {
  Fixture f;
  f.dir = dir;
  ASSIGN_OR_RETURN(NpyArray ids, read_npy(dir + "/prompt_ids.npy"));
  for (int64_t v : ids.as_i64()) f.prompt.push_back(static_cast<int32_t>(v));
  ASSIGN_OR_RETURN(NpyArray lg, read_npy(dir + "/logits.npy"));
  f.logits = lg.as_f32();
  ASSIGN_OR_RETURN(NpyArray g, read_npy(dir + "/greedy_ids.npy"));
  for (int64_t v : g.as_i64()) f.greedy.push_back(static_cast<int32_t>(v));
  ASSIGN_OR_RETURN(NpyArray m, read_npy(dir + "/greedy_margins.npy"));
  f.margins = m.as_f32();
  if (file_exists(dir + "/mtp_logits.npy")) {
    ASSIGN_OR_RETURN(NpyArray ml, read_npy(dir + "/mtp_logits.npy"));
    f.mtp_logits = ml.as_f32();
  }
  return f;
}

// Below this margin (top-1 minus top-2 logit) the oracle's own greedy choice is rounding noise.
constexpr float kMarginFloor = 1e-3f;

// The oracle's greedy tokens from a session of either engine (StepResult: its step result type): the
// prompt, then each oracle token in turn; the session's argmax must be the oracle's next token
// wherever the oracle's margin is above kMarginFloor (elsewhere it follows the oracle's token).
template <class StepResult, class Session>
void expect_greedy_tokens(Session& s, const Fixture& fx) {
  StepResult r;
  ASSERT_TRUE(s.step_rows(fx.prompt, false, false, &r).ok());
  s.commit(static_cast<int>(fx.prompt.size()));
  int32_t next = r.argmax.back();
  for (size_t i = 0; i < fx.greedy.size(); ++i) {
    if (fx.margins[i] > kMarginFloor) {
      ASSERT_EQ(next, fx.greedy[i]) << "greedy token " << i << " (oracle margin " << fx.margins[i] << ")";
    }
    int32_t tok[1] = {fx.greedy[i]};
    ASSERT_TRUE(s.step_rows(tok, false, false, &r).ok());
    s.commit(1);
    next = r.argmax[0];
  }
}

// ||a - b|| / ||b|| over n values.
inline double rel_l2(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace ck::test
