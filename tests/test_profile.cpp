// [profile]: the trace of a window of steps (train/profiler.hpp) on the CPU
// reference path, checked by tests/trace/check_trace.py (nesting, layers,
// totals against metrics.jsonl's step_ms); profiling changes no result and
// records nothing outside its window; bad [profile] values are refused.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "config/run_config.hpp"
#include "loom/trace.hpp"
#include "test_util.hpp"
#include "train/session_probe.hpp"

namespace fs = std::filesystem;
using loom::test::expect_error;
using loom::test::TmpDir;

namespace {

std::string config(const fs::path& out, const std::string& extra) {
  std::ostringstream s;
  s << "[run]\nname = \"prof\"\nout_dir = \"" << out.string() << "\"\nseed = 3\nthreads = 2\n"
    << "plugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nhidden = 64\nnum_layers = 3\nnum_heads = 4\nnum_kv_heads = 2\nffn_hidden = 128\n"
    << "vocab_size = 96\nmax_seq_len = 32\n"
    << "[train]\nsteps = 6\nmicro_batch = 2\nseq_len = 32\ngrad_accum = 2\nvalidation_every = 3\nvalidation_batches = 1\n"
    << "[checkpoint]\nresume = \"none\"\n[data]\nplugin = \"synthetic\"\n"
    << extra;
  return s.str();
}

}  // namespace

TEST(Profile, TraceOfTheWindowNestsAndAddsUpToTheSteps) {
  TmpDir d;
  loom::RunSummary with, without;
  {
    loom::Session s(loom::parse_config_string(config(d.path / "p", "[profile]\nsteps = [2, 4]\ntrace = true\n"), "p.toml", {}));
    with = s.train();
    EXPECT_EQ(loom::trace::sink(), nullptr);  // the window closed
  }
  {
    loom::Session s(loom::parse_config_string(config(d.path / "q", ""), "q.toml", {}));
    without = s.train();
  }
  ASSERT_EQ(with.steps.size(), without.steps.size());
  for (size_t i = 0; i < with.steps.size(); ++i) EXPECT_EQ(with.steps[i].loss, without.steps[i].loss) << i;

  const fs::path trace = d.path / "p" / "trace" / "rank_0.json";
  ASSERT_TRUE(fs::exists(trace));
  std::ifstream in(trace);
  const auto j = nlohmann::json::parse(in);
  // Only the window's steps are in it.
  std::set<int64_t> steps;
  for (const auto& e : j["traceEvents"])
    if (e["ph"] == "X") steps.insert(e["args"]["step"].get<int64_t>());
  EXPECT_EQ(steps, (std::set<int64_t>{2, 3, 4}));
  // Every op has its range, backward and optimizer included.
  std::set<std::string> names;
  for (const auto& e : j["traceEvents"])
    if (e["ph"] == "X") names.insert(e["name"].get<std::string>());
  for (const char* op : {"rmsnorm", "qkv", "rope", "attention", "o_proj+residual", "gate_up", "swiglu", "down+residual",
                         "lm_head", "cross_entropy", "lm_head.grad", "down.grad", "swiglu.grad", "gate_up.grad",
                         "rmsnorm.grad", "o_proj.grad", "attention.grad", "rope.grad", "qkv.grad", "grad_norm", "clip",
                         "adamw"})
    EXPECT_TRUE(names.count(op)) << "no '" << op << "' range in the trace";
  const std::string cmd = loom::cat("python3 ", LOOM_SOURCE_DIR, "/tests/trace/check_trace.py ", trace.string(), " ",
                                    (d.path / "p" / "metrics.jsonl").string(), " > ", (d.path / "check.txt").string(), " 2>&1");
  const int rc = std::system(cmd.c_str());
  std::ifstream c(d.path / "check.txt");
  const std::string out((std::istreambuf_iterator<char>(c)), std::istreambuf_iterator<char>());
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("trace OK"), std::string::npos) << out;
}

TEST(Profile, CheckerRejectsABrokenTrace) {
  // The checker itself must be able to fail: a child that outlives its step.
  TmpDir d;
  nlohmann::json ev = nlohmann::json::array();
  for (int t = 1; t <= 4; ++t) ev.push_back({{"ph", "M"}, {"pid", 0}, {"tid", t}, {"name", "thread_name"}, {"args", {{"name", "x"}}}});
  ev.push_back({{"name", "step"}, {"ph", "X"}, {"ts", 0}, {"dur", 1000}, {"pid", 0}, {"tid", 1}, {"args", {{"step", 1}}}});
  ev.push_back({{"name", "forward.layer.0"}, {"ph", "X"}, {"ts", 500}, {"dur", 800}, {"pid", 0}, {"tid", 1}, {"args", {{"step", 1}}}});
  nlohmann::json doc = {{"traceEvents", ev}, {"otherData", {{"loom_steps", {1, 1}}}}};
  std::ofstream(d.path / "t.json") << doc.dump();
  std::ofstream(d.path / "m.jsonl") << "{\"step\": 1, \"step_ms\": 5.0}\n";
  const std::string cmd = loom::cat("python3 ", LOOM_SOURCE_DIR, "/tests/trace/check_trace.py ", (d.path / "t.json").string(),
                                    " ", (d.path / "m.jsonl").string(), " > ", (d.path / "o.txt").string(), " 2>&1");
  EXPECT_NE(std::system(cmd.c_str()), 0);
  std::ifstream c(d.path / "o.txt");
  const std::string out((std::istreambuf_iterator<char>(c)), std::istreambuf_iterator<char>());
  EXPECT_NE(out.find("overlaps the end of step"), std::string::npos) << out;
  EXPECT_NE(out.find("step_ms = 5.000"), std::string::npos) << out;
  EXPECT_NE(out.find("no backward.layer.0"), std::string::npos) << out;
  EXPECT_NE(out.find("no adamw range in steps [1]"), std::string::npos) << out;
}

