// Reliability across ranks, with `loom train` started by mpirun (CPU fp32,
// oversubscribed):
//  - ReliabilitySignalsMpi: a stop signal delivered to one rank only stops
//    every rank after the same step (the ranks agree through a host all-reduce
//    each step); every rank writes its share of that step's checkpoint, and
//    the resumed run continues with the uninterrupted run's losses (1e-5
//    relative; the same launch, so in fact bitwise).
//  - ReliabilityRanks: ranks started with different configs or plugins stop at
//    start-up, quickly (not after the collective timeout, and not inside MPI
//    with MPI_ERR_TRUNCATE), with a message naming each key that differs.
#include <gtest/gtest.h>
#include <dirent.h>

#include <cmath>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "reliability_util.hpp"

namespace fs = std::filesystem;
using namespace loom::test;

namespace {

std::string mpirun(int np) {
  return std::string(LOOM_MPIEXEC) + " --allow-run-as-root --oversubscribe -np " + std::to_string(np) +
         " -x OMP_NUM_THREADS=1";
}

std::string loom_train(const fs::path& cfg, const std::string& sets = "") {
  return std::string("'") + LOOM_CLI + "' train '" + cfg.string() + "' " + sets;
}

// The pid of the loom process that is rank `rank` of the launch tagged `tag`
// (mpirun -x LOOM_TEST_TAG), from /proc/<pid>/environ.
pid_t find_rank(const std::string& tag, int rank) {
  DIR* d = ::opendir("/proc");
  pid_t found = -1;
  for (dirent* e; d && (e = ::readdir(d));) {
    const std::string name = e->d_name;
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string env = read_text(fs::path("/proc") / name / "environ");
    const std::string cmd = read_text(fs::path("/proc") / name / "cmdline");
    if (has(env, std::string("LOOM_TEST_TAG=") + tag + '\0') &&
        has(env, std::string("OMPI_COMM_WORLD_RANK=") + std::to_string(rank) + '\0') && has(cmd, "train"))
      found = static_cast<pid_t>(std::stol(name));
  }
  if (d) ::closedir(d);
  return found;
}

std::vector<std::pair<int64_t, double>> metric_losses(const fs::path& file) {
  std::vector<std::pair<int64_t, double>> out;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.emplace_back(j["step"].get<int64_t>(), j["loss"].get<double>());
  }
  return out;
}

// The 2-rank run's global batch of 8 sequences: micro_batch 2 x grad_accum 2 x 2 ranks.
fs::path write_config(const fs::path& dir, const fs::path& out, int64_t steps) {
  const fs::path cfg = dir / "run.toml";
  std::string text = tiny_config(out, steps);
  text.replace(text.find("micro_batch = 4"), 15, "micro_batch = 2");
  std::ofstream(cfg) << text;
  return cfg;
}

}  // namespace

TEST(ReliabilitySignalsMpi, EveryRankStopsAtTheSameStepWithACheckpoint) {
  for (const char* strategy : {"ddp", "zero3"}) {
    SCOPED_TRACE(strategy);
    const fs::path dir = fresh_dir(std::string("mpi_signal_") + strategy);
    const fs::path cfg = write_config(dir, dir / "run", 100000);
    const std::string tag = "sig" + std::to_string(::getpid()) + strategy;
    const std::string sets = std::string("--set sharding.plugin=") + strategy;
    Background job(mpirun(2) + " -x LOOM_TEST_TAG=" + tag + " " + loom_train(cfg, sets), dir / "log.txt");
    ASSERT_TRUE(wait_for([&] { return count_lines(dir / "run" / "metrics.jsonl") >= 5; }, 180)) << job.output();
    const pid_t rank1 = find_rank(tag, 1);
    ASSERT_GT(rank1, 0) << "rank 1 not found";
    ASSERT_EQ(::kill(rank1, SIGTERM), 0);  // rank 1 alone hears it
    const ProcResult r = job.wait(180);
    EXPECT_NE(r.code, 0) << r.out;
    // Both ranks name the same step.
    std::set<std::string> steps;
    const std::regex line(R"(stopped by SIGTERM on rank (\d) of 2 after step (\d+))");
    int ranks = 0;
    for (std::sregex_iterator it(r.out.begin(), r.out.end(), line), end; it != end; ++it) {
      ++ranks;
      steps.insert((*it)[2]);
    }
    ASSERT_EQ(ranks, 2) << r.out;
    ASSERT_EQ(steps.size(), 1u) << "the ranks stopped at different steps:\n" << r.out;
    const int64_t step = std::stoll(*steps.begin());
    // Every rank's share of that step's checkpoint, complete; metrics up to it.
    const fs::path ck = dir / "run" / "checkpoints" / loom::ckpt::step_dir_name(step);
    EXPECT_TRUE(fs::exists(ck / "COMPLETE")) << r.out;
    EXPECT_TRUE(fs::exists(ck / "rank_00000.bin"));
    EXPECT_TRUE(fs::exists(ck / "rank_00001.bin"));
    EXPECT_EQ(count_lines(dir / "run" / "metrics.jsonl"), step);

    // Resume for a few steps, and run the same steps uninterrupted: the same losses.
    const int64_t until = step + 6;
    const std::string more = sets + " --set train.steps=" + std::to_string(until);
    ProcResult resumed = run_shell("timeout 300 " + mpirun(2) + " " + loom_train(cfg, more));
    ASSERT_EQ(resumed.code, 0) << resumed.out;
    fs::create_directories(dir / "ref");
    const fs::path rc = write_config(dir / "ref", dir / "ref" / "run", until);
    ProcResult ref = run_shell("timeout 300 " + mpirun(2) + " " + loom_train(rc, sets));
    ASSERT_EQ(ref.code, 0) << ref.out;
    const auto a = metric_losses(dir / "run" / "metrics.jsonl");
    const auto b = metric_losses(dir / "ref" / "run" / "metrics.jsonl");
    ASSERT_EQ(a.size(), static_cast<size_t>(until));
    ASSERT_EQ(b.size(), static_cast<size_t>(until));
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].first, b[i].first);
      EXPECT_NEAR(a[i].second, b[i].second, 1e-5 * std::fabs(b[i].second)) << "step " << a[i].first;
    }
  }
}

