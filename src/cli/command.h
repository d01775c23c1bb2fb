// Subcommand registry: each src/cli/cmd_<name>.cpp defines one subcommand and registers it with a
// static Registrar, so adding a command touches no other file. main.cpp dispatches on argv[1].
#pragma once
#include <functional>
#include <string>
#include <vector>

namespace ck::cli {

struct Command {
  std::string name;
  std::string summary;                       // one line for `cherenkov --help`
  std::function<int(int argc, char** argv)> run;  // argv[0] is "cherenkov <name>"; returns the exit code
};

std::vector<Command>& commands();

struct Registrar {
  Registrar(std::string name, std::string summary, std::function<int(int, char**)> run) {
    commands().push_back({std::move(name), std::move(summary), std::move(run)});
  }
};

}  // namespace ck::cli
