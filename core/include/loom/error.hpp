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

namespace ckpt {
// A checkpoint that cannot be used as it is on disk (damaged, edited,
// incomplete). Its message names the file and what is wrong and ends with
// "the checkpoint cannot be used"; whoever meets it adds what to do (resume
// from the newest checkpoint that validates, convert another one). A data
// plugin's restore() throws it for a damaged field of its state (a value of
// another type or out of range), so that the core names the checkpoint to
// resume instead; any other refusal is a plain Error.
class CheckpointDamaged : public Error {
 public:
  using Error::Error;
};
}  // namespace ckpt

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