namespace {

struct Mismatch {
  std::string name, rank0_sets, other_sets, says;
  bool echo_data = false;  // the config reads the test data plugin 'echo' (no `pattern` key)
};

}  // namespace

TEST(ReliabilityRanks, RanksWithDifferentConfigsOrPluginsStopAtStartUpNamingTheKeys) {
  const fs::path dir = fresh_dir("mpi_ranks");
  const fs::path cfg = write_config(dir, dir / "run", 4);
  const fs::path echo_cfg = dir / "echo.toml";
  {
    std::string text = read_text(cfg);
    text.replace(text.find("plugin = \"synthetic\"\npattern = \"ramp\""), 37, "plugin = \"echo\"");
    std::ofstream(echo_cfg) << text;
  }
  const std::string broken = LOOM_TEST_BROKEN_PLUGIN_DIR;
  const std::vector<Mismatch> cases = {
      {"learning rate", "", "--set train.lr=1e-3", "train.lr: rank 0 has 0.003, rank 1 has 0.001"},
      {"model shape", "", "--set model.hidden=128", "model.hidden: rank 0 has 64, rank 1 has 128"},
      {"strategy", "--set sharding.plugin=ddp", "--set sharding.plugin=zero2",
       "sharding.plugin: rank 0 has \"ddp\", rank 1 has \"zero2\""},
      // Only where the plugin is found differs (run.plugin_path is not compared): two builds of 'echo'.
      {"plugin version", "--set 'run.plugin_path=[\"" + broken + "/order_a\", \"" + LOOM_TEST_PLUGIN_DIR + "\"]'",
       "--set 'run.plugin_path=[\"" + broken + "/order_b\", \"" + LOOM_TEST_PLUGIN_DIR + "\"]'",
       "plugin data 'echo': rank 0 has version 1.0.0-a", true},
  };
  const std::string base = "--set sharding.plugin=ddp --set run.collective_timeout=120 ";
  for (const Mismatch& m : cases) {
    SCOPED_TRACE(m.name);
    const fs::path& c = m.echo_data ? echo_cfg : cfg;
    const std::string cmd = std::string(LOOM_MPIEXEC) + " --allow-run-as-root --oversubscribe -x OMP_NUM_THREADS=1 -np 1 " +
                            loom_train(c, base + m.rank0_sets) + " : -np 1 " +
                            loom_train(c, base + m.rank0_sets + " " + m.other_sets);
    const auto t0 = std::chrono::steady_clock::now();
    const ProcResult r = run_shell("timeout 300 " + cmd);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_CONTAINS(r.out, "ranks were not started with the same configuration and plugins");
    EXPECT_CONTAINS(r.out, m.says);
    EXPECT_FALSE(has(r.out, "MPI_ERR_TRUNCATE")) << r.out;
    EXPECT_LT(secs, 60.0) << "refused only after " << secs << " s (collective timeout 120 s)";
    EXPECT_FALSE(fs::exists(dir / "run" / "metrics.jsonl")) << "a step ran";
  }
}

// Four ranks, one of them different: that rank and that key are named, no other.
TEST(ReliabilityRanks, OneOddRankAmongFourIsNamed) {
  const fs::path dir = fresh_dir("mpi_ranks4");
  const fs::path cfg = write_config(dir, dir / "run", 4);
  const std::string same = loom_train(cfg, "--set sharding.plugin=ddp");
  const std::string odd = std::string(LOOM_MPIEXEC) + " --allow-run-as-root --oversubscribe -x OMP_NUM_THREADS=1 -np 3 " +
                          same + " : -np 1 " + loom_train(cfg, "--set sharding.plugin=ddp --set run.seed=99");
  const ProcResult r = run_shell("timeout 300 " + odd);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_CONTAINS(r.out, "run.seed: rank 0 has 7, rank 3 has 99");
  EXPECT_FALSE(has(r.out, "rank 1 has")) << r.out;
  EXPECT_FALSE(has(r.out, "rank 2 has")) << r.out;
}

