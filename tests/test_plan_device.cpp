// `loom check` plans a CUDA run for a GPU it cannot see (--gpu NAME,
// --device-memory SIZE, --world-size N): the sizes a user writes, the cards
// it knows, the refusals (each one message naming the flag and what to
// write), and the plan it prints — the arena plus what the process holds
// beyond it — with whether it fits. Runs on a machine without a GPU: nothing
// of the planned run touches a device.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <utility>

#include "test_util.hpp"
#include "train/memory_budget.hpp"

namespace fs = std::filesystem;

namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20, kGiB = uint64_t{1} << 30;

// `loom check ARGS`: exit status and everything it printed.
std::pair<int, std::string> check(const std::string& args) {
  // One folder per test: ctest runs this suite's tests as parallel processes.
  const std::string test = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  const fs::path d = loom::test::temp_dir("plan_device_cli_" + test);
  const fs::path out = d / "out.txt";
  const std::string cmd = std::string(LOOM_CLI) + " check " + args + " > " + out.string() + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream in(out);
  std::stringstream ss;
  ss << in.rdbuf();
  return {rc, ss.str()};
}

std::string bench(const std::string& name) {
  return (fs::path(LOOM_SOURCE_DIR) / "configs" / "bench" / (name + ".toml")).string();
}

// The "per rank in all" and arena "total" figures a plan prints, in MiB.
double in_all_mib(const std::string& text) {
  std::smatch m;
  if (!std::regex_search(text, m, std::regex("per rank in all: ([0-9.]+) (GiB|MiB)"))) return -1;
  return std::stod(m[1]) * (m[2] == "GiB" ? 1024.0 : 1.0);
}
double arena_mib(const std::string& text) {
  std::smatch m;
  if (!std::regex_search(text, m, std::regex("\\n  total +([0-9.]+) MiB"))) return -1;
  return std::stod(m[1]);
}

}  // namespace

TEST(PlanDevice, SizesAsUsersWriteThem) {
  EXPECT_EQ(loom::parse_memory_size("80GiB", "--device-memory"), 80 * kGiB);
  EXPECT_EQ(loom::parse_memory_size("80gib", "--device-memory"), 80 * kGiB);
  EXPECT_EQ(loom::parse_memory_size("81559MiB", "--device-memory"), 81559 * kMiB);
  EXPECT_EQ(loom::parse_memory_size("141GB", "--device-memory"), uint64_t{141000000000});
  EXPECT_EQ(loom::parse_memory_size("1.5TiB", "--device-memory"), 1536 * kGiB);
  EXPECT_EQ(loom::parse_memory_size("85899345920", "--device-memory"), 80 * kGiB);
  EXPECT_EQ(loom::parse_memory_size("80 GiB", "--device-memory"), 80 * kGiB);
  // Not a unit, not a number, nothing, and sizes no GPU has: one message each, naming the flag and the text.
  loom::test::expect_error([] { loom::parse_memory_size("80XB", "--device-memory"); },
                           {"--device-memory 80XB", "'XB' is not a unit of memory", "80GiB", "KiB, MiB, GiB, TiB"});
  loom::test::expect_error([] { loom::parse_memory_size("GiB", "--device-memory"); },
                           {"--device-memory GiB", "does not start with a number"});
  loom::test::expect_error([] { loom::parse_memory_size("", "--device-memory"); }, {"does not start with a number"});
  loom::test::expect_error([] { loom::parse_memory_size("-80GiB", "--device-memory"); },
                           {"does not start with a number"});
  loom::test::expect_error([] { loom::parse_memory_size("1.2.3GiB", "--device-memory"); },
                           {"does not start with a number"});
  loom::test::expect_error([] { loom::parse_memory_size("80", "--device-memory"); },
                           {"--device-memory 80 is 80 bytes", "between 1 GiB and 1 PiB", "did you mean 80GiB?"});
  loom::test::expect_error([] { loom::parse_memory_size("2PiB", "--device-memory"); }, {"'PiB' is not a unit"});
  loom::test::expect_error([] { loom::parse_memory_size("2048TiB", "--device-memory"); }, {"between 1 GiB and 1 PiB"});
  // "Did you mean NGiB" only where N GiB is a card's memory: not for a unit
  // that was written, nor for a number that is out of range in GiB too.
  for (const char* text : {"0", "0.5", "80MiB", "2048TiB", "1048577", "18446744073709551616"}) {
    SCOPED_TRACE(text);
    try {
      loom::parse_memory_size(text, "--device-memory");
      ADD_FAILURE() << "accepted";
    } catch (const loom::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("between 1 GiB and 1 PiB"), std::string::npos) << msg;
      EXPECT_EQ(msg.find("did you mean"), std::string::npos) << msg;
    }
  }
  loom::test::expect_error([] { loom::parse_memory_size("141", "--device-memory"); }, {"did you mean 141GiB?"});
}

