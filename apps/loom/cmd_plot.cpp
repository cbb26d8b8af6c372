// `loom plot RUN_DIR... [--out plot.png]`: loss, validation loss, learning
// rate and throughput curves of runs, from their metrics.jsonl.
#include <cstdio>
#include <filesystem>

#include "cli.hpp"
#include "commands.hpp"
#include "loom/error.hpp"
#include "run_plot.hpp"

namespace loom::app {

int cmd_plot(const Args& args) {
  const char* usage =
      "usage: loom plot RUN_DIR... [--out plot.png]\n"
      "  RUN_DIR  a run's output directory (run.out_dir), holding metrics.jsonl; several are drawn in one chart";
  std::vector<std::string> dirs;
  std::string out = "plot.png";
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      std::printf("%s\n", usage);
      return 0;
    }
    if (auto v = flag_value(args, i, a == "-o" ? "-o" : "--out")) {
      out = *v;
    } else if (a.rfind("--", 0) == 0) {
      throw Error(cat("unknown option '", a, "'\n", usage));
    } else {
      dirs.push_back(a);
    }
  }
  if (dirs.empty()) throw Error(cat("needs at least one RUN_DIR\n", usage));
  // The chart is a PNG: another extension would name a file that is not what it says.
  const std::string ext = std::filesystem::path(out).extension().string();
  std::error_code ec;
  if (ext != ".png" && ext != ".PNG" && !std::filesystem::is_directory(out, ec))  // a folder is told as one when written
    throw Error(cat("--out ", out, ": loom plot writes a PNG image; give --out a name ending in .png (e.g. ",
                    std::filesystem::path(out).replace_extension(".png").string(), ")"));
  report::require_cairo();  // before reading anything: the one thing this machine may lack
  std::vector<report::RunCurves> runs;
  for (auto& d : dirs) runs.push_back(report::read_run_curves(d));
  report::write_run_plot(out, runs);
  std::printf("wrote %s (%zu run%s)\n", out.c_str(), runs.size(), runs.size() == 1 ? "" : "s");
  return 0;
}

}  // namespace loom::app
