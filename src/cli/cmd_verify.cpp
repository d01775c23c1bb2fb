// `cherenkov verify STORE`: checks the manifest against config.json and the files, and every
// checksum (expert records, dense tensors, n-gram blocks). Lists every failure; exit 1 if any.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "cli/command.h"
#include "store/store.h"

namespace {

int run_verify(int argc, char** argv) {
  CLI::App app{"Verify every checksum of a store against its manifest."};
  std::string dir;
  int threads = 0;
  app.add_option("store", dir, "store directory (with manifest.json)")->required();
  app.add_option("--threads", threads, "reader threads (default: all)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  auto r = ck::store::verify_store(dir, threads);
  if (!r.ok()) {
    std::fprintf(stderr, "error: %s\n", r.status().message().c_str());
    return 1;
  }
  for (const std::string& f : r->failures) std::fprintf(stderr, "FAIL %s\n", f.c_str());
  std::printf("verify: %s: %s (%llu records, %llu tensors, %llu n-gram blocks, %llu bytes in %.2f s)\n", dir.c_str(),
              r->failures.empty() ? "OK" : (std::to_string(r->failures.size()) + " failure(s)").c_str(),
              static_cast<unsigned long long>(r->records), static_cast<unsigned long long>(r->tensors),
              static_cast<unsigned long long>(r->blocks), static_cast<unsigned long long>(r->bytes), r->seconds);
  return r->failures.empty() ? 0 : 1;
}

ck::cli::Registrar register_verify("verify", "check every checksum of a store", run_verify);

}  // namespace
