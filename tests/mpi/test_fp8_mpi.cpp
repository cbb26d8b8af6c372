// The FP8 recipes across ranks, run by mpirun on 2 and 4 ranks (CPU, MPI,
// emulated FP8): every rank ends every step with the same delayed scales and
// amax history, bitwise, because end_step max-reduces the one amax buffer
// over the data-parallel group — once per step — before the update. The ranks
// see different data, so their local amaxes differ (checked: without the
// reduction their scales would too). Current scaling takes x and dy scales
// from each rank's own tensors; its weight scales (the weights are replicated)
// agree.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "comm/mpi_communicator.hpp"
#include "config/run_config.hpp"
#include "loom/error.hpp"
#include "loom/fp8_scaling.hpp"
#include "train/session.hpp"

namespace {

std::unique_ptr<loom::Communicator> g_world;

loom::Config make_config(const std::string& precision, const std::string& strategy) {
  std::ostringstream t;
  t << "[run]\nname = \"fp8mpi\"\nout_dir = \"" << LOOM_BINARY_DIR << "/tests/mpi_runs/fp8\"\n"
    << "device = \"cpu\"\nseed = 13\nthreads = 1\nlog_level = \"warn\"\n"
    << "plugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nhidden = 64\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nffn_hidden = 160\n"
    << "vocab_size = 250\nmax_seq_len = 32\n"
    << "[train]\nsteps = 6\nmicro_batch = 2\nseq_len = 32\ngrad_accum = 2\nlr = 3e-3\nwarmup_steps = 2\n"
    << "[checkpoint]\nevery = 0\nresume = \"none\"\n"
    << "[precision]\n" << precision << "\n[attention]\nplugin = \"naive\"\n"
    << "[sharding]\nplugin = \"" << strategy << "\"\n[data]\nplugin = \"synthetic\"\n";
  return loom::parse_config_string(t.str(), "fp8_mpi.toml", {});
}

std::vector<float> state_of(loom::Session& s, const std::string& name) {
  for (const loom::StateTensor& t : s.precision().state_tensors())
    if (t.name == name) {
      const float* p = t.tensor.ptr<float>();
      return std::vector<float>(p, p + t.tensor.numel());
    }
  ADD_FAILURE() << "no state tensor " << name;
  return {};
}

// Every rank's copy of v, rank-major.
std::vector<float> gather(std::vector<float> v) {
  const int p = g_world->size();
  std::vector<float> all(v.size() * static_cast<size_t>(p));
  loom::Tensor in(v.data(), loom::DType::f32, loom::Device::cpu, {static_cast<int64_t>(v.size())});
  loom::Tensor out(all.data(), loom::DType::f32, loom::Device::cpu, {static_cast<int64_t>(all.size())});
  g_world->all_gather(loom::ExecContext{}, in, out);
  return all;
}

// Whether every rank holds the same elements at `index` (every index when empty), bitwise.
bool same_on_every_rank(const std::vector<float>& all, size_t n, const std::vector<size_t>& index = {}) {
  const int p = g_world->size();
  for (int r = 1; r < p; ++r)
    for (size_t i = 0; i < n; ++i) {
      if (!index.empty() && std::find(index.begin(), index.end(), i) == index.end()) continue;
      if (std::memcmp(&all[i], &all[static_cast<size_t>(r) * n + i], sizeof(float)) != 0) return false;
    }
  return true;
}

// All-reduce bytes per step of the same run under fp32 (the strategy's own traffic).
uint64_t fp32_all_reduce_bytes(const std::string& strategy) {
  loom::Session s(make_config("plugin = \"fp32\"", strategy));
  s.initialise();
  const auto k = static_cast<size_t>(loom::CollectiveKind::all_reduce);
  const uint64_t before = s.comm().bytes_moved().bytes[k];
  s.train_step();
  (void)s.read_step_logs();
  return s.comm().bytes_moved().bytes[k] - before;
}

void check_delayed(const std::string& strategy) {
  const uint64_t base = fp32_all_reduce_bytes(strategy);
  loom::Session s(make_config("plugin = \"fp8_delayed\"\namax_history_len = 3", strategy));
  s.initialise();
  for (int step = 1; step <= 6; ++step) {
    const loom::CommBytes before = s.comm().bytes_moved();
    s.train_step();
    (void)s.read_step_logs();
    const std::vector<float> scales = state_of(s, "fp8.scale"), hist = state_of(s, "fp8.amax_history");
    ASSERT_FALSE(scales.empty());
    EXPECT_TRUE(same_on_every_rank(gather(scales), scales.size())) << "scales differ across ranks after step " << step;
    EXPECT_TRUE(same_on_every_rank(gather(hist), hist.size())) << "amax history differs after step " << step;
    // The recipe adds exactly one all-reduce per step to the strategy's
    // traffic: one float per tensor, at the ring volume 2 (p - 1) / p per rank
    // (two would double it; one per micro-batch would too).
    const double p = g_world->size();
    const double amax_bytes = 2.0 * (p - 1) / p * 4.0 * static_cast<double>(scales.size());
    const auto k = static_cast<size_t>(loom::CollectiveKind::all_reduce);
    const double added = static_cast<double>(s.comm().bytes_moved().bytes[k] - before.bytes[k]) - static_cast<double>(base);
    EXPECT_NEAR(added, amax_bytes, 1.0) << "step " << step;
  }
  // The scales moved from TE's starting 1, and differ between tensors.
  const std::vector<float> scales = state_of(s, "fp8.scale");
  EXPECT_NE(*std::min_element(scales.begin(), scales.end()), *std::max_element(scales.begin(), scales.end()));
}

}  // namespace

TEST(Fp8Mpi, DelayedScalesAgreeUnderDdp) { check_delayed("ddp"); }
TEST(Fp8Mpi, DelayedScalesAgreeUnderZero3) { check_delayed("zero3"); }

// Current scaling: the weight scales agree (replicated weights); the x scales
// come from each rank's own data and do differ, which is also what shows that
// the ranks' local amaxes differ, so the agreement above is the reduction's.
TEST(Fp8Mpi, CurrentScalesFollowEachRanksData) {
  loom::Session s(make_config("plugin = \"fp8_current\"", "ddp"));
  s.initialise();
  for (int step = 1; step <= 3; ++step) {
    s.train_step();
    (void)s.read_step_logs();
  }
  const std::vector<float> scales = state_of(s, "fp8.scale");
  const std::vector<float> all = gather(scales);
  std::vector<size_t> w, x;
  for (size_t i = 0; i < scales.size(); ++i) {
    if (i % loom::fp8::kRolesPerLinear == static_cast<size_t>(loom::fp8::Role::w)) w.push_back(i);
    if (i % loom::fp8::kRolesPerLinear == static_cast<size_t>(loom::fp8::Role::x)) x.push_back(i);
  }
  EXPECT_TRUE(same_on_every_rank(all, scales.size(), w)) << "weight scales must agree";
  EXPECT_FALSE(same_on_every_rank(all, scales.size(), x)) << "x scales come from each rank's own batch";
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int rc = 1;
  try {
    g_world = loom::make_mpi_communicator(60.0);
    rc = RUN_ALL_TESTS();
    g_world->barrier();
    g_world.reset();
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "test_fp8_mpi: %s\n", e.what());
    loom::abort_all(2);
  }
  return rc;
}
