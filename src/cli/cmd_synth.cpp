// `cherenkov synth`: a random checkpoint with the released model's geometry (src/store/synth.h), for
// benchmarks and tests. Prints one summary line on stdout (bytes, seconds, GB/s); progress on stderr.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "cli/command.h"
#include "store/synth.h"

namespace {

int run_synth(int argc, char** argv) {
  CLI::App app{"Write a random MLX 4-bit checkpoint with the geometry of a released model."};
  ck::store::SynthOptions o;
  double shard_gb = o.shard_bytes / 1e9;
  bool no_mtp = false, no_sync = false;
  app.add_option("--geometry", o.geometry, "model geometry")->check(CLI::IsMember({"qwen3.8-flash-next"}));
  app.add_option("--out", o.out, "output directory")->required();
  app.add_option("--layers", o.layers, "trunk layers (default: the geometry's, 48); per-layer geometry is kept");
  app.add_option("--seed", o.seed, "random seed (the output is a function of it)");
  app.add_option("--vocab", o.vocab, "vocabulary size (default 248320; a multiple of 64)");
  app.add_option("--experts", o.experts, "routed experts per layer (default 512; top-k = min(10, experts))");
  app.add_option("--ngram-base", o.ngram_base,
                 "n-gram table size base (ngram_vocab_size_base). The real 20000000 means a 320M-row table "
                 "(~32 GB); the default 20000 keeps ~320k rows");
  app.add_option("--shard-gb", shard_gb, "start a new safetensors shard past this many GB");
  app.add_option("--threads", o.threads, "generator threads (default: all)");
  app.add_flag("--no-mtp", no_mtp, "leave out the MTP head");
  app.add_flag("--no-sync", no_sync, "skip fdatasync before renaming the shards into place");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  o.mtp = !no_mtp;
  o.sync = !no_sync;
  o.shard_bytes = static_cast<uint64_t>(shard_gb * 1e9);
  auto r = ck::store::synth_checkpoint(o);
  if (!r.ok()) {
    std::fprintf(stderr, "error: %s\n", r.status().message().c_str());
    return 1;
  }
  std::printf("synth: %llu bytes in %d shard(s), %.2f s, %.2f GB/s (%.2f CPU s, %.2f GB per CPU s)\n",
              static_cast<unsigned long long>(r->bytes), r->shards, r->seconds,
              r->seconds > 0 ? r->bytes / r->seconds / 1e9 : 0.0, r->cpu_seconds,
              r->cpu_seconds > 0 ? r->bytes / r->cpu_seconds / 1e9 : 0.0);
  return 0;
}

ck::cli::Registrar register_synth("synth", "write a random checkpoint with a released model's geometry", run_synth);

}  // namespace
