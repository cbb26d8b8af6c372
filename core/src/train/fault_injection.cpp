#include "train/fault_injection.hpp"

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "loom/error.hpp"
#include "loom/log.hpp"

namespace loom {

void fault_point(int rank, int64_t next_step) {
  static const char* spec = std::getenv("LOOM_FAULT_STALL");
  if (!spec) return;
  int r = -1;
  long long step = -1;
  char mode[8] = {};
  const int n = std::sscanf(spec, "%d:%lld:%7s", &r, &step, mode);
  if (n < 2 || r != rank || step != next_step) return;
  if (n == 3 && std::string(mode) == "kill") {
    log_warn(cat("LOOM_FAULT_STALL: rank ", r, " dies before step ", step));
    std::fflush(nullptr);
    std::raise(SIGKILL);
  }
  log_warn(cat("LOOM_FAULT_STALL: rank ", r, " stops responding before step ", step));
  for (;;) ::pause();
}

}  // namespace loom
