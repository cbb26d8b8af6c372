// `loom plugins [--path DIR]...`: every plugin the registry finds, the files it
// refused and why, and the directories it searched, so that a user can answer
// "which plugin will this run load, and from where?" without starting a run.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "cli.hpp"
#include "commands.hpp"
#include "loom/error.hpp"
#include "loom/registry.hpp"
#include "loom/version.hpp"

namespace loom::app {
namespace {

void print_usage() {
  std::printf(
      "usage: loom plugins [--path DIR]...\n\n"
      "Lists every plugin found in the plugin search path: the --path directories (in the order\n"
      "given), then $LOOM_PLUGIN_PATH (colon-separated), then <loom>/../lib/loom/plugins.\n"
      "When several directories hold the same kind and name, the first one wins.\n");
}

}  // namespace

int cmd_plugins(const Args& args) {
  std::vector<std::filesystem::path> dirs;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      print_usage();
      return 0;
    }
    if (auto dir = flag_value(args, i, "--path")) dirs.emplace_back(*dir);
    else throw Error(cat("unknown argument '", a, "'. Usage: loom plugins [--path DIR]..."));
  }

  PluginRegistry reg(std::move(dirs));
  reg.scan();

  // Sorted by kind then name so that the table reads the same whatever the search order.
  std::vector<PluginRecord> recs = reg.records();
  std::stable_sort(recs.begin(), recs.end(), [](const PluginRecord& a, const PluginRecord& b) {
    return a.kind != b.kind ? a.kind < b.kind : a.name < b.name;
  });
  const std::vector<std::string> header = {"KIND", "NAME", "VERSION", "DESCRIPTION", "FILE"};
  std::vector<std::vector<std::string>> rows;
  for (const auto& r : recs)
    rows.push_back({plugin_kind_name(r.kind), r.name, r.version, r.description, r.file.string()});
  std::vector<size_t> width(header.size());
  for (size_t c = 0; c < header.size(); ++c) {
    width[c] = header[c].size();
    for (const auto& row : rows) width[c] = std::max(width[c], row[c].size());
  }
  auto print_row = [&](const std::vector<std::string>& row) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      line += row[c];
      if (c + 1 < row.size()) line += std::string(width[c] - row[c].size() + 2, ' ');
    }
    std::printf("%s\n", line.c_str());
  };

  std::printf("loom %s, plugin ABI %d.%d, build id %s\n\n", version_string(), LOOM_ABI_MAJOR, LOOM_ABI_MINOR,
              build_id());
  if (rows.empty()) {
    std::printf("No plugins found.\n");
  } else {
    print_row(header);
    for (const auto& row : rows) print_row(row);
  }

  const auto& problems = reg.problems();
  if (!problems.empty()) {
    std::printf("\nProblems (%zu file%s not loaded):\n", problems.size(), problems.size() == 1 ? "" : "s");
    for (const auto& p : problems) std::printf("  - %s\n", p.c_str());
  }

  std::printf("\nSearch path (first match wins):\n");
  for (const auto& d : reg.search_path()) {
    std::error_code ec;
    // "(does not exist)" would be wrong for a file or a device given as --path.
    const char* note = std::filesystem::is_directory(d, ec)                     ? ""
                       : std::filesystem::exists(std::filesystem::status(d, ec)) ? "   (not a folder)"
                                                                                 : "   (does not exist)";
    std::printf("  %s%s\n", d.string().c_str(), note);
  }
  // Listing succeeded even when some files were refused: they are reported above,
  // and a run fails with the same message only if it asks for one of them.
  return 0;
}

}  // namespace loom::app