TEST(PlanDevice, NamedCards) {
  EXPECT_EQ(loom::named_gpu("h100").total, 81559 * kMiB);
  EXPECT_EQ(loom::named_gpu("H200").total, 143771 * kMiB);
  EXPECT_EQ(loom::named_gpu("a100-80gb").total, 81920 * kMiB);
  EXPECT_EQ(loom::named_gpu("a100-40gb").total, 40960 * kMiB);
  EXPECT_NE(loom::named_gpu("h100").name.find("H100"), std::string::npos);
  loom::test::expect_error([] { loom::named_gpu("h1000"); },
                           {"--gpu h1000 is not a GPU loom knows", "did you mean 'h100'", "h200", "--device-memory"});
  loom::test::expect_error([] { loom::named_gpu("b200"); }, {"--gpu b200", "a100-40gb", "--device-memory"});
}

// Beyond the arena: the context and libraries on every rank; MPI and NCCL
// under a launcher, even over one rank; NCCL's buffers only with peers,
// growing with the peers on the node, more across nodes.
TEST(PlanDevice, OutsideTheArenaGrowsWithPeers) {
  const loom::OutsideArena alone = loom::outside_arena_estimate(1, 1, false),
                           one = loom::outside_arena_estimate(1, 1, true), two = loom::outside_arena_estimate(2, 2, true),
                           four = loom::outside_arena_estimate(4, 4, true),
                           eight = loom::outside_arena_estimate(8, 8, true),
                           nodes = loom::outside_arena_estimate(16, 8, true);
  // Measured on an H200 (docs/PERFORMANCE.md, "The memory plan across the
  // node workload's family"): 0.566 GiB alone, 1.890 under `mpirun -np 1`;
  // the estimates within 0.02 GiB of them.
  EXPECT_EQ(alone.launcher + alone.nccl, 0u);
  EXPECT_NEAR(static_cast<double>(alone.total()) / kGiB, 0.566, 0.02);
  EXPECT_EQ(one.context, alone.context);
  EXPECT_EQ(one.nccl, 0u);
  EXPECT_NEAR(static_cast<double>(one.total()) / kGiB, 1.890, 0.02);
  // Four ranks measured 1.8-2.2 GiB beyond the arena (docs/PERFORMANCE-LOG.md).
  EXPECT_GE(static_cast<double>(four.total()) / kGiB, 1.8);
  EXPECT_LE(static_cast<double>(four.total()) / kGiB, 2.2);
  EXPECT_EQ(two.launcher, one.launcher);
  EXPECT_GT(two.nccl, 0u);
  EXPECT_LT(two.nccl, four.nccl);
  EXPECT_LT(four.nccl, eight.nccl);
  EXPECT_LT(eight.nccl, nodes.nccl);
  // Several ranks are always launched.
  EXPECT_EQ(loom::outside_arena_estimate(4, 4, false).total(), four.total());
}

