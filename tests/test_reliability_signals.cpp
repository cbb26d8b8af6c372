// Signals (docs/RELIABILITY.md "Signals"): SIGTERM, SIGINT, SIGHUP and
// run.stop_signal (SIGUSR1 by default) stop `loom train` after the current
// step with a checkpoint, a message naming the signal and exit code 128 + its
// number; the resumed run continues with the losses of an uninterrupted run
// (1e-5 relative: on one machine and thread count they are bitwise equal); a
// second signal stops at once, without a checkpoint, and the last complete one
// stays usable. The multi-rank case (every rank stops at the same step) is
// tests/mpi/test_reliability_mpi.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <chrono>
#include <csignal>
#include <thread>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "config/run_config.hpp"
#include "reliability_util.hpp"
#include "train/session.hpp"
#include "train/stop_signal.hpp"

namespace fs = std::filesystem;
using namespace loom::test;

namespace {

std::string cli(const fs::path& cfg, const std::string& sets = "") {
  return std::string("'") + LOOM_CLI + "' train '" + cfg.string() + "' " + sets;
}

// (step, loss) of every step line of a metrics.jsonl.
std::vector<std::pair<int64_t, double>> metric_losses(const fs::path& file) {
  std::vector<std::pair<int64_t, double>> out;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out.emplace_back(j["step"].get<int64_t>(), j["loss"].get<double>());
  }
  return out;
}

struct Stopped {
  ProcResult r;
  int64_t step = 0;  // the step the run stopped after
};

// Starts a long run, sends `sig` once a few steps are in metrics.jsonl, waits.
Stopped stop_with(const fs::path& dir, int sig, const std::string& sets = "") {
  const fs::path cfg = dir / "run.toml";
  std::ofstream(cfg) << tiny_config(dir / "run", 100000);
  Background p(cli(cfg, sets), dir / "log.txt");
  EXPECT_TRUE(wait_for([&] { return count_lines(dir / "run" / "metrics.jsonl") >= 5; }, 120))
      << p.output();
  p.signal(sig);
  Stopped s;
  s.r = p.wait(120);
  const auto losses = metric_losses(dir / "run" / "metrics.jsonl");
  s.step = losses.empty() ? 0 : losses.back().first;
  return s;
}

}  // namespace

// Each signal a job scheduler or a user sends: checkpoint, message, exit code.
TEST(ReliabilitySignals, EveryStopSignalWritesACheckpointAndNamesTheSignal) {
  const std::vector<std::pair<int, std::string>> cases = {
      {SIGTERM, "SIGTERM"}, {SIGINT, "SIGINT"}, {SIGHUP, "SIGHUP"}, {SIGUSR1, "SIGUSR1"}};
  for (const auto& [sig, name] : cases) {
    SCOPED_TRACE(name);
    const fs::path dir = fresh_dir("signal_" + name);
    const Stopped s = stop_with(dir, sig, "--set train.log_every=1");
    EXPECT_EQ(s.r.signal, 0) << "killed by the signal instead of stopping:\n" << s.r.out;
    EXPECT_EQ(s.r.code, 128 + sig) << s.r.out;
    EXPECT_CONTAINS(s.r.out, name + " received");
    EXPECT_CONTAINS(s.r.out, "stopped by " + name + " after step " + std::to_string(s.step));
    // The stop step's checkpoint, complete; metrics hold exactly the steps done.
    const fs::path ck = dir / "run" / "checkpoints" / loom::ckpt::step_dir_name(s.step);
    EXPECT_TRUE(fs::exists(ck / "COMPLETE")) << s.r.out;
    EXPECT_EQ(count_lines(dir / "run" / "metrics.jsonl"), s.step);
  }
}

// run.stop_signal = "USR2" adds SIGUSR2; "none" leaves SIGUSR1 its default
// action (the process ends by the signal, as before this feature).
TEST(ReliabilitySignals, StopSignalIsConfigurable) {
  {
    const fs::path dir = fresh_dir("signal_usr2");
    const Stopped s = stop_with(dir, SIGUSR2, "--set run.stop_signal=USR2");
    EXPECT_EQ(s.r.code, 128 + SIGUSR2) << s.r.out;
    EXPECT_CONTAINS(s.r.out, "stopped by SIGUSR2");
  }
  {
    const fs::path dir = fresh_dir("signal_none");
    const Stopped s = stop_with(dir, SIGUSR1, "--set run.stop_signal=none");
    EXPECT_EQ(s.r.signal, SIGUSR1) << s.r.out;
  }
}

// The checkpoint a signal leaves resumes into the uninterrupted run's losses.
TEST(ReliabilitySignals, ResumeAfterASignalContinuesTheUninterruptedLosses) {
  const fs::path dir = fresh_dir("signal_resume");
  const Stopped s = stop_with(dir, SIGTERM, "--set train.log_every=1");
  ASSERT_EQ(s.r.code, 128 + SIGTERM) << s.r.out;
  ASSERT_GT(s.step, 0);
  const int64_t extra = 12, until = s.step + extra;
  // The interrupted run, resumed in-process for `extra` more steps.
  const std::string text = tiny_config(dir / "run", 100000);
  loom::RunSummary resumed;
  {
    loom::Session sess(loom::parse_config_string(text, "run.toml", {}));
    resumed = sess.train(until);
  }
  ASSERT_EQ(resumed.first_step, s.step);
  ASSERT_EQ(static_cast<int64_t>(resumed.steps.size()), extra);
  // The same run uninterrupted (constant learning rate: train.steps does not change it).
  loom::RunSummary ref;
  {
    loom::Session sess(loom::parse_config_string(tiny_config(dir / "reference", 100000), "ref.toml", {}));
    ref = sess.train(until);
  }
  ASSERT_EQ(static_cast<int64_t>(ref.steps.size()), until);
  // The steps before the signal agree too (what metrics.jsonl recorded).
  const auto before = metric_losses(dir / "run" / "metrics.jsonl");
  for (const auto& [step, loss] : before)
    if (step <= s.step) EXPECT_NEAR(loss, ref.steps[static_cast<size_t>(step - 1)].loss, 1e-5 * std::fabs(loss)) << step;
  for (int64_t i = 0; i < extra; ++i) {
    const double want = ref.steps[static_cast<size_t>(s.step + i)].loss;
    EXPECT_NEAR(resumed.steps[static_cast<size_t>(i)].loss, want, 1e-5 * std::fabs(want)) << "step " << s.step + i + 1;
  }
}

