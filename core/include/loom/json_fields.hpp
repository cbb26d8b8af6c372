// Typed reads of the JSON a checkpoint holds (COMPLETE, meta.json, a rank
// file's header, a data plugin's resume state). Part of the SDK: a data
// plugin reads its state() back with it (plugins/data/common/data_state.hpp),
// with the messages and strictness of the core's own reads. A field edited by hand or damaged — another type, null, a
// negative or out-of-range number — is refused naming the file, the key, the
// value found and what was expected: never nlohmann's type_error (an
// "internal error" naming no file) and never a silent conversion (-1 read as
// 18446744073709551615, 2^40 read into an int as 0).
#pragma once
#include <cstdint>
#include <limits>
#include <string>

// The SDK's one third-party header: libloom's CMake package makes
// nlohmann_json (3.x) a dependency of Loom::loom.
#include <nlohmann/json.hpp>

#include "loom/error.hpp"

namespace loom::ckpt {

class JsonFields {
 public:
  using json = nlohmann::json;
  static constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();

  // `file` names the file in every message (empty: the caller names it, as
  // the core does for a data plugin's state); `tail` ends it (what the
  // refusal means).
  JsonFields(std::string file, std::string tail) : file_(std::move(file)), tail_(std::move(tail)) {}

  // `key` is the field's path for messages: "meta_bytes", "units[1].params[2].offset".
  [[noreturn]] void fail(const std::string& key, const json& found, const std::string& expected) const;
  [[noreturn]] void missing(const std::string& key, const std::string& expected) const;

  // The member `name` of object `obj` (whose path is `at`, "" at the top), or
  // nullptr when it is absent; `full` receives the member's path.
  const json* find(const json& obj, const std::string& at, const std::string& name, std::string& full) const;
  // The same, required: absent is refused, expecting `expected`.
  const json& member(const json& obj, const std::string& at, const std::string& name, std::string& full,
                     const std::string& expected) const;

  int64_t integer(const json& v, const std::string& key, int64_t lo = 0, int64_t hi = kMaxInt) const;
  uint32_t crc32(const json& v, const std::string& key) const;
  // A finite number in [lo, hi] (hi_open: [lo, hi)).
  double number(const json& v, const std::string& key, double lo, double hi, bool hi_open = false) const;
  bool boolean(const json& v, const std::string& key) const;
  std::string string(const json& v, const std::string& key) const;
  const json& array(const json& v, const std::string& key) const;
  const json& object(const json& v, const std::string& key) const;

  // Shorthands for a member of `obj`: required, or with a default when absent.
  int64_t integer_at(const json& obj, const std::string& at, const std::string& name, int64_t lo = 0,
                     int64_t hi = kMaxInt) const;
  std::string string_at(const json& obj, const std::string& at, const std::string& name) const;
  std::string string_or(const json& obj, const std::string& at, const std::string& name, const std::string& def) const;
  const json& array_at(const json& obj, const std::string& at, const std::string& name) const;
  const json& object_at(const json& obj, const std::string& at, const std::string& name) const;

  const std::string& file() const { return file_; }

 private:
  std::string lead() const;  // "file: ", or nothing
  std::string file_;
  std::string tail_;
};

// "[lo, hi]" for messages, with 2^63-1 written as such.
std::string integer_range(int64_t lo, int64_t hi);

}  // namespace loom::ckpt
