#include "train/runtime.hpp"

#include "comm/plan_communicator.hpp"

#include <sys/stat.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "comm/mpi_communicator.hpp"
#ifdef LOOM_HAVE_NCCL
#include "comm/nccl_communicator.hpp"
#endif
#include "loom/block.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"
#include "train/plan_device.hpp"
#include "train/rank_agreement.hpp"
#include "train/train_state.hpp"
#include "util/files.hpp"

namespace loom {
namespace {

void start_communicators(Runtime& rt, const Config& cfg) {
  if (!(rt.launch.under_launcher && mpi_available())) {
    rt.comm = make_self_communicator();
    rt.host = rt.comm.get();
    return;
  }
  // MPI carries host tensors; on CUDA, NCCL carries the device tensors and
  // MPI stays for scalars, barriers and the NCCL unique id.
  if (cfg.run.device == "cuda") {
    rt.host_owned = make_mpi_communicator(cfg.run.collective_timeout);
    rt.host = rt.host_owned.get();
#ifdef LOOM_HAVE_NCCL
    rt.comm = make_nccl_communicator(rt.backend->device_index(), cfg.run.collective_timeout);
#else
    throw Error("run.device = \"cuda\" with several ranks needs NCCL, and this loom was built without it: "
                "install NCCL (libnccl-dev) and rebuild");
#endif
  } else {
    rt.comm = make_mpi_communicator(cfg.run.collective_timeout);
    rt.host = rt.comm.get();
  }
}

// The [train] document switches that are on, for messages, after where the first was set.
std::string document_switches(const Config& cfg) {
  std::string s;
  for (const auto& [on, key] : {std::pair{cfg.train.reset_attention_mask, "train.reset_attention_mask"},
                                std::pair{cfg.train.reset_position_ids, "train.reset_position_ids"},
                                std::pair{cfg.train.eod_mask_loss, "train.eod_mask_loss"}})
    if (on) s += s.empty() ? cat(cfg.where(key), ": ", key, " = true") : cat(", ", key, " = true");
  return s;
}

// The switches need the data's document starts (loom::DocumentStarts), which
// the source must be able to tell (shards that record their markers, ...).
void check_document_starts(const Runtime& rt, const Config& cfg) {
  const auto* starts = dynamic_cast<const DocumentStarts*>(rt.data.get());
  const std::string what = cat(document_switches(cfg), " needs to know where the documents of the data begin, and "
                               "data.plugin = \"", cfg.data.plugin, "\" ");
  if (!starts)
    throw Error(cat(what, "does not tell (it implements no loom::DocumentStarts, loom/data.hpp); use data.plugin = "
                    "\"tokens\" or \"megatron\", or turn the switches off"));
  if (const std::string why = starts->starts_unavailable(); !why.empty())
    throw Error(cat(what, "cannot: ", why));
}

void load_plugins(Runtime& rt, const Config& cfg, const ModelSpec& spec) {
  std::vector<std::filesystem::path> dirs(cfg.run.plugin_path.begin(), cfg.run.plugin_path.end());
  rt.registry = std::make_unique<PluginRegistry>(dirs);
  auto init_for = [&](const PluginSection& s) {
    PluginInit init;
    init.config = s.table;
    init.device = rt.backend->device();
    init.rank = rt.comm->rank();
    init.world = rt.comm->size();
    init.local_rank = rt.launch.local_rank;
    init.local_world = rt.launch.local_world;
    init.seed = cfg.run.seed;
    init.deterministic = cfg.run.deterministic;
    init.under_launcher = rt.launch.under_launcher || rt.launch.under_launcher_planned;
    init.planning = rt.planned_device.has_value();
    return init;
  };
  rt.precision = rt.registry->create_as<PluginKind::precision>(cfg.precision.plugin, init_for(cfg.precision),
                                                               cfg.precision.path);
  rt.attention = rt.registry->create_as<PluginKind::attention>(cfg.attention.plugin, init_for(cfg.attention),
                                                               cfg.attention.path);
  rt.sharding = rt.registry->create_as<PluginKind::sharding>(cfg.sharding.plugin, init_for(cfg.sharding),
                                                             cfg.sharding.path);
  rt.data = rt.registry->create_as<PluginKind::data>(cfg.data.plugin, init_for(cfg.data), cfg.data.path);
  rt.dtypes = rt.precision->dtypes();
  // Before any layer or expert is built (Model, TrainState): a config whose
  // smallest plan cannot fit is refused from its numbers alone, instead of
  // after gigabytes of per-expert bookkeeping.
  check_memory_can_fit(cfg, spec, rt);

  // Refuse shapes the attention kernel cannot do before anything is allocated.
  BlockEnv probe;
  probe.spec = &spec;
  probe.B = cfg.train.micro_batch;
  probe.S = cfg.train.seq_len;
  probe.document_attention = cfg.train.reset_attention_mask;
  const Support sup = rt.attention->supports(probe.attention_shape(), rt.dtypes.activation, rt.backend->device());
  if (!sup.ok)
    throw Error(cat("attention.plugin = \"", cfg.attention.plugin, "\" cannot run this model",
                    probe.document_attention ? " with train.reset_attention_mask = true" : "", ": ", sup.reason));

  DataSpec ds;
  ds.batch = cfg.train.micro_batch;
  ds.seq_len = cfg.train.seq_len;
  ds.vocab_size = spec.vocab_size;
  ds.rank = rt.comm->rank();
  ds.world = rt.comm->size();
  ds.seed = cfg.run.seed;
  rt.data->open(ds);
  if (int64_t hint = rt.data->vocab_hint(); hint > spec.vocab_size)
    throw Error(cat("data.plugin = \"", cfg.data.plugin, "\" produces token ids up to ", hint - 1,
                    " but model.vocab_size = ", spec.vocab_size, ": raise model.vocab_size to at least ", hint));
  if (cfg.train.documents()) check_document_starts(rt, cfg);
  if (cfg.train.validation_every > 0 && !rt.data->has_split(Split::validation))
    throw Error(cat("train.validation_every = ", cfg.train.validation_every, " but data.plugin = \"", cfg.data.plugin,
                    "\" has no validation split: configure one or set train.validation_every = 0"));
}

// What is at a search folder's place, "" when it is a folder.
std::string not_a_folder(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    const int e = errno;
    return e == ENOENT ? std::string("does not exist") : cat("cannot be reached (", std::strerror(e), ")");
  }
  return S_ISDIR(st.st_mode) ? std::string() : cat("is ", file_type_name(st.st_mode), ", not a folder");
}

// $LOOM_PLUGIN_PATH is the environment's, shared by every run and often set
// for several machines at once: an entry missing here is said, not fatal.
void warn_env_plugin_path() {
  const char* env = std::getenv("LOOM_PLUGIN_PATH");
  if (!env) return;
  const std::string_view s(env);
  for (size_t start = 0; start <= s.size();) {
    size_t colon = s.find(':', start);
    if (colon == std::string_view::npos) colon = s.size();
    const std::string dir(s.substr(start, colon - start));
    start = colon + 1;
    if (dir.empty()) continue;  // "a::b", a trailing ':': the shell's way of joining, nothing meant
    if (const std::string why = not_a_folder(dir); !why.empty())
      log_warn(cat("$LOOM_PLUGIN_PATH entry '", dir, "' ", why, "; plugins are not searched there"));
  }
}

}  // namespace