// The CLI cases plan the shipped CUDA workloads: their recipes (bf16,
// fp8_current) and cuDNN attention are built only with CUDA (though never run
// here).
#ifdef LOOM_HAVE_CUDA
// The node workloads planned for named cards on a machine that has none:
// the plan, what lies beyond it, the sum, whether it fits; the same for a
// card given by its memory; and more ranks give each a smaller share.
TEST(PlanDevice, CheckPlansForAGpuItCannotSee) {
  const auto [rc, text] = check(bench("llama3-8b-8k") + " --gpu h100 --world-size 4 --breakdown --no-scan");
  ASSERT_EQ(rc, 0) << text;
  for (const char* want : {"ranks 4", "recompute selective", "beyond the arena, estimated: CUDA context",
                           "of 79.65 GiB on NVIDIA H100 80GB HBM3 (--gpu h100): fits",
                           "memory plan part by part", "gate_up.*", "(32 x 448.0 MiB)",
                           "6N + 6LhS: NeMo's model TFLOP/s", ": ok"})
    EXPECT_NE(text.find(want), std::string::npos) << "missing '" << want << "' in:\n" << text;
  // In all = the arena's total plus the estimate beyond it (to the printed precision).
  const double outside = static_cast<double>(loom::outside_arena_estimate(4, 4, true).total()) / kMiB;
  EXPECT_NEAR(in_all_mib(text), arena_mib(text) + outside, 0.01 * 1024) << text;

  const auto same = check(bench("llama3-8b-8k") + " --device-memory 81559MiB --world-size=4 --no-scan");
  ASSERT_EQ(same.first, 0) << same.second;
  EXPECT_EQ(in_all_mib(same.second), in_all_mib(text));
  EXPECT_NE(same.second.find("a GPU of 79.65 GiB (--device-memory 81559MiB)"), std::string::npos) << same.second;

  const auto eight = check(bench("llama3-8b-8k") + " --gpu h100 --world 8 --no-scan");
  ASSERT_EQ(eight.first, 0) << eight.second;
  EXPECT_LT(in_all_mib(eight.second), in_all_mib(text)) << "zero3 over 8 ranks holds less per rank";
  // Two nodes of 8: the same shares, NCCL across nodes on top.
  const auto nodes = check(bench("llama3-8b-8k") + " --gpu h100 --world-size 16 --gpus-per-node 8 --no-scan");
  ASSERT_EQ(nodes.first, 0) << nodes.second;

  // The FP8 twin under zero3: weight_cache "auto" casts per GEMM, and it fits too.
  const auto fp8 = check(bench("llama3-8b-8k-fp8") + " --gpu h100 --world-size 4 --no-scan");
  ASSERT_EQ(fp8.first, 0) << fp8.second;
  EXPECT_NE(fp8.second.find("fits"), std::string::npos) << fp8.second;
}

// --world-size 1 plans the run as `mpirun -np 1` starts it: zero3 over one
// rank is a run (the node workload cut to 8 layers is benchmarked so on one
// GPU, docs/PERFORMANCE.md), not a process started alone.
TEST(PlanDevice, CheckPlansAStrategyOverOneLaunchedRank) {
  const auto [rc, text] = check(bench("llama3-8b-8k-fp8") + " --gpu h200 --world-size 1 --no-scan"
                                " --set model.num_layers=8 --set train.grad_accum=8");
  ASSERT_EQ(rc, 0) << text;
  for (const char* want : {"sharding zero3", "ranks 1", "(--gpu h200): fits", ": ok"})
    EXPECT_NE(text.find(want), std::string::npos) << "missing '" << want << "' in:\n" << text;
  // Measured: 70.45 GiB in use on one H200 under `mpirun -np 1 loom bench`
  // of this workload (docs/PERFORMANCE.md, "Units without FP8 weights are
  // gathered as parameters"); issue 31 asks the plan to be within 3% of the
  // measured peak.
  EXPECT_NEAR(in_all_mib(text), 70.45 * 1024, 0.03 * 70.45 * 1024) << text;
  // One rank holds every shard: more than each of four does.
  const auto four = check(bench("llama3-8b-8k-fp8") + " --gpu h200 --world-size 4 --no-scan"
                          " --set model.num_layers=8 --set train.grad_accum=8");
  ASSERT_EQ(four.first, 0) << four.second;
  EXPECT_GT(in_all_mib(text), in_all_mib(four.second));
}

// A card too small: the plan is printed, then the refusal naming the plan,
// the card and what to change; exit status 1.
TEST(PlanDevice, CheckSaysWhenItDoesNotFit) {
  const auto [rc, text] = check(bench("llama3-8b-8k") + " --device-memory 40GiB --world-size 4 --no-scan");
  EXPECT_NE(rc, 0);
  for (const char* want : {"DOES NOT FIT", "the memory plan does not fit", "only 40.00 GiB is available",
                           "a GPU of 40.00 GiB (--device-memory 40GiB)", "Nothing was allocated"})
    EXPECT_NE(text.find(want), std::string::npos) << "missing '" << want << "' in:\n" << text;
  // The FP8 run as the issue found it (no recompute, a weight cache for the
  // step): 92 GiB, refused for an H100, and the advice names selective recompute.
  const auto none = check(bench("llama3-8b-8k-fp8") + " --gpu h100 --world-size 4 --no-scan --set model.recompute=none "
                          "--set precision.weight_cache=step");
  EXPECT_NE(none.first, 0) << none.second;
  EXPECT_NE(none.second.find("model.recompute = \"selective\""), std::string::npos) << none.second;
}