TEST(Profile, TheWindowAddsOnlyItsTwoWaits) {
  // The whole run's host synchronisations with a traced window, against none:
  // exactly two more (opening and closing the window), so no step outside it waits.
  TmpDir d;
  auto syncs = [&](const std::string& name, const std::string& extra) {
    loom::Session s(loom::parse_config_string(config(d.path / name, extra), name, {"train.log_every=3"}));
    s.train();
    return loom::probe(s).host_syncs();
  };
  const int64_t plain = syncs("a", ""), traced = syncs("b", "[profile]\nsteps = [2, 3]\ntrace = true\n");
  EXPECT_EQ(traced - plain, 2);
  EXPECT_EQ(syncs("c", "[profile]\nsteps = [2, 3]\n") - plain, 0);  // nsys window only: no wait at all
}

TEST(Profile, ConfigChecks) {
  auto parse = [](const std::string& extra) {
    return loom::parse_config_string("[train]\nsteps = 10\n" + extra, "p.toml", {});
  };
  auto c = parse("[profile]\nsteps = [3, 5]\ntrace = true\n");
  EXPECT_EQ(c.profile.start, 3);
  EXPECT_EQ(c.profile.stop, 5);
  EXPECT_TRUE(c.profile.trace);
  expect_error([&] { parse("[profile]\nsteps = [5, 3]\n"); }, {"p.toml:4", "profile.steps must be [start, stop]"});
  expect_error([&] { parse("[profile]\nsteps = [4]\n"); }, {"profile.steps must be [start, stop]"});
  expect_error([&] { parse("[profile]\nsteps = [0, 3]\n"); }, {"profile.steps[0] = 0 is out of range"});
  expect_error([&] { parse("[profile]\nsteps = [8, 12]\n"); }, {"ends after train.steps = 10"});
  expect_error([&] { parse("[profile]\ntrace = true\n"); }, {"profile.trace = true needs profile.steps"});
  expect_error([&] { parse("[profile]\nstep = [1, 2]\n"); }, {"unknown key 'profile.step'", "did you mean 'steps'"});
}

TEST(Profile, TraceGapsReportsOpsAndIdleTimeOfAKnownTrace) {
  // benchmarks/trace_gaps.py on a trace whose times are known (microseconds):
  // two forward layers of 100 with 10 idle inside each and 20 between them,
  // 30 before the backward, two backward layers with 40 between them, 25 of
  // it in the sharding's after_backward hook, an all-gather of 50 on the comm
  // stream and an accumulate of 30 on the optimizer stream.
  TmpDir d;
  nlohmann::json ev = nlohmann::json::array();
  const char* threads[] = {"compute stream", "comm stream (NCCL)", "host", "optimizer stream"};
  for (int t = 1; t <= 4; ++t)
    ev.push_back({{"ph", "M"}, {"pid", 0}, {"tid", t}, {"name", "thread_name"}, {"args", {{"name", threads[t - 1]}}}});
  struct Range {
    const char* name;
    int tid;
    double ts, dur;
  };
  const Range ranges[] = {
      {"step", 1, 0, 1000},           {"forward.layer.0", 1, 10, 100},  {"qkv", 1, 10, 50},
      {"attention", 1, 70, 40},       {"forward.layer.1", 1, 130, 100}, {"qkv", 1, 130, 60},
      {"attention", 1, 200, 30},      {"backward.layer.1", 1, 260, 200}, {"attention.grad", 1, 260, 200},
      {"backward.layer.0", 1, 500, 200}, {"attention.grad", 1, 500, 200}, {"all_gather", 2, 0, 50},
      {"sharding.after_backward", 1, 462, 25}, {"accumulate", 4, 470, 30}};
  for (const Range& r : ranges)
    ev.push_back({{"name", r.name}, {"ph", "X"}, {"ts", r.ts}, {"dur", r.dur}, {"pid", 0}, {"tid", r.tid},
                  {"args", {{"step", 1}}}});
  std::ofstream(d.path / "t.json") << nlohmann::json({{"traceEvents", ev}}).dump();
  const std::string cmd = loom::cat("python3 ", LOOM_SOURCE_DIR, "/benchmarks/trace_gaps.py ", (d.path / "t.json").string(),
                                    " > ", (d.path / "o.txt").string(), " 2>&1");
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  std::ifstream c(d.path / "o.txt");
  const std::string out((std::istreambuf_iterator<char>(c)), std::istreambuf_iterator<char>());
  for (const char* line : {"forward: 2 layer calls, median 0.100 ms a layer, 0.2 ms in all; idle inside a layer: median 0.010 ms",
                           "| qkv | 2 | 0.055 | 0.1 |", "| attention | 2 | 0.035 | 0.1 |",
                           "backward: 2 layer calls, median 0.200 ms a layer",
                           "| forward.layer.N -> forward.layer.N | 1 | 0.020 | 0.0 |",
                           "| forward.layer.N -> backward.layer.N | 1 | 0.030 | 0.0 |",
                           "| backward.layer.N -> backward.layer.N | 1 | 0.040 | 0.0 |",
                           "(9.0% of the window)", "| all_gather | 1 | 0.050 | 0.1 |",
                           "| backward.layer.N -> backward.layer.N | sharding.after_backward | 0.025 | 0.0 |",
                           "| accumulate | 1 | 0.030 | 0.0 |"})
    EXPECT_NE(out.find(line), std::string::npos) << "no '" << line << "' in:\n" << out;
}
