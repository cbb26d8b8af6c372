// ConfigTable over toml++. toml++ is header-only here and confined to this
// folder so that neither plugins nor the rest of libloom see its headers.
//
// One parsed document is shared by every ConfigTable cut from it, together with
// the record of which keys were read and which values came from --set, so that
// a plugin's table and the core's view agree on what is "unknown".
#include "loom/config.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <mutex>
#include <regex>
#include <sstream>
#include <tuple>

#include <toml++/toml.h>

#include "format_number.hpp"
#include "loom/error.hpp"

namespace loom {
namespace {

using config_detail::format_number;

const char* type_name(toml::node_type t) {
  switch (t) {
    case toml::node_type::table: return "table";
    case toml::node_type::array: return "array";
    case toml::node_type::string: return "string";
    case toml::node_type::integer: return "integer";
    case toml::node_type::floating_point: return "float";
    case toml::node_type::boolean: return "boolean";
    case toml::node_type::date: return "date";
    case toml::node_type::time: return "time";
    case toml::node_type::date_time: return "date-time";
    default: return "nothing";
  }
}

bool is_bare_key(std::string_view k) {
  if (k.empty()) return false;
  for (char c : k)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  return true;
}

std::string key_text(std::string_view k) {
  if (is_bare_key(k)) return std::string(k);
  std::ostringstream os;
  os << toml::toml_formatter{toml::value<std::string>(std::string(k)), toml::format_flags::none};
  return os.str();
}

// A value as the user would write it in TOML: strings quoted, arrays and
// tables inline. Floats are written shortest-exact ("0.0006", not toml++'s
// "0.00059999999999999995"); with `toml_float` they keep a '.' or exponent so
// that they read back as floats ("500000.0"), otherwise they read as in a
// message ("500000").
std::string value_text(const toml::node& n, bool toml_float) {
  switch (n.type()) {
    case toml::node_type::integer: return std::to_string(n.as_integer()->get());
    case toml::node_type::floating_point: {
      std::string s = format_number(n.as_floating_point()->get());
      if (toml_float && s.find_first_of(".eni") == std::string::npos) s += ".0";
      return s;
    }
    case toml::node_type::boolean: return n.as_boolean()->get() ? "true" : "false";
    case toml::node_type::array: {
      std::string out = "[";
      const toml::array& a = *n.as_array();
      for (size_t i = 0; i < a.size(); ++i) out += cat(i ? ", " : "", value_text(a[i], toml_float));
      return out + "]";
    }
    case toml::node_type::table: {
      std::string out = "{";
      bool first = true;
      for (auto&& [k, v] : *n.as_table()) {
        out += cat(first ? " " : ", ", key_text(k.str()), " = ", value_text(v, toml_float));
        first = false;
      }
      return out + (first ? "}" : " }");
    }
    default: {  // strings, dates and times: toml++ writes them correctly quoted/escaped
      std::ostringstream os;
      n.visit([&](auto&& v) { os << toml::toml_formatter{v, toml::format_flags::none}; });
      return os.str();
    }
  }
}

std::string render(const toml::node& n) { return value_text(n, false); }

bool is_array_of_tables(const toml::node& n) {
  if (!n.is_array() || n.as_array()->empty()) return false;
  for (auto&& e : *n.as_array())
    if (!e.is_table()) return false;
  return true;
}

// Writes `t` as TOML: its plain keys, then each sub-table under its own header.
void emit_table(std::ostream& os, const toml::table& t, const std::string& path) {
  for (auto&& [k, v] : t)
    if (!v.is_table() && !is_array_of_tables(v)) os << key_text(k.str()) << " = " << value_text(v, true) << "\n";
  for (auto&& [k, v] : t) {
    std::string sub = path.empty() ? key_text(k.str()) : cat(path, ".", key_text(k.str()));
    if (v.is_table()) {
      os << "\n[" << sub << "]\n";
      emit_table(os, *v.as_table(), sub);
    } else if (is_array_of_tables(v)) {
      for (auto&& e : *v.as_array()) {
        os << "\n[[" << sub << "]]\n";
        emit_table(os, *e.as_table(), sub);
      }
    }
  }
}

// "integer 5", "string \"768\"", "table".
std::string describe(const toml::node& n) {
  if (n.is_table()) return "table";
  return cat(type_name(n.type()), " ", render(n));
}

std::string join(const std::vector<std::string>& v, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out += sep;
    out += v[i];
  }
  return out;
}

std::string join_path(const std::string& prefix, std::string_view key) {
  return prefix.empty() ? std::string(key) : cat(prefix, ".", key);
}

std::string trim(std::string_view s) {
  size_t b = s.find_first_not_of(" \t");
  if (b == std::string_view::npos) return "";
  size_t e = s.find_last_not_of(" \t");
  return std::string(s.substr(b, e - b + 1));
}


}  // namespace

