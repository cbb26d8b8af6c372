// `loom plot RUN_DIR... [--out plot.png]`: loss, validation loss, learning
// rate and throughput curves of runs, from their metrics.jsonl.
#include <cstdio>

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
    if (a == "--out" || a == "-o") {
      if (i + 1 >= args.size()) throw Error(cat(a, " needs a file name\n", usage));
      out = args[++i];
    } else if (a.rfind("--out=", 0) == 0) {
      out = a.substr(6);
    } else if (a.rfind("--", 0) == 0) {
      throw Error(cat("unknown option '", a, "'\n", usage));
    } else {
      dirs.push_back(a);
    }
  }
  if (dirs.empty()) throw Error(cat("loom plot needs at least one RUN_DIR\n", usage));
  std::vector<report::RunCurves> runs;
  for (auto& d : dirs) runs.push_back(report::read_run_curves(d));
  report::write_run_plot(out, runs);
  std::printf("wrote %s (%zu run%s)\n", out.c_str(), runs.size(), runs.size() == 1 ? "" : "s");
  return 0;
}

}  // namespace loom::app
