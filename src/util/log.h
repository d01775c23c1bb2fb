// Logging to stderr only (stdout carries generated text and ids). Tagged by subsystem.
#pragma once
#include <cstdio>
#include <fmt/format.h>

namespace ck::log {
enum class Level { Error = 0, Warn = 1, Info = 2, Debug = 3 };
Level& threshold();  // default Info; CHERENKOV_LOG=debug|info|warn|error overrides

template <typename... Args>
void write(Level lvl, const char* tag, fmt::format_string<Args...> f, Args&&... args) {
  if (static_cast<int>(lvl) > static_cast<int>(threshold())) return;
  static const char* names[] = {"ERR", "WRN", "INF", "DBG"};
  std::string line = fmt::format(f, std::forward<Args>(args)...);
  std::fprintf(stderr, "%s %s: %s\n", names[static_cast<int>(lvl)], tag, line.c_str());
}
}  // namespace ck::log

#define LOG_ERR(tag, ...) ::ck::log::write(::ck::log::Level::Error, tag, __VA_ARGS__)
#define LOG_WRN(tag, ...) ::ck::log::write(::ck::log::Level::Warn, tag, __VA_ARGS__)
#define LOG_INF(tag, ...) ::ck::log::write(::ck::log::Level::Info, tag, __VA_ARGS__)
#define LOG_DBG(tag, ...) ::ck::log::write(::ck::log::Level::Debug, tag, __VA_ARGS__)
