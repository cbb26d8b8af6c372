// loom check CONFIG [--set section.key=value]...: validate everything a run
// would validate (config, plugins and their tables, data files, attention
// support) and print the model size and the memory plan, without training.
#include <cstdio>

#include "commands.hpp"
#include "config/run_config.hpp"
#include "loom/error.hpp"
#include "train/session.hpp"

namespace loom::app {

int cmd_check(const Args& args) {
  ConfigArgs a = parse_config_args(args);
  if (a.file.empty()) throw Error("usage: loom check CONFIG [--set section.key=value]...");
  if (!a.rest.empty()) throw Error(cat("loom check: unknown argument '", a.rest.front(), "'"));
  Session session(load_config(a.file, a.overrides));
  std::printf("%s: ok\n%s", a.file.c_str(), session.describe().c_str());
  return 0;
}

}  // namespace loom::app
