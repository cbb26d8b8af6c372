// How this process was started: alone, or as one rank of mpirun / srun / a PMI
// launcher. The launcher's environment tells us before MPI is touched, so a
// plain single-process run never initialises MPI (no PMIx lookup, no network
// probing); once MPI is up, MPI is the authority on rank and world.
#pragma once
#include <string>

namespace loom {

struct LaunchInfo {
  // world is 0 only from launch_from_env() under a PMIx launcher that does not
  // say the size (PMIX_RANK alone); detect_launch() fills it in from MPI.
  int rank = 0, world = 1;
  int local_rank = 0, local_world = 1;  // within this node
  bool under_launcher = false;
  // `loom check --world-size N`: no launcher, but the run is planned as N
  // ranks a launcher started (plugins are told under_launcher).
  bool under_launcher_planned = false;
  std::string launcher;  // "openmpi", "pmix", "pmi", "slurm" or "" when alone
};

// Only the launcher's environment (OMPI_COMM_WORLD_*, PMIX_RANK, PMI_SIZE /
// PMI_RANK, SLURM_NTASKS / SLURM_PROCID); never initialises MPI. Malformed
// values (not an integer, rank outside the world) throw loom::Error.
LaunchInfo launch_from_env();

// launch_from_env(), then, when under a launcher and built with MPI, initialise
// MPI and take rank/world from MPI_COMM_WORLD and the node-local rank/size from
// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED). Alone, MPI stays uninitialised
// (unless something already initialised it, in which case MPI is read).
LaunchInfo detect_launch();

// Built with MPI.
bool mpi_available();
// MPI_Init has been called by this process (and MPI_Finalize has not).
bool mpi_initialized();
// MPI_Init_thread(MPI_THREAD_FUNNELED) once, if nobody has yet; MPI_Finalize is
// registered with atexit so it runs at process exit. Throws without MPI.
void ensure_mpi_initialized();

// After a collective error the ranks disagree on what comes next; the only safe
// exit is to take every rank down: MPI_Abort(MPI_COMM_WORLD, code) when MPI is
// initialised, std::_Exit(code) otherwise.
[[noreturn]] void abort_all(int code);

}  // namespace loom
