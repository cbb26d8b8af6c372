// TEMPORARY placeholder so that libloom links while the config area is built;
// replaced wholesale by the toml++-backed implementation.
#include "loom/config.hpp"

#include "loom/error.hpp"

namespace loom {
struct ConfigTable::Impl {};
ConfigTable::ConfigTable() = default;
ConfigTable::ConfigTable(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
ConfigTable::~ConfigTable() = default;
ConfigTable::ConfigTable(const ConfigTable&) = default;
ConfigTable& ConfigTable::operator=(const ConfigTable&) = default;
std::string ConfigTable::name() const { return ""; }
std::string ConfigTable::source() const { return ""; }
bool ConfigTable::has(std::string_view) const { return false; }
int64_t ConfigTable::get_int(std::string_view, int64_t def, int64_t, int64_t) const { return def; }
double ConfigTable::get_float(std::string_view, double def, double, double) const { return def; }
bool ConfigTable::get_bool(std::string_view, bool def) const { return def; }
std::string ConfigTable::get_string(std::string_view, std::string_view def) const { return std::string(def); }
std::string ConfigTable::get_choice(std::string_view, std::string_view def, std::initializer_list<std::string_view>) const { return std::string(def); }
std::vector<std::string> ConfigTable::get_string_list(std::string_view, std::vector<std::string> def) const { return def; }
std::string ConfigTable::get_int_or_string(std::string_view, std::string_view def) const { return std::string(def); }
ConfigTable ConfigTable::table(std::string_view) const { return {}; }
void ConfigTable::mark_used(std::string_view) const {}
void ConfigTable::finish() const {}
void ConfigTable::fail(std::string_view key, std::string_view message) const { throw Error(cat(key, ": ", message)); }
std::string did_you_mean(std::string_view, const std::vector<std::string>&) { return ""; }
}  // namespace loom
