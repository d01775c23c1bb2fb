#include "util/log.h"

#include <cstdlib>
#include <cstring>

namespace ck::log {
Level& threshold() {
  static Level level = [] {
    const char* env = std::getenv("CHERENKOV_LOG");
    if (!env) return Level::Info;
    if (!std::strcmp(env, "debug")) return Level::Debug;
    if (!std::strcmp(env, "warn")) return Level::Warn;
    if (!std::strcmp(env, "error")) return Level::Error;
    return Level::Info;
  }();
  return level;
}
}  // namespace ck::log
