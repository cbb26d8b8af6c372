// Plugin discovery and loading (docs/PLUGINS.md, docs/ARCHITECTURE.md "Plugin ABI").
//
// Search order: directories named in the config (run.plugin_path and a plugin
// table's `path`), then $LOOM_PLUGIN_PATH (colon-separated), then
// <dir of the running executable>/../lib/loom/plugins. A file is a candidate
// when its name is libloom-<kind>-<name>.so. Libraries are never unloaded.
#pragma once
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "loom/plugin.hpp"

namespace loom {

struct PluginRecord {
  std::filesystem::path file;
  PluginKind kind{};
  std::string name, version, description, build_id;
  uint32_t abi_major = 0, abi_minor = 0;
};

class PluginRegistry {
 public:
  // `extra_dirs` come first (from the config), then $LOOM_PLUGIN_PATH, then the exe-relative dir.
  explicit PluginRegistry(std::vector<std::filesystem::path> extra_dirs = {});
  const std::vector<std::filesystem::path>& search_path() const { return dirs_; }

  // Every candidate file, loaded and checked. Good ones in records(); every
  // file that failed a check, with its message, in problems().
  void scan();
  const std::vector<PluginRecord>& records() const { return records_; }
  const std::vector<std::string>& problems() const { return problems_; }

  // Load, check and instantiate. `explicit_file` (a path to a .so) bypasses the search.
  // Throws loom::Error: not found (lists what was found and where it looked,
  // with a did-you-mean), wrong kind, ABI major/minor mismatch, build id
  // mismatch, not a plugin — each with its own message naming the file.
  std::unique_ptr<Plugin> create(PluginKind kind, const std::string& name, const PluginInit& init,
                                 const std::filesystem::path& explicit_file = {});

  template <PluginKind K>
  std::unique_ptr<typename PluginInterface<K>::type> create_as(const std::string& name, const PluginInit& init,
                                                               const std::filesystem::path& explicit_file = {}) {
    using T = typename PluginInterface<K>::type;
    return std::unique_ptr<T>(static_cast<T*>(create(K, name, init, explicit_file).release()));
  }

  // Load and check one file (throws as create() does). Exposed for tests and `loom plugins`.
  static PluginRecord inspect(const std::filesystem::path& file);

  // Every plugin create() instantiated, in order (what a run computes with:
  // ranks compare these at start-up).
  const std::vector<PluginRecord>& loaded() const { return loaded_; }

 private:
  std::vector<std::filesystem::path> dirs_;
  std::vector<PluginRecord> records_;
  std::vector<std::string> problems_;
  std::vector<PluginRecord> loaded_;
  bool scanned_ = false;
};

}  // namespace loom
