// Status and Result<T>: how expected failures travel (STYLE.md "Errors": no exceptions below cli/).
// CHECK is for our own broken invariants: it logs file, line and condition, then aborts.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace ck {

class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status error(std::string msg) { Status s; s.msg_ = std::move(msg); s.failed_ = true; return s; }
  bool ok() const { return !failed_; }
  const std::string& message() const { return msg_; }
  // Prefixes context ("while loading X: ") to an error; a no-op on success.
  Status with_context(const std::string& ctx) const {
    return ok() ? *this : error(ctx + ": " + msg_);
  }

 private:
  std::string msg_;
  bool failed_ = false;
};

template <typename... Args>
Status error(fmt::format_string<Args...> f, Args&&... args) {
  return Status::error(fmt::format(f, std::forward<Args>(args)...));
}

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T v) : value_(std::move(v)) {}
  Result(Status s) : status_(std::move(s)) {
    if (status_.ok()) status_ = Status::error("internal: Result built from an ok Status");
  }
  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace ck

#define CK_CONCAT_(a, b) a##b
#define CK_CONCAT(a, b) CK_CONCAT_(a, b)

// Returns the Status from the enclosing function if it is an error.
#define TRY(expr)                              \
  do {                                         \
    ::ck::Status ck_status_ = (expr);          \
    if (!ck_status_.ok()) return ck_status_;   \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, f())`: unwraps a Result or returns its error.
#define ASSIGN_OR_RETURN(lhs, expr) ASSIGN_OR_RETURN_(CK_CONCAT(ck_result_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_(tmp, lhs, expr)      \
  auto tmp = (expr);                           \
  if (!tmp.ok()) return tmp.status();          \
  lhs = std::move(tmp).value()

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                  \
    }                                                                                \
  } while (0)

#define CHECK_MSG(cond, ...)                                                               \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s: %s\n", __FILE__, __LINE__, #cond,    \
                   fmt::format(__VA_ARGS__).c_str());                                      \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)
