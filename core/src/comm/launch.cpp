// Launch detection and the process-wide MPI lifetime (see launch.hpp).
#include "comm/launch.hpp"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "loom/error.hpp"
#include "loom/log.hpp"

#ifdef LOOM_HAVE_MPI
#include <mpi.h>
#endif

namespace loom {
namespace {

// An integer environment variable: nullopt when unset or empty; a value that
// is set but is not a non-negative integer is an error, since guessing would
// give two processes the same rank.
std::optional<int> env_int(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (errno != 0 || *end != '\0' || x < 0 || x > 1'000'000'000)
    throw Error(cat("launch environment variable ", name, "='", v,
                    "' is not a non-negative integer; unset it or start the run through its launcher "
                    "(mpirun, srun) unchanged"));
  return static_cast<int>(x);
}

// Slurm's SLURM_TASKS_PER_NODE: "4(x2),3" = 4 tasks on each of 2 nodes then 3
// on one. Returns the count for node `node`, nullopt if unparsable or absent.
std::optional<int> slurm_tasks_on_node(const char* spec, int node) {
  if (!spec || !*spec) return std::nullopt;
  std::string s(spec);
  size_t i = 0;
  int seen = 0;
  while (i < s.size()) {
    char* end = nullptr;
    long n = std::strtol(s.c_str() + i, &end, 10);
    if (end == s.c_str() + i) return std::nullopt;
    i = static_cast<size_t>(end - s.c_str());
    long reps = 1;
    if (i < s.size() && s[i] == '(') {
      if (s.compare(i, 2, "(x") != 0) return std::nullopt;
      reps = std::strtol(s.c_str() + i + 2, &end, 10);
      i = static_cast<size_t>(end - s.c_str());
      if (i >= s.size() || s[i] != ')') return std::nullopt;
      ++i;
    }
    if (node < seen + reps) return static_cast<int>(n);
    seen += static_cast<int>(reps);
    if (i < s.size() && s[i] == ',') ++i;
  }
  return std::nullopt;
}

void check_consistent(const LaunchInfo& li, const char* vars) {
  if (li.world > 0 && (li.rank >= li.world || li.local_world > li.world))
    throw Error(cat("launch environment (", vars, ") is inconsistent: rank ", li.rank, " local world ", li.local_world,
                    " in a world of ", li.world, "; unset stale variables or start the run through its launcher"));
  if (li.local_rank >= li.local_world)
    throw Error(cat("launch environment (", vars, ") is inconsistent: local rank ", li.local_rank,
                    " in a node-local world of ", li.local_world,
                    "; unset stale variables or start the run through its launcher"));
}

#ifdef LOOM_HAVE_MPI
std::mutex g_init_mu;

void finalize_at_exit() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Finalize();
}

std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return cat("MPI error code ", rc);
  return std::string(buf, static_cast<size_t>(len));
}
#endif

}  // namespace

LaunchInfo launch_from_env() {
  LaunchInfo li;
  if (auto size = env_int("OMPI_COMM_WORLD_SIZE")) {
    // mpirun (Open MPI): present even with -np 1, which still counts as launched.
    li.under_launcher = true;
    li.launcher = "openmpi";
    li.world = *size;
    li.rank = env_int("OMPI_COMM_WORLD_RANK").value_or(0);
    li.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK").value_or(0);
    li.local_world = env_int("OMPI_COMM_WORLD_LOCAL_SIZE").value_or(1);
    check_consistent(li, "OMPI_COMM_WORLD_*");
  } else if (auto psize = env_int("PMI_SIZE")) {
    // MPICH / Intel MPI hydra (PMI-1/2).
    li.under_launcher = true;
    li.launcher = "pmi";
    li.world = *psize;
    li.rank = env_int("PMI_RANK").value_or(0);
    li.local_rank = env_int("MPI_LOCALRANKID").value_or(0);
    li.local_world = env_int("MPI_LOCALNRANKS").value_or(1);
    check_consistent(li, "PMI_SIZE/PMI_RANK");
  } else if (auto ntasks = env_int("SLURM_NTASKS"); ntasks && *ntasks > 1 && env_int("SLURM_PROCID")) {
    // srun. A batch script also sees SLURM_NTASKS, but only srun starts the
    // tasks; with a single task there is nothing to coordinate either way.
    li.under_launcher = true;
    li.launcher = "slurm";
    li.world = *ntasks;
    li.rank = *env_int("SLURM_PROCID");
    li.local_rank = env_int("SLURM_LOCALID").value_or(0);
    int node = env_int("SLURM_NODEID").value_or(0);
    li.local_world = slurm_tasks_on_node(std::getenv("SLURM_TASKS_PER_NODE"), node).value_or(li.local_rank + 1);
    check_consistent(li, "SLURM_NTASKS/SLURM_PROCID");
  } else if (auto prank = env_int("PMIX_RANK")) {
    // A PMIx server (prterun, srun --mpi=pmix without Slurm's own variables):
    // the rank is known, the size only once MPI asks the server.
    li.under_launcher = true;
    li.launcher = "pmix";
    li.rank = *prank;
    li.world = 0;
  }
  return li;
}