// Pruning counts a checkpoint toward checkpoint.keep_last only when it
// validates as resuming validates it: every rank file meta.json lists, not
// rank 0's alone. A 2-rank checkpoint (zero3: each rank holds its own half)
// whose rank-1 file is damaged in any way — truncated, a header byte flipped,
// the file of another step, of another rank or of another run put in its
// place, removed — is left in place with a warning naming it, and takes no
// good checkpoint's place: with keep_last = 3 the three good ones stay.
TEST(ReliabilityCheckpointsMpi, PruningValidatesEveryRankFile) {
  const fs::path dir = fresh_dir("mpi_prune_ranks");
  const std::string sets = "--set sharding.plugin=zero3 --set checkpoint.every=2 --set checkpoint.keep_last=0";
  // The run (steps 2, 4, 6) and another run (seed 8) whose rank-1 file of step 4 is planted.
  for (const auto& [name, seed] : std::vector<std::pair<std::string, std::string>>{{"orig", "7"}, {"other", "8"}}) {
    fs::create_directories(dir / name);
    const fs::path cfg = write_config(dir / name, dir / name / "run", name == "orig" ? 6 : 4);
    const ProcResult r = run_shell("timeout 300 " + mpirun(2) + " " + loom_train(cfg, sets + " --set run.seed=" + seed));
    ASSERT_EQ(r.code, 0) << r.out;
  }
  const fs::path orig = dir / "orig" / "run" / "checkpoints";
  for (const char* s : {"step_00000002", "step_00000004", "step_00000006"})
    ASSERT_TRUE(fs::exists(orig / s / "rank_00001.bin")) << s;
  struct Damage {
    std::string name;
    std::function<void(const fs::path& step4)> apply;
  };
  const std::vector<Damage> damages = {
      {"truncated", [](const fs::path& s) { fs::resize_file(s / "rank_00001.bin", 100); }},
      {"a header byte flipped",
       [](const fs::path& s) {
         std::fstream f(s / "rank_00001.bin", std::ios::in | std::ios::out | std::ios::binary);
         f.seekg(40);
         char c = 0;
         f.read(&c, 1);
         c ^= 0x20;
         f.seekp(40);
         f.write(&c, 1);
       }},
      {"another step's file",
       [](const fs::path& s) {
         fs::copy_file(s.parent_path() / "step_00000002" / "rank_00001.bin", s / "rank_00001.bin",
                       fs::copy_options::overwrite_existing);
       }},
      {"another rank's file",
       [](const fs::path& s) { fs::copy_file(s / "rank_00000.bin", s / "rank_00001.bin", fs::copy_options::overwrite_existing); }},
      {"another run's file",
       [&](const fs::path& s) {
         fs::copy_file(dir / "other" / "run" / "checkpoints" / "step_00000004" / "rank_00001.bin", s / "rank_00001.bin",
                       fs::copy_options::overwrite_existing);
       }},
      {"removed", [](const fs::path& s) { fs::remove(s / "rank_00001.bin"); }},
  };
  for (size_t i = 0; i < damages.size(); ++i) {
    const Damage& d = damages[i];
    SCOPED_TRACE(d.name);
    const fs::path cdir = dir / ("case" + std::to_string(i));
    fs::create_directories(cdir);
    const fs::path root = cdir / "run" / "checkpoints";
    fs::create_directories(root);
    for (const char* s : {"step_00000002", "step_00000004", "step_00000006"})
      fs::copy(orig / s, root / s, fs::copy_options::recursive);
    d.apply(root / "step_00000004");
    const std::string damaged = fs::exists(root / "step_00000004" / "rank_00001.bin")
                                    ? read_text(root / "step_00000004" / "rank_00001.bin")
                                    : std::string("(none)");
    // Resume from step 6 (good) and save step 8: the save prunes with keep_last = 3.
    const fs::path cfg = write_config(cdir, cdir / "run", 8);
    const ProcResult r = run_shell("timeout 300 " + mpirun(2) + " " +
                                   loom_train(cfg, "--set sharding.plugin=zero3 --set checkpoint.every=2 "
                                                   "--set checkpoint.keep_last=3"));
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_CONTAINS(r.out, "resumed from " + (root / "step_00000006").string());
    // The damaged checkpoint is named, with its rank-1 file, and not counted.
    EXPECT_CONTAINS(r.out, "checkpoint " + (root / "step_00000004").string() + " is damaged (");
    EXPECT_CONTAINS(r.out, "rank_00001.bin");
    EXPECT_CONTAINS(r.out, "it does not count toward checkpoint.keep_last");
    // Three good checkpoints (2, 6, 8) stay; the damaged one is left as it was.
    for (const char* s : {"step_00000002", "step_00000004", "step_00000006", "step_00000008"})
      EXPECT_TRUE(fs::exists(root / s / "COMPLETE")) << s << "\n" << r.out;
    const std::string now = fs::exists(root / "step_00000004" / "rank_00001.bin")
                                ? read_text(root / "step_00000004" / "rank_00001.bin")
                                : std::string("(none)");
    EXPECT_TRUE(now == damaged) << "the damaged rank file was changed";
  }
}
