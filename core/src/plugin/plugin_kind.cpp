#include "loom/plugin.hpp"

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
}  // namespace loom
