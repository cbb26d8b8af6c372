// Subcommands of the `loom` command. Each takes the arguments after its name
// and returns the process exit code; loom::Error is caught and printed by main.
#pragma once
#include <string>
#include <vector>

namespace loom::app {
using Args = std::vector<std::string>;
int cmd_train(const Args& args);
int cmd_check(const Args& args);
int cmd_plugins(const Args& args);
int cmd_prepare(const Args& args);
int cmd_convert(const Args& args);
int cmd_bench(const Args& args);
int cmd_compare(const Args& args);
int cmd_plot(const Args& args);
}  // namespace loom::app
