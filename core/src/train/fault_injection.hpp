// Faults on purpose, for the tests of collective timeouts and dead ranks:
// LOOM_FAULT_STALL="RANK:STEP" makes that rank stop responding before STEP;
// "RANK:STEP:kill" makes it die (SIGKILL) there instead.
#pragma once
#include <cstdint>

namespace loom {

// Called before each step with this rank and the step about to run (1-based).
void fault_point(int rank, int64_t next_step);

}  // namespace loom
