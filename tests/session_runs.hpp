// What tests compare between training runs that must compute the same bits
// (test_fp8_recipes, test_fp8_block and their GPU suites, test_train_e2e,
// test_moe_train): the losses at every step and evaluation, the precision
// recipe's state, and runs whose gradients were poisoned between steps.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
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
#include "train/session_probe.hpp"

namespace loom::test {

// Every state tensor of the session's recipe, its bytes by name (host or
// device memory alike).
inline std::map<std::string, std::vector<char>> state_bytes(Session& s) {
  std::map<std::string, std::vector<char>> out;
  for (const StateTensor& t : loom::probe(s).precision().state_tensors()) {
    std::vector<char> b(t.tensor.bytes());
    if (t.tensor.device == Device::cpu) std::memcpy(b.data(), t.tensor.data, b.size());
    else loom::probe(s).backend().download(b.data(), t.tensor, b.size());
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

// Nothing zeroes the gradients between steps: the first micro-batch of a
// step writes every parameter gradient (BlockEnv::first_micro). Trains
// `config` for `steps` steps twice, the second time with every parameter's
// gradient set to 0xFF bytes (NaN in fp32 and bf16) before each step: a
// gradient that a step accumulated onto instead of writing would carry the
// NaN into the norm and the update. (A unit's own padding is not poisoned: no
// kernel writes it, it stays zero from the arena's allocation, and a sharding
// strategy may reduce it with the rest. A buffer the strategy lends for one
// backward, UnitState::grads_fresh, is poisoned whole, padding included: the
// strategy zeroes that padding, the backward writes the rest, nothing clears
// it.) The two runs must log bitwise the same losses and gradient norms, all
// finite. Any strategy, any world.
inline void stale_gradients_are_overwritten(const Config& config, int64_t steps) {
  std::vector<StepLog> logs[2];
  for (int poison = 0; poison < 2; ++poison) {
    Session s(config);
    s.initialise();
    for (int64_t i = 0; i < steps; ++i) {
      if (poison) {
        loom::probe(s).backend().synchronize();  // the last step's optimizer has read them
        for (UnitState& u : loom::probe(s).units()) {
          if (u.grads.data == nullptr) continue;
          // The parameters' elements (an experts unit holds this rank's range
          // only); a lent buffer whole (the units take turns with the strategy's
          // buffers, so every one of them is poisoned).
          const int64_t n = u.grads_fresh ? u.grads.numel() : std::min<int64_t>(u.info->numel, u.grads.numel());
          Tensor g = view(u.grads, 0, {n});
          const std::vector<unsigned char> ff(g.bytes(), 0xFF);
          if (g.device == Device::cpu) std::memcpy(g.data, ff.data(), ff.size());
          else loom::probe(s).backend().upload(g, ff.data(), ff.size());
        }
      }
      s.train_step();
    }
    logs[poison] = s.read_step_logs();
  }
  ASSERT_EQ(logs[0].size(), static_cast<size_t>(steps));
  ASSERT_EQ(logs[1].size(), static_cast<size_t>(steps));
  for (size_t i = 0; i < logs[0].size(); ++i) {
    EXPECT_TRUE(std::isfinite(logs[0][i].loss) && std::isfinite(logs[0][i].grad_norm)) << "step " << i + 1;
    EXPECT_EQ(logs[1][i].loss, logs[0][i].loss) << "step " << i + 1;
    EXPECT_EQ(logs[1][i].grad_norm, logs[0][i].grad_norm) << "step " << i + 1;
    EXPECT_FALSE(logs[1][i].skipped) << "step " << i + 1;
  }
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
    for (const ArenaBlock& b : loom::probe(s).memory_plan().blocks())
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
