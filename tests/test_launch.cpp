// Launch detection from the environment alone: a plain run is one process and
// never initialises MPI; launcher variables are read without touching MPI.
#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/launch.hpp"
#include "comm/mpi_communicator.hpp"
#include "loom/error.hpp"

namespace {

const char* const kLaunchVars[] = {
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMIX_RANK",
    "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_TASKS_PER_NODE"};

// Clears every launcher variable for the test and restores the originals after,
// so the suite behaves the same inside a Slurm job or under mpirun.
class LaunchEnv : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kLaunchVars) {
      const char* cur = std::getenv(v);
      saved_.emplace_back(v, cur ? std::optional<std::string>(cur) : std::nullopt);
      unsetenv(v);
    }
  }
  void TearDown() override {
    for (auto& [name, val] : saved_) {
      if (val) setenv(name.c_str(), val->c_str(), 1); else unsetenv(name.c_str());
    }
  }
  static void set(const char* name, const char* value) { setenv(name, value, 1); }
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

std::string error_of(const std::function<void()>& f) {
  try { f(); } catch (const loom::Error& e) { return e.what(); }
  return "";
}

TEST_F(LaunchEnv, CleanEnvironmentIsOneProcessWithoutMpi) {
  loom::LaunchInfo li = loom::detect_launch();
  EXPECT_EQ(li.rank, 0);
  EXPECT_EQ(li.world, 1);
  EXPECT_EQ(li.local_rank, 0);
  EXPECT_EQ(li.local_world, 1);
  EXPECT_FALSE(li.under_launcher);
  EXPECT_EQ(li.launcher, "");
  EXPECT_FALSE(loom::mpi_initialized()) << "a single-process run must not initialise MPI";
}

TEST_F(LaunchEnv, OpenMpiVariables) {
  set("OMPI_COMM_WORLD_SIZE", "4");
  set("OMPI_COMM_WORLD_RANK", "2");
  set("OMPI_COMM_WORLD_LOCAL_RANK", "0");
  set("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
  loom::LaunchInfo li = loom::launch_from_env();
  EXPECT_TRUE(li.under_launcher);
  EXPECT_EQ(li.launcher, "openmpi");
  EXPECT_EQ(li.world, 4);
  EXPECT_EQ(li.rank, 2);
  EXPECT_EQ(li.local_rank, 0);
  EXPECT_EQ(li.local_world, 2);
  EXPECT_FALSE(loom::mpi_initialized());
}

TEST_F(LaunchEnv, MpirunWithOneProcessStillCountsAsLaunched) {
  set("OMPI_COMM_WORLD_SIZE", "1");
  set("OMPI_COMM_WORLD_RANK", "0");
  loom::LaunchInfo li = loom::launch_from_env();
  EXPECT_TRUE(li.under_launcher);
  EXPECT_EQ(li.world, 1);
}

TEST_F(LaunchEnv, SlurmVariables) {
  set("SLURM_NTASKS", "8");
  set("SLURM_PROCID", "5");
  set("SLURM_LOCALID", "1");
  set("SLURM_NODEID", "1");
  set("SLURM_TASKS_PER_NODE", "4(x2)");
  loom::LaunchInfo li = loom::launch_from_env();
  EXPECT_TRUE(li.under_launcher);
  EXPECT_EQ(li.launcher, "slurm");
  EXPECT_EQ(li.world, 8);
  EXPECT_EQ(li.rank, 5);
  EXPECT_EQ(li.local_rank, 1);
  EXPECT_EQ(li.local_world, 4);
  // Uneven nodes: the second node runs 5 of the 8 tasks.
  set("SLURM_TASKS_PER_NODE", "3,5");
  EXPECT_EQ(loom::launch_from_env().local_world, 5);
  set("SLURM_TASKS_PER_NODE", "2(x2),4");
  set("SLURM_NODEID", "2");
  set("SLURM_LOCALID", "3");
  EXPECT_EQ(loom::launch_from_env().local_world, 4);
  EXPECT_FALSE(loom::mpi_initialized());
}

TEST_F(LaunchEnv, SlurmBatchScriptOrSingleTaskIsNotALaunch) {
  set("SLURM_NTASKS", "4");  // sbatch sets it; only srun sets SLURM_PROCID per task
  EXPECT_FALSE(loom::launch_from_env().under_launcher);
  set("SLURM_NTASKS", "1");
  set("SLURM_PROCID", "0");
  EXPECT_FALSE(loom::launch_from_env().under_launcher);
  EXPECT_EQ(loom::detect_launch().world, 1);
  EXPECT_FALSE(loom::mpi_initialized());
}

TEST_F(LaunchEnv, HydraAndPmixVariables) {
  set("PMI_SIZE", "3");
  set("PMI_RANK", "2");
  set("MPI_LOCALRANKID", "2");
  set("MPI_LOCALNRANKS", "3");
  loom::LaunchInfo li = loom::launch_from_env();
  EXPECT_EQ(li.launcher, "pmi");
  EXPECT_EQ(li.world, 3);
  EXPECT_EQ(li.rank, 2);
  EXPECT_EQ(li.local_world, 3);
  unsetenv("PMI_SIZE");
  set("PMIX_RANK", "7");
  li = loom::launch_from_env();
  EXPECT_TRUE(li.under_launcher);
  EXPECT_EQ(li.launcher, "pmix");
  EXPECT_EQ(li.rank, 7);
  EXPECT_EQ(li.world, 0) << "PMIx alone does not give the size; MPI does";
}

TEST_F(LaunchEnv, MalformedVariablesAreErrorsNamingThem) {
  set("OMPI_COMM_WORLD_SIZE", "four");
  std::string msg = error_of([] { loom::launch_from_env(); });
  EXPECT_NE(msg.find("OMPI_COMM_WORLD_SIZE"), std::string::npos) << msg;
  EXPECT_NE(msg.find("four"), std::string::npos) << msg;
  set("OMPI_COMM_WORLD_SIZE", "2");
  set("OMPI_COMM_WORLD_RANK", "2");
  msg = error_of([] { loom::launch_from_env(); });
  EXPECT_NE(msg.find("rank 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("world of 2"), std::string::npos) << msg;
  EXPECT_FALSE(loom::mpi_initialized());
}

TEST(Launch, MpiAvailabilityMatchesTheBuild) {
#ifdef LOOM_HAVE_MPI
  EXPECT_TRUE(loom::mpi_available());
#else
  EXPECT_FALSE(loom::mpi_available());
#endif
}

TEST(Launch, BadCollectiveTimeoutIsRefusedBeforeMpiStarts) {
  std::string msg = error_of([] { loom::make_mpi_communicator(0.0); });
  EXPECT_NE(msg.find(loom::mpi_available() ? "run.collective_timeout" : "no MPI support"), std::string::npos) << msg;
  EXPECT_FALSE(loom::mpi_initialized());
}

}  // namespace
