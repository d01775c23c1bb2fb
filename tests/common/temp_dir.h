// Scratch directories for tests: a fresh /tmp/<prefix>XXXXXX that is removed, with everything in it,
// when the test binary exits, so test runs leave nothing behind.
#pragma once
#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace ck::test {

inline std::string temp_dir(const std::string& prefix) {
  static std::vector<std::string> made;  // constructed before the exit hook below, so it outlives it
  static const bool hooked = [] {
    std::atexit([] {
      for (const std::string& d : made) {
        std::error_code ec;
        std::filesystem::remove_all(d, ec);
      }
    });
    return true;
  }();
  (void)hooked;
  std::string tmpl = "/tmp/" + prefix + "XXXXXX";
  if (!mkdtemp(tmpl.data())) return {};
  made.push_back(tmpl);
  return tmpl;
}

}  // namespace ck::test