// A second signal ends the process at once; no new checkpoint, the old ones intact.
TEST(ReliabilitySignals, SecondSignalStopsAtOnce) {
  const fs::path dir = fresh_dir("signal_twice");
  const fs::path cfg = dir / "run.toml";
  // Steps of about a second (a wider model, longer sequences), so that both
  // signals arrive within one step.
  std::ofstream(cfg) << tiny_config(dir / "run", 100000);
  const std::string sets =
      "--set model.hidden=256 --set model.ffn_hidden=768 --set model.num_layers=4 --set model.max_seq_len=256 "
      "--set train.seq_len=255 --set train.micro_batch=8 --set train.grad_accum=1 --set checkpoint.every=1";
  Background p(cli(cfg, sets), dir / "log.txt");
  ASSERT_TRUE(wait_for([&] { return fs::exists(dir / "run" / "checkpoints" / "step_00000001" / "COMPLETE"); }, 300))
      << p.output();
  p.signal(SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  p.signal(SIGINT);
  const ProcResult r = p.wait(120);
  EXPECT_EQ(r.code, 128 + SIGINT) << r.out;
  EXPECT_CONTAINS(r.out, "SIGTERM received");
  EXPECT_CONTAINS(r.out, "SIGINT received again: stopping at once, without a checkpoint");
  // Every checkpoint left is complete and loads.
  const auto cks = loom::ckpt::list_checkpoints((dir / "run" / "checkpoints").string());
  ASSERT_FALSE(cks.empty());
  const auto newest = loom::ckpt::latest_complete((dir / "run" / "checkpoints").string());
  ASSERT_TRUE(newest.has_value());
  EXPECT_NO_THROW(loom::ckpt::CheckpointReader(newest->dir, 0));
}

// The handlers live as long as the run: before and after it, the previous ones are in place.
TEST(ReliabilitySignals, HandlersAreRestoredAfterTheRun) {
  struct sigaction before {}, after {};
  ::sigaction(SIGTERM, nullptr, &before);
  {
    loom::StopSignals s("USR1");
    struct sigaction during {};
    ::sigaction(SIGTERM, nullptr, &during);
    EXPECT_NE(during.sa_handler, before.sa_handler);
  }
  ::sigaction(SIGTERM, nullptr, &after);
  EXPECT_EQ(after.sa_handler, before.sa_handler);
  EXPECT_EQ(loom::stop_signal_number("USR2"), SIGUSR2);
  EXPECT_EQ(loom::stop_signal_number("none"), 0);
}

// A stop signal during start-up (loom train listens from the moment its
// config is read) ends the run at once — no step has run, nothing is lost —
// saying so, with exit code 128 + the signal's number and no checkpoint: also
// when start-up is blocked where a handler does not interrupt it (a read the
// kernel restarts after the handler, a library initialiser that waits on).
TEST(ReliabilitySignals, SignalDuringStartUpStopsBeforeTheFirstStep) {
  const fs::path broken(LOOM_TEST_BROKEN_PLUGIN_DIR);
  const std::vector<std::pair<std::string, fs::path>> blocked = {
      {"block", broken / "blocking" / "libloom-data-block.so"},  // read() on a pipe nobody writes
      {"hang", broken / "misbehave" / "libloom-data-hang.so"},   // pause() in a loop
  };
  for (const auto& [name, file] : blocked)
    for (const int sig : {SIGTERM, SIGINT, SIGHUP, SIGUSR1}) {
      SCOPED_TRACE(name + " " + loom::signal_name(sig));
      const fs::path dir = fresh_dir("signal_startup_" + name + std::to_string(sig));
      const fs::path cfg = dir / "run.toml";
      std::ofstream(cfg) << tiny_config(dir / "run", 10);
      Background p(cli(cfg, "--set checkpoint.every=1 --set data.plugin=" + name + " --set 'data.path=\"" +
                                file.string() + "\"'"),
                   dir / "log.txt");
      // The lock is taken after the handlers are installed; then start-up goes on to load the plugin, and blocks.
      ASSERT_TRUE(wait_for([&] { return fs::exists(dir / "run" / ".loom.lock"); }, 60)) << p.output();
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      p.signal(sig);
      const auto sent = std::chrono::steady_clock::now();
      const ProcResult r = p.wait(10);
      EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - sent).count(), 5.0);
      EXPECT_EQ(r.signal, 0) << r.out;
      EXPECT_EQ(r.code, 128 + sig) << r.out;
      EXPECT_CONTAINS(r.out, loom::signal_name(sig) + " received during start-up, before the first step: stopping now");
      EXPECT_TRUE(loom::ckpt::list_checkpoints((dir / "run" / "checkpoints").string()).empty());
      EXPECT_EQ(count_lines(dir / "run" / "metrics.jsonl"), 0);
    }
}
