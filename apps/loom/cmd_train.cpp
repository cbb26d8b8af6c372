// loom train CONFIG [--set section.key=value]...
#include <cstdio>

#include "commands.hpp"
#include "config/run_config.hpp"
#include "loom/error.hpp"
#include "train/session.hpp"

namespace loom::app {

int cmd_train(const Args& args) {
  ConfigArgs a = parse_config_args(args);
  if (a.file.empty()) throw Error("usage: loom train CONFIG [--set section.key=value]...");
  if (!a.rest.empty()) throw Error(cat("loom train: unknown argument '", a.rest.front(), "'"));
  Session session(load_config(a.file, a.overrides));
  session.train();
  return 0;
}

}  // namespace loom::app
