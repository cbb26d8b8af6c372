// What a run computes with, set up from the config before any memory is
// touched: how the process was launched (rank, world), the backend, the
// communicators, and the four plugins (loaded, their tables validated, the
// data opened, the attention shape accepted).
#pragma once
#include <memory>
#include <optional>

#include "comm/launch.hpp"
#include "config/run_config.hpp"
#include "loom/attention.hpp"
#include "loom/comm.hpp"
#include "loom/data.hpp"
#include "loom/ops/backend.hpp"
#include "loom/precision.hpp"
#include "loom/registry.hpp"
#include "loom/sharding.hpp"
#include "train/memory_budget.hpp"

namespace loom {

struct Runtime {
  LaunchInfo launch;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Communicator> comm;        // the data communicator: NCCL on CUDA, MPI on CPU, self alone
  std::unique_ptr<Communicator> host_owned;  // MPI beside NCCL
  Communicator* host = nullptr;              // host scalars, barriers, checkpoint metadata
  std::unique_ptr<PluginRegistry> registry;
  std::unique_ptr<Precision> precision;
  std::unique_ptr<Attention> attention;
  std::unique_ptr<Sharding> sharding;
  std::unique_ptr<DataSource> data;
  PrecisionDTypes dtypes{};
  bool planned = false;  // loom check --world: comm is a stand-in (comm/plan_communicator.hpp)
  // loom check --gpu / --device-memory: the GPU the run is planned for; the
  // backend is a stand-in (train/plan_device.hpp) and the plugins were made
  // with PluginInit::planning.
  std::optional<PlannedDevice> planned_device;

  int rank() const { return comm->rank(); }
  int world() const { return comm->size(); }
  // MPI and NCCL are (or, planned with --world-size, would be) started: a
  // launcher started this process. Alone, the communicator is the process.
  bool launched() const { return launch.under_launcher_planned || (launch.under_launcher && mpi_available()); }
};

// `single_process`: train alone even under a launcher (the one-process
// reference the multi-rank tests compare with). Throws loom::Error for every
// problem a user can fix (no GPU, no MPI, a plugin missing or refusing its
// table, an attention shape its kernel cannot do, data that does not fit the
// model), naming the key.
// `plan_world` > 0 (loom check --world): lay out the run as rank 0 of that
// many ranks, `plan_local_world` per node (0: all on one node), starting
// none of them; collectives refuse (comm/plan_communicator.hpp).
// `plan_device` (loom check --gpu / --device-memory): plan a run.device =
// "cuda" run for that GPU without touching one (train/plan_device.hpp);
// refused for a CPU run.
Runtime make_runtime(const Config& cfg, const ModelSpec& spec, bool single_process, int plan_world = 0,
                     int plan_local_world = 0, const std::optional<PlannedDevice>& plan_device = std::nullopt);

// Every run.plugin_path entry is an existing folder (an entry that is missing,
// empty, a file or a device is refused, naming it); make_runtime checks it
// first, `loom train` and `loom check` before any other work.
void check_plugin_path(const Config& cfg);

}  // namespace loom
