// `cherenkov <command> [flags]`: dispatches to the registered subcommands. Any exception that
// escapes a command (a library that throws) becomes one error line and exit code 1, never a crash.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>

#include "cli/command.h"

namespace ck::cli {
std::vector<Command>& commands() {
  static std::vector<Command> list;
  return list;
}
}  // namespace ck::cli

static void usage(FILE* out) {
  auto cmds = ck::cli::commands();
  std::sort(cmds.begin(), cmds.end(), [](auto& a, auto& b) { return a.name < b.name; });
  std::fprintf(out, "cherenkov: mixture-of-experts inference for qwen4_exp\n\nusage: cherenkov <command> [options]\n\ncommands:\n");
  for (auto& c : cmds) std::fprintf(out, "  %-16s %s\n", c.name.c_str(), c.summary.c_str());
  std::fprintf(out, "\n`cherenkov <command> --help` describes a command's options.\n");
}

int main(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  std::string name = argv[1];
  for (auto& c : ck::cli::commands()) {
    if (c.name != name) continue;
    std::string prog = std::string("cherenkov ") + name;
    argv[1] = prog.data();
    try {
      return c.run(argc - 1, argv + 1);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error: %s\n", e.what());
      return 1;
    }
  }
  std::fprintf(stderr, "error: unknown command '%s'\n\n", name.c_str());
  usage(stderr);
  return 2;
}