void check_plugin_path(const Config& cfg) {
  const auto& dirs = cfg.run.plugin_path;
  for (size_t i = 0; i < dirs.size(); ++i) {
    const std::string entry = cat(cfg.where("run.plugin_path"), ": run.plugin_path[", i, "] = \"", dirs[i], "\"");
    if (dirs[i].empty())
      throw Error(cat(entry, " is empty: each entry names a folder that holds plugin files; remove it"));
    if (const std::string why = not_a_folder(dirs[i]); !why.empty())
      throw Error(cat(entry, " ", why, ": each entry of run.plugin_path must be a folder that holds plugin files "
                      "(libloom-<kind>-<name>.so). Fix the path or remove the entry",
                      why.rfind("is ", 0) == 0 ? "; to load one plugin file, give it as the section's `path` "
                                                 "(e.g. [attention] path = \"/dir/libloom-attention-x.so\")"
                                               : ""));
  }
}

Runtime make_runtime(const Config& cfg, const ModelSpec& spec, bool single_process, int plan_world,
                     int plan_local_world, const std::optional<PlannedDevice>& plan_device) {
  // Before anything is started: a search folder that is not there would
  // otherwise be passed over without a word.
  check_plugin_path(cfg);
  warn_env_plugin_path();
  Runtime rt;
  // Rank, world and node-local rank: from MPI when started by mpirun / srun,
  // otherwise this is the only rank and MPI is never touched.
  // A planned world or GPU starts nothing, under a launcher or not.
  rt.launch = single_process || plan_world > 0 || plan_device ? LaunchInfo{} : launch_from_env();
  if (plan_world > 0) {
    // `loom check --world-size N` plans rank 0 of N ranks as a launcher
    // would start them (N = 1 included: `mpirun -np 1`).
    rt.launch.under_launcher_planned = true;
    rt.launch.world = plan_world;
    rt.launch.local_world = plan_local_world > 0 ? plan_local_world : plan_world;
    LOOM_CHECK(plan_world % rt.launch.local_world == 0, "loom check --world ", plan_world,
               " is not a multiple of --gpus-per-node ", rt.launch.local_world, ": nodes hold equal numbers of ranks");
  }
  const bool several = rt.launch.under_launcher && rt.launch.world != 1;
  if (several && !mpi_available())
    throw Error(cat("this process is one of ",
                    rt.launch.world == 0 ? std::string("several") : std::to_string(rt.launch.world),
                    " ranks started by ", rt.launch.launcher, ", but this loom was built without MPI: rebuild with "
                    "MPI (libopenmpi-dev; cmake -DLOOM_WITH_MPI=ON) or start a single process"));
  if (rt.launch.under_launcher && mpi_available()) rt.launch = detect_launch();
  // Quiet the other ranks: rank 0 speaks for the run, the rest report warnings and errors.
  if (rt.launch.rank != 0 && cfg.run.log_level == "info") set_log_level("warn");
  if (cfg.train.seq_len > spec.max_seq_len)
    throw Error(cat("train.seq_len = ", cfg.train.seq_len, " exceeds the model's max_seq_len = ", spec.max_seq_len));
  if (plan_device && cfg.run.device != "cuda")
    throw Error(cat(cfg.where("run.device"), ": run.device = \"", cfg.run.device, "\" but the run is planned for a GPU (",
                    plan_device->name, "): --gpu and --device-memory plan a run.device = \"cuda\" run; leave them out "
                    "for a CPU run, or set run.device = \"cuda\""));
  if (plan_device) {
    // Planned for a GPU, on whatever this machine has: nothing touches a device.
    rt.planned_device = plan_device;
    rt.backend = make_planned_backend(Device::cuda, *plan_device, cfg.run.deterministic);
  } else if (cfg.run.device == "cuda") {
#ifdef LOOM_HAVE_CUDA
    if (!cuda_available())
      throw Error("run.device = \"cuda\" but no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver); "
                  "to plan the run for a GPU this machine does not have, run `loom check CONFIG --gpu NAME` (" +
                  named_gpu_list() + ") or `--device-memory SIZE`, with `--world-size N` for N ranks");
#endif
    rt.backend = make_cuda_backend(cuda_device_for_rank(rt.launch.local_rank, rt.launch.local_world),
                                   cfg.run.deterministic);
  } else {
    rt.backend = make_cpu_backend(cfg.run.threads, cfg.run.deterministic);
  }
  if (plan_world > 0 || rt.planned_device) {
    rt.comm = make_plan_communicator(std::max(plan_world, 1), rt.backend->device() != Device::cpu);
    rt.planned = true;
    rt.host = rt.comm.get();
    load_plugins(rt, cfg, spec);
    return rt;  // no ranks to agree with
  }
  start_communicators(rt, cfg);
  load_plugins(rt, cfg, spec);
  // Before any collective whose size depends on the config: the ranks must agree on it.
  check_ranks_agree(cfg, spec, rt);
  return rt;
}

}  // namespace loom
