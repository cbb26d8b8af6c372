// TEMPORARY: weak fallbacks so the command links while its subcommands are
// being written in their own files; each real definition overrides these.
#include "commands.hpp"
#include "loom/error.hpp"
namespace loom::app {
#define LOOM_WEAK_CMD(fn) __attribute__((weak)) int fn(const Args&) { throw Error(#fn " is not built yet"); }
LOOM_WEAK_CMD(cmd_train)
LOOM_WEAK_CMD(cmd_check)
LOOM_WEAK_CMD(cmd_plugins)
LOOM_WEAK_CMD(cmd_prepare)
LOOM_WEAK_CMD(cmd_convert)
}  // namespace loom::app