// The advice of a plan that does not fit offers only the levers this config
// can still pull, and `loom check` names the fewest ranks that fit, found by
// planning: across both node workloads, cards of 80 and 40 GiB and plans
// refused by the early check (one rank) or by the detailed plan (three), the
// count it names fits and one fewer does not.
TEST(PlanDevice, CheckNamesTheFewestRanksThatFit) {
  for (const char* workload : {"llama3-8b-8k", "llama3-8b-8k-fp8"})
    for (const char* card : {"--gpu h100", "--device-memory 40GiB"})
      for (int world : {1, 3}) {
        const std::string flags = bench(workload) + " " + card + " --no-scan";
        SCOPED_TRACE(flags + " --world-size " + std::to_string(world));
        const auto [rc, text] = check(flags + " --world-size " + std::to_string(world));
        EXPECT_NE(rc, 0) << text;
        // zero3 shards everything already, and the micro-batch is 1: neither is offered.
        EXPECT_NE(text.find(std::string("more ranks (this is a 1/") + std::to_string(world) + " share"),
                  std::string::npos) << text;
        EXPECT_EQ(text.find("\"zero2\" and \"zero1\""), std::string::npos) << text;
        EXPECT_EQ(text.find("train.micro_batch"), std::string::npos) << text;
        EXPECT_NE(text.find(std::string(workload) == "llama3-8b-8k" ? "precision.plugin = \"bf16_pure\""
                                                                    : "precision.master = \"bf16\""),
                  std::string::npos) << text;
        std::smatch m;
        ASSERT_TRUE(std::regex_search(text, m, std::regex("With more ranks it fits: at --world-size ([0-9]+) ")))
            << text;
        const int fewest = std::stoi(m[1]);
        EXPECT_GT(fewest, world);
        const auto at = check(flags + " --world-size " + std::to_string(fewest));
        EXPECT_EQ(at.first, 0) << at.second;
        EXPECT_NE(at.second.find("): fits"), std::string::npos) << at.second;
        const auto below = check(flags + " --world-size " + std::to_string(fewest - 1));
        EXPECT_NE(below.first, 0) << below.second;
      }
  // In nodes of 8: a multiple of 8, and one node fewer does not fit.
  const std::string nodes = bench("llama3-8b-8k") + " --device-memory 40GiB --no-scan --gpus-per-node 8";
  const auto [rc, text] = check(nodes + " --world-size 8");
  EXPECT_NE(rc, 0) << text;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(text, m, std::regex("at --world-size ([0-9]+) --gpus-per-node 8 "))) << text;
  const int fewest = std::stoi(m[1]);
  EXPECT_EQ(fewest % 8, 0) << text;
  EXPECT_EQ(check(nodes + " --world-size " + std::to_string(fewest)).first, 0);
  EXPECT_NE(check(nodes + " --world-size " + std::to_string(fewest - 8)).first, 0);
}

