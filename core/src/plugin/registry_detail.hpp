// Pieces of the plugin registry that are pure functions of strings, kept out of
// the public header but visible to the tests (which include core/src).
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "loom/plugin.hpp"

namespace loom::detail {

// "libloom-<kind>-<name>.so" split into its parts; kind is empty when the
// kind text is not a known kind (the file is still reported, not ignored).
struct ParsedFileName {
  std::string kind_text, name;
  std::optional<PluginKind> kind;
};

// True for every file a scan looks at: "libloom-*.so".
bool looks_like_plugin_file(std::string_view fname);
std::optional<ParsedFileName> parse_plugin_file_name(std::string_view fname);
std::optional<PluginKind> kind_from_name(std::string_view s);
std::optional<PluginKind> kind_from_number(uint32_t n);

// "" when a plugin built with `plugin_id` may be loaded by a host built with
// `host_id`; otherwise which part differs, in words.
std::string build_id_mismatch(std::string_view plugin_id, std::string_view host_id);

size_t edit_distance(std::string_view a, std::string_view b);
// loom::did_you_mean, or the nearest candidate within a third of the word's length.
std::string nearest_name(std::string_view word, const std::vector<std::string>& candidates);

}  // namespace loom::detail
