// Typed, validating access to one TOML table. The core reads its sections
// through this and each plugin receives its own table as a ConfigTable, so
// every key in every table is validated the same way:
//   - wrong type / out of range / not an accepted choice -> loom::Error naming
//     "file:line: key 'section.key' ..." with the accepted values;
//   - finish() rejects any key nobody read, with a did-you-mean.
// toml++ stays inside libloom (pimpl), so plugins need no toml++ headers.
//
// Copies share the parsed document and the record of which keys were read, so
// a table handed to a plugin and the core's view of it agree. Keys are plain
// (undotted) names of this table; nested tables are reached with table().
#pragma once
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

// The values a float key accepts: finite numbers between min and max, each
// bound closed (>=, <=) or open (>, <); an infinite bound is no bound.
struct FloatRange {
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool min_open = false, max_open = false;
};

class ConfigTable {
 public:
  struct Impl;
  ConfigTable();
  explicit ConfigTable(std::shared_ptr<Impl> impl);
  ~ConfigTable();
  ConfigTable(const ConfigTable&);
  ConfigTable& operator=(const ConfigTable&);

  // Dotted name of this table ("data", "precision"), used in messages.
  std::string name() const;
  // Source file of the config ("configs/quickstart.toml").
  std::string source() const;

  // Whether `key` is present. Probing a key counts as reading it: finish()
  // accepts it and lists it among the accepted keys.
  bool has(std::string_view key) const;
  // Keys present in this table, sorted (does not mark them read).
  std::vector<std::string> keys() const;
  // Keys read or probed in this table so far, by anyone holding a copy of it
  // (the core, the plugin it was handed to), in first-use order: what
  // finish() accepts and lists.
  std::vector<std::string> read_keys() const;
  int64_t get_int(std::string_view key, int64_t def, int64_t min = INT64_MIN, int64_t max = INT64_MAX) const;
  // Floats must be finite and in [min, max]; an infinite bound is no bound.
  // Messages state exactly the bounds given (every finite one), so a value is
  // never refused with a range that admits it.
  double get_float(std::string_view key, double def, double min = -std::numeric_limits<double>::infinity(),
                   double max = std::numeric_limits<double>::infinity()) const;
  // The same with open bounds ("> 0", "in [0, 1)").
  double get_float(std::string_view key, double def, const FloatRange& range) const;
  bool get_bool(std::string_view key, bool def) const;
  std::string get_string(std::string_view key, std::string_view def) const;
  // A string that must be one of `choices`.
  std::string get_choice(std::string_view key, std::string_view def,
                         std::initializer_list<std::string_view> choices) const;
  // The same with choices known at run time (a registry's names).
  std::string get_choice(std::string_view key, std::string_view def, const std::vector<std::string>& choices) const;
  std::vector<std::string> get_string_list(std::string_view key, std::vector<std::string> def = {}) const;
  // Arrays of numbers (integers accepted) and of integers, every element in [min, max].
  std::vector<double> get_float_list(std::string_view key, std::vector<double> def = {}, double min = -1e300,
                                     double max = 1e300) const;
  std::vector<int64_t> get_int_list(std::string_view key, std::vector<int64_t> def = {}, int64_t min = INT64_MIN,
                                    int64_t max = INT64_MAX) const;
  // A key that may hold an integer or a string (e.g. checkpoint.resume = "auto" | 120).
  // Returns the string form; integers are returned in decimal.
  std::string get_int_or_string(std::string_view key, std::string_view def) const;
  // Nested table (an empty one if absent). Keys read through it count as read here.
  ConfigTable table(std::string_view key) const;
  // Mark a key as consumed without reading it (e.g. the `plugin` key of a plugin table).
  void mark_used(std::string_view key) const;
  // Throws for the first key (in file order) that was never read: file:line, the
  // key, a did-you-mean among the keys that were read or probed, and the
  // accepted list. Checks this table's own keys only: a nested table taken
  // with table() is checked by calling finish() on it. On the root table the
  // keys are sections and the message says "unknown section".
  void finish() const;
  // Where `key` was set: "file:line:col", "--set section.key=value" for an
  // override, the table's header when the key is absent, else the file name.
  std::string where(std::string_view key) const;
  // Throw loom::Error("<where(key)>: <message>").
  [[noreturn]] void fail(std::string_view key, std::string_view message) const;
  // This table (overrides applied) as TOML text.
  std::string to_toml() const;

 private:
  std::shared_ptr<Impl> impl_;
};

// Parse TOML text into a root table (name ""), then apply overrides of the form
// "section.key=value" (as given to --set): the value is parsed as a TOML value
// and a bare word that is not one becomes a string. Throws loom::Error for TOML
// syntax errors ("source:line:col: ...") and malformed overrides.
ConfigTable parse_config_table(std::string_view toml_text, const std::string& source_name,
                               const std::vector<std::string>& overrides = {});

// Levenshtein-nearest of `candidates` to `word`, or "" if none is close
// (distance <= max(2, word.size() / 3), ignoring case). Ties go to the earlier candidate.
std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates);

}  // namespace loom
