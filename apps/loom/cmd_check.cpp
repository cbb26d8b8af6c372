// loom check CONFIG [--set section.key=value]...: validate everything a run
// would validate (config, output folders, plugins and their tables, data
// files, attention support, whether the memory plan fits) and print the model
// size and the memory plan, without training.
#include <cstdio>

#include "commands.hpp"
#include "config/run_config.hpp"
#include "loom/error.hpp"
#include "train/outputs.hpp"
#include "train/runtime.hpp"
#include "train/session.hpp"

namespace loom::app {

int cmd_check(const Args& args) {
  ConfigArgs a = parse_config_args(args);
  if (a.file.empty()) throw Error("usage: loom check CONFIG [--set section.key=value]...");
  if (!a.rest.empty()) throw Error(cat("loom check: unknown argument '", a.rest.front(), "'"));
  Config cfg = load_config(a.file, a.overrides);
  check_plugin_path(cfg);  // a search folder that is not there is refused, not passed over
  check_output_paths(cfg);
  check_no_overwrite(cfg, planned_resume_step(cfg));
  Session session(std::move(cfg));
  std::printf("%s\n", session.describe().c_str());
  std::fflush(stdout);
  session.check_memory_fits();  // after the plan is printed: the error refers to it
  std::printf("%s: ok\n", a.file.c_str());
  return 0;
}

}  // namespace loom::app
