// Every shipped config parses and validates (the part that needs no GPU or
// data files): a typo in configs/ fails CI, not a user's first run.
#include <gtest/gtest.h>

#include <filesystem>

#include "config/run_config.hpp"

namespace fs = std::filesystem;

TEST(ShippedConfigs, AllParse) {
  int n = 0;
  for (const auto& e : fs::recursive_directory_iterator(fs::path(LOOM_SOURCE_DIR) / "configs")) {
    if (e.path().extension() != ".toml") continue;
    SCOPED_TRACE(e.path().string());
    loom::Config c = loom::load_config(e.path(), {});
    EXPECT_FALSE(c.precision.plugin.empty());
    EXPECT_GE(c.train.steps, 1);
    ++n;
  }
  EXPECT_GE(n, 4);  // quickstart + the three bench workloads
}
