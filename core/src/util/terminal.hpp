// Whether a person watches this process's output on a terminal. Under mpirun
// the ranks' output goes through a pseudo-terminal that ends up in the job's
// log, so a launcher's environment counts as "not a person": no progress bar,
// no colours.
#pragma once
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace loom {

inline bool started_by_launcher() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"})
    if (std::getenv(v)) return true;
  return false;
}

inline bool interactive_terminal(int fd) {
  if (isatty(fd) != 1 || started_by_launcher()) return false;
  const char* term = std::getenv("TERM");
  return term && *term && std::strcmp(term, "dumb") != 0;
}

}  // namespace loom