bool mpi_available() {
#ifdef LOOM_HAVE_MPI
  return true;
#else
  return false;
#endif
}

bool mpi_initialized() {
#ifdef LOOM_HAVE_MPI
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
#else
  return false;
#endif
}

void ensure_mpi_initialized() {
#ifdef LOOM_HAVE_MPI
  std::lock_guard<std::mutex> lock(g_init_mu);
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (fin)
    throw Error("MPI is needed but has already been finalised in this process; create communicators before exit "
                "handlers run");
  if (init) return;
  int provided = 0;
  // FUNNELED: only the thread that initialised MPI calls it (the training loop);
  // OpenMP workers never do.
  int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  if (rc != MPI_SUCCESS)
    throw Error(cat("MPI_Init_thread failed: ", mpi_error_string(rc),
                    "; check that the MPI library the program links matches the launcher (mpirun/srun)"));
  std::atexit(finalize_at_exit);
  if (provided < MPI_THREAD_FUNNELED)
    log_warn(cat("MPI provides thread level ", provided, " below MPI_THREAD_FUNNELED; collectives stay on the "
                 "main thread"));
#else
  throw Error("this build of loom has no MPI support; rebuild with -DLOOM_WITH_MPI=ON (MPI development files "
              "installed) to run several processes");
#endif
}

LaunchInfo detect_launch() {
  LaunchInfo li = launch_from_env();
  if (!li.under_launcher && !mpi_initialized()) return li;
#ifdef LOOM_HAVE_MPI
  ensure_mpi_initialized();
  int rank = 0, world = 1, lrank = 0, lworld = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm node = MPI_COMM_NULL;
  int rc = MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  if (rc != MPI_SUCCESS)
    throw Error(cat("MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) failed on rank ", rank, " of ", world, ": ",
                    mpi_error_string(rc), "; the node-local rank picks the GPU, so it cannot be guessed"));
  MPI_Comm_rank(node, &lrank);
  MPI_Comm_size(node, &lworld);
  MPI_Comm_free(&node);
  // A launcher that says N processes while MPI sees a world of 1 means the
  // program links a different MPI than the one that started it: every process
  // would train alone, silently.
  if (li.under_launcher && li.world > 1 && world != li.world)
    throw Error(cat("the launcher (", li.launcher, ") started ", li.world, " processes but MPI reports a world of ",
                    world, " on rank ", rank, "; the program's MPI library does not match the launcher — use the "
                    "mpirun of the MPI loom was built with"));
  li.rank = rank;
  li.world = world;
  li.local_rank = lrank;
  li.local_world = lworld;
  if (li.launcher.empty()) li.launcher = "mpi";
  li.under_launcher = li.under_launcher || world > 1;
  return li;
#else
  if (li.world != 1)
    throw Error(cat("started by ", li.launcher, " as rank ", li.rank, " of ", li.world,
                    " processes, but this build of loom has no MPI support; rebuild with -DLOOM_WITH_MPI=ON or run "
                    "a single process"));
  return li;
#endif
}

void abort_all(int code) {
  std::fflush(nullptr);  // the error message should reach the log before the job dies
#ifdef LOOM_HAVE_MPI
  if (mpi_initialized()) MPI_Abort(MPI_COMM_WORLD, code);
#endif
  std::_Exit(code);
}

}  // namespace loom
