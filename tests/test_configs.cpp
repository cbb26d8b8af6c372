// Every shipped config parses and validates (the part that needs no GPU or
// data files): a typo in configs/ fails CI, not a user's first run.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>

#include "config/run_config.hpp"
#include "loom/error.hpp"

namespace fs = std::filesystem;

TEST(ShippedConfigs, AllParse) {
  int n = 0;
  for (const auto& e : fs::recursive_directory_iterator(fs::path(LOOM_SOURCE_DIR) / "configs")) {
    if (e.path().extension() != ".toml") continue;
    SCOPED_TRACE(e.path().string());
    // Mixture-of-experts GPU configs (mixtral-8x7b, bench/mixtral-small) parse as they are.
    loom::Config c = loom::load_config(e.path(), {});
    EXPECT_FALSE(c.precision.plugin.empty());
    EXPECT_GE(c.train.steps, 1);
    ++n;
  }
  EXPECT_GE(n, 6);  // quickstart, the bench workloads (mixtral-small among them), mixtral-8x7b
}

// Mixtral 8x7B's published sizes: 46.7B parameters, 12.9B active per token.
TEST(ShippedConfigs, Mixtral8x7bCountsActiveAndTotalParameters) {
  const loom::Config c =
      loom::load_config(fs::path(LOOM_SOURCE_DIR) / "configs" / "mixtral-8x7b.toml", {"run.device=\"cpu\""});
  const loom::ModelSpec& s = c.model.spec;
  ASSERT_TRUE(s.moe());
  EXPECT_EQ(s.num_experts, 8);
  EXPECT_EQ(s.top_k, 2);
  EXPECT_EQ(s.total_params(), 46702792704);
  EXPECT_EQ(s.active_params(), 12879925248);
  // MFU counts the active matmul weights: the router and 2 of 8 experts per layer.
  EXPECT_EQ(s.matmul_params(), s.active_params() - 32000 * 4096 - 4096 - 32 * 2 * 4096);
  EXPECT_GT(s.total_flops_per_token(4096), 3.4 * s.flops_per_token(4096));
}

// The convergence comparisons (README "Native against fused layers", "FP8
// recipes") mean something only while each pair differs in the one setting
// under test: an lr or data change made to one file and not its partner would
// compare two trainings instead of two layer or precision variants. Every
// non-comment line, keyed by its [section], must match the reference file's,
// except the run's name and output folder and the allowed `section.key`s.
namespace {

std::map<std::string, std::string> config_lines(const fs::path& p) {
  std::ifstream in(p);
  EXPECT_TRUE(in.good()) << p;
  std::map<std::string, std::string> out;
  std::string section, line;
  auto trim = [](std::string s) {
    const auto b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t\r");
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
  };
  while (std::getline(in, line)) {
    if (const auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    line = trim(line);
    if (line.empty()) continue;
    if (line.front() == '[') {
      section = line;
      continue;
    }
    const auto eq = line.find('=');
    EXPECT_NE(eq, std::string::npos) << p << ": " << line;
    if (eq == std::string::npos) continue;
    out[section + trim(line.substr(0, eq))] = trim(line.substr(eq + 1));
  }
  return out;
}

void expect_differ_only_in(const std::string& ref, const std::string& other, const std::set<std::string>& allowed) {
  SCOPED_TRACE(ref + " vs " + other);
  const fs::path dir = fs::path(LOOM_SOURCE_DIR) / "configs" / "convergence";
  const auto a = config_lines(dir / ref), b = config_lines(dir / other);
  ASSERT_GT(a.size(), 20u);  // the files were read
  std::set<std::string> keys;
  for (const auto& [k, v] : a) keys.insert(k);
  for (const auto& [k, v] : b) keys.insert(k);
  int differing = 0;
  for (const std::string& k : keys) {
    const auto ia = a.find(k), ib = b.find(k);
    const bool same = ia != a.end() && ib != b.end() && ia->second == ib->second;
    if (same) continue;
    ++differing;
    EXPECT_TRUE(allowed.count(k) || k == "[run]name" || k == "[run]out_dir")
        << k << ": " << (ia == a.end() ? "(absent)" : ia->second) << " vs " << (ib == b.end() ? "(absent)" : ib->second);
  }
  EXPECT_GE(differing, 3) << "the pair should differ in name, out_dir and the setting under test";
}

}  // namespace

TEST(ShippedConfigs, ConvergencePairsDifferOnlyInTheSettingUnderTest) {
  expect_differ_only_in("fortunes-native.toml", "fortunes-fused.toml", {"[model]layers"});
  expect_differ_only_in("fortunes-fused.toml", "fortunes-fp8-delayed.toml", {"[precision]plugin"});
  expect_differ_only_in("fortunes-fused.toml", "fortunes-fp8-current.toml", {"[precision]plugin"});
}
