// Every shipped config parses and validates (the part that needs no GPU or
// data files): a typo in configs/ fails CI, not a user's first run.
#include <gtest/gtest.h>

#include <filesystem>

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
