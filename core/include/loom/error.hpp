// Errors: one exception type whose message is meant for the user, and the
// string helper every message is built with.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace loom {

// Everything user-facing (bad config, missing plugin, corrupt file) throws
// loom::Error with a complete message: what, where (file/key/value), what to do.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// cat("a=", 1, " b=", 2.5) -> "a=1 b=2.5". Usable in .cu files (no fmt/spdlog).
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

}  // namespace loom

// LOOM_CHECK(cond, parts...): throw loom::Error naming the condition and location.
#define LOOM_CHECK(cond, ...)                                                        \
  do {                                                                               \
    if (!(cond))                                                                     \
      throw ::loom::Error(::loom::cat(__VA_ARGS__, " [check failed: " #cond " at ",  \
                                      __FILE__, ":", __LINE__, "]"));                \
  } while (0)
