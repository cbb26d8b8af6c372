// How much memory a run may still take, compared with its plan before the
// arena is allocated (docs/RELIABILITY.md "Memory"): a plan that does not fit
// is refused with the plan and what to change, instead of being OOM-killed
// after it was printed.
//
// Host memory: the tightest memory cgroup limit above this process (cgroup v2
// memory.max / memory.current, or v1 memory.limit_in_bytes /
// memory.usage_in_bytes, on every level up to the hierarchy's root; page cache
// that can be dropped, inactive_file, does not count as used), and the
// machine's MemAvailable. Device memory: what cudaMemGetInfo reports free.
#pragma once
#include <cstdint>
#include <string>

#include "loom/error.hpp"

namespace loom {

// A memory plan that does not fit the memory available: a refusal of the run,
// not of its config (loom compare makes it a failed row of its table).
class MemoryPlanError : public Error {
 public:
  using Error::Error;
};

struct MemoryBudget {
  uint64_t available = UINT64_MAX;  // bytes; UINT64_MAX when nothing limits it
  std::string source;               // where the number comes from, for messages
  bool known() const { return available != UINT64_MAX; }
};

// The files read, replaceable for tests.
struct HostMemoryFiles {
  std::string self_cgroup = "/proc/self/cgroup";
  std::string mountinfo = "/proc/self/mountinfo";
  std::string meminfo = "/proc/meminfo";
};

MemoryBudget host_memory_budget(const HostMemoryFiles& files = {});

// "3.52 GiB", "512.0 MiB".
std::string human_bytes(double bytes);

}  // namespace loom