// Where more ranks cannot help, `loom check` says so instead of a count, and
// the advice names the strategy or the group size that would.
TEST(PlanDevice, CheckSaysWhenMoreRanksDoNotHelp) {
  // ddp keeps a whole copy of llama2-7b's state (bf16_pure: no master to drop) on each rank.
  const auto ddp = check(bench("llama2-7b") + " --device-memory 40GiB --world-size 4 --no-scan"
                         " --set sharding.plugin=ddp");
  EXPECT_NE(ddp.first, 0) << ddp.second;
  for (const char* want : {"the state sharded over several ranks (sharding.plugin = \"zero3\"",
                           "More ranks do not make it fit"})
    EXPECT_NE(ddp.second.find(want), std::string::npos) << "missing '" << want << "' in:\n" << ddp.second;
  EXPECT_EQ(ddp.second.find("no fp32 master"), std::string::npos) << ddp.second;
  // hybrid_shard in groups of 2: each group holds a whole copy, whatever the ranks.
  const auto hybrid = check(bench("llama3-8b-8k") + " --gpu h100 --world-size 4 --no-scan"
                            " --set sharding.plugin=hybrid_shard --set sharding.shard_group_size=2");
  EXPECT_NE(hybrid.first, 0) << hybrid.second;
  for (const char* want : {"larger shard groups (each group of 2 of the 4 ranks", "More ranks do not make it fit"})
    EXPECT_NE(hybrid.second.find(want), std::string::npos) << "missing '" << want << "' in:\n" << hybrid.second;
  // Activations alone beyond the card (micro-batch 4): no count, and the micro-batch is offered.
  const auto acts = check(bench("llama3-8b-8k") + " --gpu h100 --world-size 4 --no-scan --set train.micro_batch=4");
  EXPECT_NE(acts.first, 0) << acts.second;
  for (const char* want : {"shrink the activations", "lower train.micro_batch (4)", "More ranks do not make it fit"})
    EXPECT_NE(acts.second.find(want), std::string::npos) << "missing '" << want << "' in:\n" << acts.second;
  // Refused by the early check at every count (the activations' floor alone
  // exceeds the card): planned up to the most ranks loom takes.
  const auto floor = check(bench("llama3-8b-8k") + " --device-memory 40GiB --world-size 4 --no-scan"
                           " --set train.micro_batch=64");
  EXPECT_NE(floor.first, 0) << floor.second;
  EXPECT_NE(floor.second.find("More ranks do not make it fit: not at --world-size 1048576 either"), std::string::npos)
      << floor.second;
}

// Bad flags and worlds a strategy cannot use: one message each, before any work.
TEST(PlanDevice, CheckRefusesBadFlagsWithOneMessage) {
  const std::string c = bench("llama3-8b-8k");
  const std::pair<std::string, std::string> cases[] = {
      {c + " --device-memory 80XB", "--device-memory 80XB: 'XB' is not a unit of memory"},
      {c + " --device-memory", "--device-memory needs a value"},
      {c + " --gpu h1000", "--gpu h1000 is not a GPU loom knows (did you mean 'h100'?)"},
      {c + " --gpu h100 --device-memory 80GiB", "give one"},
      {c + " --world-size 0", "--world-size 0 is not a number of ranks in [1, 1048576]"},
      {c + " --world-size four", "--world-size four is not a number of ranks"},
      {c + " --gpus-per-node 8 --gpu h100", "--gpus-per-node needs --world-size"},
      {c + " --gpu h100 --world-size 6 --gpus-per-node 4", "--world 6 is not a multiple of --gpus-per-node 4"},
      // zero3 planned for one plain process (no --world-size): the strategy
      // splits work across ranks, and the message says how to plan them.
      {c + " --gpu h100", "`loom check --world-size N` plans it for N ranks"},
      // hybrid_shard's groups must divide the world.
      {c + " --gpu h100 --world-size 6 --set sharding.plugin=hybrid_shard --set sharding.shard_group_size=4",
       "shard_group_size = 4 does not divide the world size 6"},
      // Every rank on one machine (no --gpus-per-node): 6371 tensors described
      // 2^20 times (2.3 TiB of host memory) is refused, naming the flag.
      {(fs::path(LOOM_SOURCE_DIR) / "configs" / "mixtral-8x7b.toml").string() +
           " --gpu h100 --world-size 1048576 --set model.num_experts=64",
       "say how many of the 1048576 ranks share a machine (loom check --gpus-per-node G)"},
      // A CPU run planned for a GPU.
      {c + " --gpu h100 --world-size 4 --set run.device=cpu", "--gpu and --device-memory plan a run.device = \"cuda\""},
  };
  for (const auto& [args, want] : cases) {
    SCOPED_TRACE(args);
    const auto [rc, text] = check(args + " --no-scan");
    EXPECT_NE(rc, 0) << text;
    EXPECT_NE(text.find(want), std::string::npos) << "missing '" << want << "' in:\n" << text;
    EXPECT_EQ(text.find("memory plan per rank"), std::string::npos) << "refused after planning:\n" << text;
  }
}
#endif