// State shared by every table cut from one document.
struct ConfigShared {
  toml::table root;
  std::string source;
  // Dotted path -> (order, "--set a.b=v") for values and tables that an
  // override created or replaced; they are located by the override, not by line.
  std::map<std::string, std::pair<size_t, std::string>> overrides;
  // Table path -> keys read or probed there, in first-use order.
  std::map<std::string, std::vector<std::string>> known;
  // Getters are const and may run on plugin threads; the record is guarded.
  std::mutex mu;
};

struct ConfigTable::Impl {
  std::shared_ptr<ConfigShared> shared;
  std::string prefix;              // "" for the root
  const toml::table* tbl = nullptr;  // null when the table is absent (reads give defaults)

  void note(std::string_view key) const {
    std::lock_guard<std::mutex> lock(shared->mu);
    auto& ks = shared->known[prefix];
    if (std::find(ks.begin(), ks.end(), key) == ks.end()) ks.emplace_back(key);
  }
  const toml::node* get(std::string_view key) const {
    note(key);
    return tbl ? tbl->get(key) : nullptr;
  }
  std::string path(std::string_view key) const { return join_path(prefix, key); }

  // The override that set `path` or one of its parents, if any.
  const std::pair<size_t, std::string>* override_of(const std::string& p) const {
    std::string cur = p;
    while (true) {
      auto it = shared->overrides.find(cur);
      if (it != shared->overrides.end()) return &it->second;
      size_t dot = cur.rfind('.');
      if (dot == std::string::npos) return nullptr;
      cur.resize(dot);
    }
  }
  static std::string at(const std::string& source, const toml::source_region& r) {
    if (r.begin.line == 0) return source;
    return cat(source, ":", r.begin.line, ":", r.begin.column);
  }
  std::string table_loc() const {
    if (auto* o = prefix.empty() ? nullptr : override_of(prefix)) return o->second;
    if (tbl) return at(shared->source, tbl->source());
    return shared->source;
  }
  // Location of the value at `key` (for type/range errors).
  std::string value_loc(std::string_view key) const {
    if (auto* o = override_of(path(key))) return o->second;
    if (tbl)
      if (auto* n = tbl->get(key); n && n->source().begin.line) return at(shared->source, n->source());
    return table_loc();
  }
  // Location of the key itself (for unknown-key errors): the key's own column.
  std::string key_loc(const toml::key& k) const {
    if (auto* o = override_of(path(k.str()))) return o->second;
    if (k.source().begin.line) return at(shared->source, k.source());
    return value_loc(k.str());
  }

  [[noreturn]] void type_error(std::string_view key, const toml::node& n, std::string_view want) const {
    throw Error(cat(value_loc(key), ": ", path(key), " must be ", want, ", got ", describe(n)));
  }
};

