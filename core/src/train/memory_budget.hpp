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

// A GPU that a CUDA run is planned for without running on it (`loom check
// --gpu NAME` or `--device-memory SIZE`, on a login node without that GPU).
struct PlannedDevice {
  std::string name;     // "NVIDIA H100 80GB HBM3 (--gpu h100)", "a GPU of 80.00 GiB (--device-memory 80GiB)"
  uint64_t total = 0;   // the card's device memory in bytes (nvidia-smi's memory.total)
};

// A size as a user writes it: a number (integer or decimal) and a unit, "80GiB",
// "81559MiB", "141GB", "1.5TiB", or plain bytes "85899345920". Units: B, KB, MB,
// GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024), any case.
// Throws loom::Error naming `flag` and the text for anything else, and for a
// size below 1 GiB or above 1 PiB (no GPU has either).
uint64_t parse_memory_size(const std::string& text, const std::string& flag);

// --gpu NAME: the cards a node run is commonly sized for, by the memory
// nvidia-smi reports for them (memory.total): h100 (H100 SXM 80GB HBM3,
// 81559 MiB), h200 (H200 141GB HBM3e, 143771 MiB), a100-80gb (81920 MiB),
// a100-40gb (40960 MiB). Case-insensitive; an unknown name is refused with
// the list (and a did-you-mean).
PlannedDevice named_gpu(const std::string& name);
// "h100 (79.65 GiB), h200 (140.40 GiB), ..." for messages and --help.
std::string named_gpu_list();

// What a CUDA process holds on its GPU beyond the arena (the memory plan):
// the CUDA context with the kernels it loads and the cuBLASLt and cuDNN
// handles and graphs; under a launcher, what MPI and NCCL set up even over
// one rank; and NCCL's buffers to its peers. Not plannable from the config:
// the figures are measured ones (docs/PERFORMANCE.md, "The memory plan
// across the node workload's family"): the device memory in use minus the
// arena, which `loom bench` prints as `outside_arena_gib` for every run, was
// 0.57 GiB for a process started alone and 1.89 GiB for one started by
// `mpirun -np 1` (H200, CUDA 13.0, cuDNN 9.19, NCCL 2.27), and 1.8-2.2 GiB
// on four ranks.
struct OutsideArena {
  uint64_t context = 0;   // the CUDA context, its kernels, the cuBLASLt / cuDNN handles and graphs
  uint64_t launcher = 0;  // MPI and NCCL started by a launcher, on any number of ranks (0 alone)
  uint64_t nccl = 0;      // NCCL's channel buffers to the peers (0 on one rank)
  uint64_t total() const { return context + launcher + nccl; }
};
// For one rank of `world`, `local_world` of them on its node, started by a
// launcher (mpirun, srun; `loom check --world-size N`) or alone.
OutsideArena outside_arena_estimate(int world, int local_world, bool launched);

}  // namespace loom
