#include "loom/plugin.hpp"
#include "loom/precision.hpp"

namespace loom {
const char* plugin_kind_name(PluginKind k) {
  switch (k) {
    case PluginKind::precision: return "precision";
    case PluginKind::attention: return "attention";
    case PluginKind::sharding: return "sharding";
    case PluginKind::data: return "data";
  }
  return "unknown";
}
const char* linear_role_name(LinearRole r) {
  switch (r) {
    case LinearRole::hidden: return "hidden";
    case LinearRole::lm_head: return "lm_head";
  }
  return "unknown";
}
}  // namespace loom