ConfigTable::ConfigTable() {
  // A default-constructed table is an empty, absent one: reads give defaults.
  auto shared = std::make_shared<ConfigShared>();
  shared->source = "<no config>";
  impl_ = std::make_shared<Impl>(Impl{shared, "", nullptr});
}
ConfigTable::ConfigTable(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
ConfigTable::~ConfigTable() = default;
ConfigTable::ConfigTable(const ConfigTable&) = default;
ConfigTable& ConfigTable::operator=(const ConfigTable&) = default;

std::string ConfigTable::name() const { return impl_->prefix; }
std::string ConfigTable::source() const { return impl_->shared->source; }

bool ConfigTable::has(std::string_view key) const { return impl_->get(key) != nullptr; }

std::vector<std::string> ConfigTable::keys() const {
  std::vector<std::string> out;
  if (impl_->tbl)
    for (auto&& [k, v] : *impl_->tbl) out.emplace_back(k.str());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> ConfigTable::read_keys() const {
  std::lock_guard<std::mutex> lock(impl_->shared->mu);
  const auto it = impl_->shared->known.find(impl_->prefix);
  return it == impl_->shared->known.end() ? std::vector<std::string>{} : it->second;
}

int64_t ConfigTable::get_int(std::string_view key, int64_t def, int64_t min, int64_t max) const {
  const toml::node* n = impl_->get(key);
  if (!n) return def;
  if (!n->is_integer()) impl_->type_error(key, *n, "an integer");
  int64_t v = n->as_integer()->get();
  if (v < min || v > max) {
    std::string range = max == INT64_MAX   ? cat(">= ", min)
                        : min == INT64_MIN ? cat("<= ", max)
                                           : cat("in [", min, ", ", max, "]");
    throw Error(cat(impl_->value_loc(key), ": ", impl_->path(key), " = ", v, " is out of range: must be ", range));
  }
  return v;
}

double ConfigTable::get_float(std::string_view key, double def, double min, double max) const {
  return get_float(key, def, FloatRange{min, max, false, false});
}

double ConfigTable::get_float(std::string_view key, double def, const FloatRange& r) const {
  const toml::node* n = impl_->get(key);
  if (!n) return def;
  double v;
  // Integers are accepted where floats are expected: `lr = 1` means 1.0.
  if (n->is_integer())
    v = static_cast<double>(n->as_integer()->get());
  else if (n->is_floating_point())
    v = n->as_floating_point()->get();
  else
    impl_->type_error(key, *n, "a number");
  const bool above = r.min_open ? v > r.min : v >= r.min;
  const bool below = r.max_open ? v < r.max : v <= r.max;
  // Non-finite values are refused whatever the bounds: TOML can spell inf and nan.
  if (!std::isfinite(v) || !above || !below) {
    const bool has_min = std::isfinite(r.min), has_max = std::isfinite(r.max);
    const std::string lo = format_number(r.min), hi = format_number(r.max);
    std::string range = has_min && has_max ? cat("in ", r.min_open ? "(" : "[", lo, ", ", hi, r.max_open ? ")" : "]")
                        : has_min          ? cat(r.min_open ? "> " : ">= ", lo)
                        : has_max          ? cat(r.max_open ? "< " : "<= ", hi)
                                           : std::string();
    // "inf is out of range: must be >= 0" would read as a contradiction.
    if (!std::isfinite(v) && !(has_min && has_max)) range = range.empty() ? "a finite number" : "a finite number " + range;
    throw Error(cat(impl_->value_loc(key), ": ", impl_->path(key), " = ", render(*n),
                    " is out of range: must be ", range));
  }
  return v;
}

bool ConfigTable::get_bool(std::string_view key, bool def) const {
  const toml::node* n = impl_->get(key);
  if (!n) return def;
  if (!n->is_boolean()) impl_->type_error(key, *n, "a boolean (true or false)");
  return n->as_boolean()->get();
}

std::string ConfigTable::get_string(std::string_view key, std::string_view def) const {
  const toml::node* n = impl_->get(key);
  if (!n) return std::string(def);
  if (!n->is_string()) impl_->type_error(key, *n, "a string");
  return n->as_string()->get();
}

std::string ConfigTable::get_choice(std::string_view key, std::string_view def,
                                    std::initializer_list<std::string_view> choices) const {
  return get_choice(key, def, std::vector<std::string>(choices.begin(), choices.end()));
}

std::string ConfigTable::get_choice(std::string_view key, std::string_view def,
                                    const std::vector<std::string>& names) const {
  if (const toml::node* n = impl_->get(key); n && !n->is_string())
    impl_->type_error(key, *n, cat("one of the strings ", join(names, ", ")));
  std::string v = get_string(key, def);
  if (std::find(names.begin(), names.end(), v) != names.end()) return v;
  std::string hint = did_you_mean(v, names);
  throw Error(cat(impl_->value_loc(key), ": ", impl_->path(key), " = \"", v, "\" is not one of: ", join(names, ", "),
                  hint.empty() ? "" : cat(" (did you mean \"", hint, "\"?)")));
}

std::vector<std::string> ConfigTable::get_string_list(std::string_view key, std::vector<std::string> def) const {
  const toml::node* n = impl_->get(key);
  if (!n) return def;
  if (!n->is_array()) impl_->type_error(key, *n, "an array of strings");
  std::vector<std::string> out;
  const toml::array& arr = *n->as_array();
  for (size_t i = 0; i < arr.size(); ++i) {
    if (!arr[i].is_string())
      throw Error(cat(impl_->value_loc(key), ": ", impl_->path(key), "[", i, "] must be a string, got ",
                      describe(arr[i])));
    out.push_back(arr[i].as_string()->get());
  }
  return out;
}

std::vector<double> ConfigTable::get_float_list(std::string_view key, std::vector<double> def, double min,
                                                double max) const {
  const toml::node* n = impl_->get(key);
  if (!n) return def;
  if (!n->is_array()) impl_->type_error(key, *n, "an array of numbers");
  std::vector<double> out;
  const toml::array& arr = *n->as_array();
  for (size_t i = 0; i < arr.size(); ++i) {
    double v;
    if (arr[i].is_integer()) v = static_cast<double>(arr[i].as_integer()->get());
    else if (arr[i].is_floating_point()) v = arr[i].as_floating_point()->get();
    else
      throw Error(cat(impl_->value_loc(key), ": ", impl_->path(key), "[", i, "] must be a number, got ",
                      describe(arr[i])));
    if (!(v >= min && v <= max))
      throw Error(cat(impl_->value_loc(key), ": ", impl_->path(key), "[", i, "] = ", render(arr[i]),
                      " is out of range: must be in [", format_number(min), ", ", format_number(max), "]"));
    out.push_back(v);
  }
  return out;
}

std::vector<int64_t> ConfigTable::get_int_list(std::string_view key, std::vector<int64_t> def, int64_t min,
                                               int64_t max) const {
  const toml::node* n = impl_->get(key);
  if (!n) return def;
  if (!n->is_array()) impl_->type_error(key, *n, "an array of integers");
  std::vector<int64_t> out;
  const toml::array& arr = *n->as_array();
  for (size_t i = 0; i < arr.size(); ++i) {
    if (!arr[i].is_integer())
      throw Error(cat(impl_->value_loc(key), ": ", impl_->path(key), "[", i, "] must be an integer, got ",
                      describe(arr[i])));
    const int64_t v = arr[i].as_integer()->get();
    if (v < min || v > max)
      throw Error(cat(impl_->value_loc(key), ": ", impl_->path(key), "[", i, "] = ", v,
                      " is out of range: must be in [", min, ", ", max, "]"));
    out.push_back(v);
  }
  return out;
}

std::string ConfigTable::get_int_or_string(std::string_view key, std::string_view def) const {
  const toml::node* n = impl_->get(key);
  if (!n) return std::string(def);
  if (n->is_integer()) return std::to_string(n->as_integer()->get());
  if (n->is_string()) return n->as_string()->get();
  impl_->type_error(key, *n, "an integer or a string");
}

ConfigTable ConfigTable::table(std::string_view key) const {
  const toml::node* n = impl_->get(key);
  if (n && !n->is_table()) impl_->type_error(key, *n, "a table");
  return ConfigTable(std::make_shared<Impl>(Impl{impl_->shared, impl_->path(key), n ? n->as_table() : nullptr}));
}

void ConfigTable::mark_used(std::string_view key) const { impl_->note(key); }

void ConfigTable::finish() const {
  if (!impl_->tbl) return;
  std::vector<std::string> known;
  {
    std::lock_guard<std::mutex> lock(impl_->shared->mu);
    known = impl_->shared->known[impl_->prefix];
  }
  // The first unread key in the order the user wrote them: file order, then
  // overrides in command-line order.
  const toml::key* first = nullptr;
  std::tuple<size_t, size_t, size_t> first_pos;
  for (auto&& [k, v] : *impl_->tbl) {
    if (std::find(known.begin(), known.end(), k.str()) != known.end()) continue;
    std::tuple<size_t, size_t, size_t> pos;
    if (auto* o = impl_->override_of(impl_->path(k.str())))
      pos = {SIZE_MAX, o->first, 0};
    else {
      const toml::source_region& r = k.source().begin.line ? k.source() : v.source();
      pos = {r.begin.line, r.begin.column, 0};
    }
    if (!first || pos < first_pos) {
      first = &k;
      first_pos = pos;
    }
  }
  if (!first) return;
  const std::string bad(first->str());
  const std::string hint = did_you_mean(bad, known);
  const std::string loc = impl_->key_loc(*first);
  if (impl_->prefix.empty()) {
    const toml::node* n = impl_->tbl->get(bad);
    if (n && n->is_table())
      throw Error(cat(loc, ": unknown section [", bad, "]", hint.empty() ? "" : cat(" (did you mean [", hint, "]?)"),
                      "; sections: ", join(known, ", ")));
    throw Error(cat(loc, ": unknown top-level key '", bad, "'",
                    hint.empty() ? "" : cat(" (did you mean [", hint, "]?)"),
                    "; keys belong in one of the sections: ", join(known, ", ")));
  }
  // Name the plugin too, since a plugin decides which keys its table accepts.
  std::string owner;
  if (const toml::node* p = impl_->tbl->get("plugin"); p && p->is_string())
    owner = cat(" by plugin '", p->as_string()->get(), "'");
  throw Error(cat(loc, ": unknown key '", impl_->path(bad), "'", hint.empty() ? "" : cat(" (did you mean '", hint, "'?)"),
                  "; keys accepted in [", impl_->prefix, "]", owner, ": ",
                  known.empty() ? std::string("none") : join(known, ", ")));
}

std::string ConfigTable::where(std::string_view key) const { return impl_->value_loc(key); }

void ConfigTable::fail(std::string_view key, std::string_view message) const {
  throw Error(cat(impl_->value_loc(key), ": ", message));
}

std::string ConfigTable::to_toml() const {
  if (!impl_->tbl) return "";
  std::ostringstream os;
  emit_table(os, *impl_->tbl, "");
  std::string out = os.str();
  // A document that starts with a section header reads better without the blank line.
  if (!out.empty() && out.front() == '\n') out.erase(0, 1);
  return out;
}

namespace {

// Applies one "a.b.c=value" override to `shared`.
void apply_override(ConfigShared& shared, const std::string& text, size_t order) {
  const std::string where = cat("--set ", text);
  size_t eq = text.find('=');
  if (eq == std::string::npos)
    throw Error(cat(where, ": expected section.key=value (e.g. --set train.steps=100)"));
  std::string dotted = trim(std::string_view(text).substr(0, eq));
  std::string value = trim(std::string_view(text).substr(eq + 1));
  std::vector<std::string> parts;
  for (size_t b = 0;;) {
    size_t d = dotted.find('.', b);
    parts.push_back(dotted.substr(b, d == std::string::npos ? std::string::npos : d - b));
    if (d == std::string::npos) break;
    b = d + 1;
  }
  for (const auto& p : parts)
    if (!is_bare_key(p))
      throw Error(cat(where, ": '", dotted, "' is not a dotted key: each part must be letters, digits, '_' or '-'"));
  if (value.empty())
    throw Error(cat(where, ": missing value (write ", dotted, "=\"\" for an empty string)"));

  // The value is TOML; a bare word that is not a TOML value (tokens,
  // /data/shards, hf:/models/llama) is taken as a string so users need not
  // quote paths and names on the command line.
  toml::table snippet;
  try {
    const std::string doc = cat("v = ", value);
    snippet = toml::parse(std::string_view(doc), std::string_view("--set"));
  } catch (const toml::parse_error& e) {
    char c = value.front();
    if (c == '"' || c == '\'' || c == '[' || c == '{')
      throw Error(cat(where, ": the value is not valid TOML: ", e.description()));
    // A number TOML cannot hold (beyond 64-bit integers, 1e999) is a number
    // out of range, not a string: "must be an integer, got string" would hide why.
    static const std::regex number(R"([+-]?[0-9][0-9_]*(\.[0-9_]*)?([eE][+-]?[0-9_]+)?)");
    if (std::regex_match(value, number))
      throw Error(cat(where, ": ", dotted, " = ", value, " is not a number Loom can hold: ", e.description()));
    snippet = toml::table{};
    snippet.insert("v", value);
  }

  // A table would replace the whole table at that key, silently dropping
  // every key the file sets there ([run]'s seed and threads under
  // --set run={name="x"}); one key at a time merges into it instead.
  const toml::node* parsed = snippet.get("v");
  if (parsed->is_table()) {
    std::string keys;
    for (auto&& [k, v] : *parsed->as_table())
      keys += cat(keys.empty() ? "" : " ", "--set ", dotted, ".", key_text(k.str()), "=", value_text(v, true));
    throw Error(cat(where, ": a table cannot be a --set value: it would replace all of ", dotted,
                    ", dropping the keys the file sets there. Set its keys one by one",
                    keys.empty() ? cat(" (--set ", dotted, ".key=value)") : cat(": ", keys)));
  }
  if (is_array_of_tables(*parsed))
    throw Error(cat(where, ": an array of tables cannot be a --set value; write ", dotted,
                    " in the config file ([[", dotted, "]] tables)"));

  toml::table* t = &shared.root;
  std::string path;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    path = join_path(path, parts[i]);
    toml::node* n = t->get(parts[i]);
    if (!n) {
      t->insert(parts[i], toml::table{});
      n = t->get(parts[i]);
      shared.overrides.emplace(path, std::make_pair(order, where));
    } else if (!n->is_table()) {
      throw Error(cat(where, ": ", path, " is ", describe(*n), ", not a table, so it cannot hold '",
                      parts[i + 1], "'"));
    }
    t = n->as_table();
  }
  path = join_path(path, parts.back());
  toml::node* v = snippet.get("v");
  v->visit([&](auto&& val) { t->insert_or_assign(parts.back(), std::move(val)); });
  shared.overrides[path] = std::make_pair(order, where);
}

}  // namespace

namespace {

void flatten_into(const toml::table& t, const std::string& prefix, std::map<std::string, std::string>& out) {
  for (auto&& [k, v] : t) {
    const std::string path = join_path(prefix, key_text(k.str()));
    if (v.is_table()) flatten_into(*v.as_table(), path, out);
    else out[path] = value_text(v, false);
  }
}

}  // namespace

std::map<std::string, std::string> flatten_config_toml(std::string_view toml_text) {
  toml::table root;
  try {
    root = toml::parse(toml_text, std::string_view("effective config"));
  } catch (const toml::parse_error& e) {
    throw Error(cat("effective config: TOML syntax error: ", e.description()));
  }
  std::map<std::string, std::string> out;
  flatten_into(root, "", out);
  return out;
}

namespace {

// toml++ reports a string left open at the end of its line as the newline it
// ran into ("unescaped control characters ... are explicitly prohibited"), or
// at the end of the text as "encountered end-of-file": both are a missing
// closing quote.
bool unclosed_string(std::string_view text, const toml::parse_error& e) {
  const std::string_view d = e.description();
  if (d.find("string") == std::string_view::npos) return false;
  if (d.find("end-of-file") != std::string_view::npos) return true;
  if (d.find("control characters") == std::string_view::npos) return false;
  const auto& at = e.source().begin;
  size_t pos = 0;
  for (size_t line = 1; line < at.line && pos != std::string_view::npos; ++line) {
    pos = text.find('\n', pos);
    if (pos != std::string_view::npos) ++pos;
  }
  if (pos == std::string_view::npos || at.column == 0) return false;
  pos += at.column - 1;
  return pos >= text.size() || text[pos] == '\n' || text[pos] == '\r';
}

}  // namespace

ConfigTable parse_config_table(std::string_view toml_text, const std::string& source_name,
                               const std::vector<std::string>& overrides) {
  auto shared = std::make_shared<ConfigShared>();
  shared->source = source_name;
  try {
    shared->root = toml::parse(toml_text, std::string_view(source_name));
  } catch (const toml::parse_error& e) {
    throw Error(cat(ConfigTable::Impl::at(source_name, e.source()), ": TOML syntax error: ",
                    unclosed_string(toml_text, e) ? std::string("a string is not closed before the end of its line (its "
                                                                "closing quote is missing; a string over several lines "
                                                                "is written \"\"\"...\"\"\")")
                                                  : std::string(e.description())));
  }
  for (size_t i = 0; i < overrides.size(); ++i) apply_override(*shared, overrides[i], i);
  const toml::table* root = &shared->root;
  return ConfigTable(std::make_shared<ConfigTable::Impl>(ConfigTable::Impl{shared, "", root}));
}

std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates) {
  // Case is no distance: "INFO", "usr1", "CPU" and [TRAIN] are meant as the
  // names they spell ("info", "USR1", "cpu", [train]).
  auto lower = [](std::string_view s) {
    std::string out(s);
    for (char& ch : out) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return out;
  };
  // Two-row Levenshtein distance, of the lower-case spellings.
  auto distance = [&](std::string_view a_in, std::string_view b_in) {
    const std::string a = lower(a_in), b = lower(b_in);
    std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      cur[0] = i;
      for (size_t j = 1; j <= b.size(); ++j)
        cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      std::swap(prev, cur);
    }
    return prev[b.size()];
  };
  const size_t limit = std::max<size_t>(2, word.size() / 3);
  std::string best;
  size_t best_d = SIZE_MAX;
  for (const auto& c : candidates) {
    size_t d = distance(word, c);
    // A candidate reached only by rewriting every character ('c' -> 'a') is
    // no suggestion, however small the distance.
    if (d <= limit && d < std::max(word.size(), c.size()) && d < best_d) {
      best = c;
      best_d = d;
    }
  }
  return best;
}

}  // namespace loom
