// What the FP8 tests compare between training runs that must compute the same
// bits (test_fp8_recipes, test_fp8_block and their GPU suites): the losses at
// every step and evaluation, and the precision recipe's state.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/run_config.hpp"
#include "loom/arena.hpp"
#include "train/session.hpp"

namespace loom::test {

// Every state tensor of the session's recipe, its bytes by name (host or
// device memory alike).
inline std::map<std::string, std::vector<char>> state_bytes(Session& s) {
  std::map<std::string, std::vector<char>> out;
  for (const StateTensor& t : s.precision().state_tensors()) {
    std::vector<char> b(t.tensor.bytes());
    if (t.tensor.device == Device::cpu) std::memcpy(b.data(), t.tensor.data, b.size());
    else s.backend().download(b.data(), t.tensor, b.size());
    out[t.name] = std::move(b);
  }
  return out;
}

// Two runs of `steps` steps: every training loss finite and bitwise the
// same, and the same validation losses at the same (at least one) evaluation.
inline void expect_same_losses(const RunSummary& a, const RunSummary& b, size_t steps) {
  ASSERT_EQ(a.steps.size(), steps);
  ASSERT_EQ(b.steps.size(), steps);
  for (size_t i = 0; i < steps; ++i) {
    EXPECT_TRUE(std::isfinite(a.steps[i].loss)) << "step " << i + 1;
    EXPECT_EQ(b.steps[i].loss, a.steps[i].loss) << "step " << i + 1;
  }
  ASSERT_EQ(a.val_losses.size(), b.val_losses.size());
  ASSERT_FALSE(a.val_losses.empty()) << "no evaluation to compare";
  for (size_t i = 0; i < a.val_losses.size(); ++i)
    EXPECT_EQ(b.val_losses[i].second, a.val_losses[i].second) << "evaluation at step " << a.val_losses[i].first;
}

// Trains config(mode) for precision.weight_cache "step", "layer" and "auto"
// (`steps` steps each): "layer" and "auto" must compute the bits of "step"
// (losses, validation losses and the recipe's state). Returns each mode's
// planned precision workspace in bytes.
inline std::map<std::string, size_t> weight_cache_modes_match(
    const std::function<Config(const std::string& mode)>& config, size_t steps) {
  std::map<std::string, RunSummary> runs;
  std::map<std::string, std::map<std::string, std::vector<char>>> states;
  std::map<std::string, size_t> ws;
  for (const std::string mode : {"step", "layer", "auto"}) {
    Session s(config(mode));
    runs[mode] = s.train();
    states[mode] = state_bytes(s);
    for (const ArenaBlock& b : s.memory_plan().blocks())
      if (b.name == "precision.workspace") ws[mode] = b.bytes;
  }
  for (const std::string mode : {"layer", "auto"}) {
    SCOPED_TRACE(mode);
    expect_same_losses(runs["step"], runs[mode], steps);
    EXPECT_EQ(states[mode], states["step"]) << "the recipe's state (scales, history, counters)";
  }
  return ws;
}

// `loom bench configs/bench/<config>.toml` (3 timed steps after 2 warm-up)
// in its own process, output under dir/name, with `extra` appended to the
// command (more --set flags); its --json report, or an empty object after a
// failure (reported with the command and its log).
inline nlohmann::json bench_json(const std::filesystem::path& dir, const std::string& config,
                                 const std::string& name, const std::string& extra = "") {
  const std::filesystem::path json = dir / (name + ".json"), log = dir / (name + ".log");
  const std::string cmd = std::string(LOOM_CLI) + " bench " +
                          (std::filesystem::path(LOOM_SOURCE_DIR) / "configs" / "bench" / (config + ".toml")).string() +
                          " --steps=3 --warmup=2 --json=" + json.string() + " --set run.out_dir=" +
                          (dir / name).string() + " --set run.plugin_path=[\\\"" + LOOM_TEST_PLUGIN_DIR + "\\\"]" +
                          extra + " > " + log.string() + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::stringstream ss;
  ss << std::ifstream(log).rdbuf();
  EXPECT_EQ(rc, 0) << cmd << "\n" << ss.str();
  if (rc != 0) return {};
  return nlohmann::json::parse(std::ifstream(json));
}

}  // namespace loom::test
