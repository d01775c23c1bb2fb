// `cherenkov pack SRC [--out DIR] [--experts 4,3,2]`: a checkpoint into a store (src/store/pack.h).
// Prints one summary line on stdout; progress (bytes, rate, ETA) on stderr.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <sstream>
#include <string>

#include "cli/command.h"
#include "store/pack.h"

namespace {

int run_pack(int argc, char** argv) {
  CLI::App app{"Pack a checkpoint into a store: experts.bin (+ experts3/2.bin), dense.bin, ngram.bin, manifest.json."};
  ck::store::PackOptions o;
  std::string experts = "4", method = ck::store::lowbit_method_name(ck::store::kDefaultLowBit);
  bool no_sync = false;
  app.add_option("src", o.src, "checkpoint directory (config.json + safetensors)")->required();
  app.add_option("--out", o.out, "store directory (default: SRC.store)");
  app.add_option("--experts", experts, "expert precisions to write: 4 always, plus 3 and/or 2 (e.g. 4,3,2)");
  app.add_option("--lowbit-method", method, "how 3/2-bit records are derived from Q4: refit or topbits")
      ->check(CLI::IsMember({"refit", "topbits"}));
  app.add_option("--threads", o.threads, "worker threads (default: all)");
  app.add_flag("--force", o.force, "repack even when DIR already holds a valid store of SRC");
  app.add_flag("--no-sync", no_sync, "skip fdatasync before renaming the files into place");
  app.add_option("--fail-after-bytes", o.fail_after_bytes, "testing: fail once this many bytes are written")
      ->group("");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  o.sync = !no_sync;
  ck::store::parse_lowbit_method(method, &o.method);
  std::stringstream ss(experts);
  for (std::string tok; std::getline(ss, tok, ',');) {
    if (tok == "4") continue;
    if (tok == "3" || tok == "2") {
      o.low_bits.push_back(std::stoi(tok));
      continue;
    }
    std::fprintf(stderr, "error: --experts: '%s' is not 4, 3 or 2\n", tok.c_str());
    return 2;
  }
  auto r = ck::store::pack_store(o);
  if (!r.ok()) {
    std::fprintf(stderr, "error: %s\n", r.status().message().c_str());
    return 1;
  }
  if (r->reused) {
    std::printf("pack: %s is up to date (reused)\n", r->out.c_str());
    return 0;
  }
  std::printf("pack: %s: %llu bytes in %.2f s, %.2f GB/s (%.2f CPU s)\n", r->out.c_str(),
              static_cast<unsigned long long>(r->bytes), r->seconds,
              r->seconds > 0 ? r->bytes / r->seconds / 1e9 : 0.0, r->cpu_seconds);
  return 0;
}

ck::cli::Registrar register_pack("pack", "pack a checkpoint into a store (experts.bin, dense.bin, ngram.bin)", run_pack);

}  // namespace
