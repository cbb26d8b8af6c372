// `loom train` across launches (mpirun, oversubscribed, CPU fp32):
//  - a checkpoint saved by one strategy and world size, resumed by another,
//    continues with the losses of an uninterrupted single-process run (1e-5
//    relative: the runs differ only in the order of fp32 gradient sums);
//  - a rank that stops responding makes the others fail with the collective
//    and the timeout named, instead of hanging;
//  - bad launches and incompatible checkpoints fail before any step.
// The global batch stays the same across launches (micro_batch x grad_accum x
// ranks = 8 sequences), so the data position carries over exactly.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "hf/safetensors.hpp"
#include "test_util.hpp"

namespace {

namespace fs = std::filesystem;

const char* kConfig = R"([run]
name = "reshard"
device = "cpu"
seed = 5
threads = 1
[model]
hidden = 64
num_layers = 2
num_heads = 4
num_kv_heads = 2
ffn_hidden = 160
vocab_size = 250
max_seq_len = 32
[train]
steps = 20
micro_batch = 2
seq_len = 32
grad_accum = 4
lr = 2e-3
warmup_steps = 0
schedule = "constant"
log_every = 5
[checkpoint]
every = 0
resume = "none"
[precision]
plugin = "fp32"
[attention]
plugin = "naive"
[sharding]
plugin = "none"
[data]
plugin = "synthetic"
)";

struct Result {
  int code = -1;
  std::string output;
  double seconds = 0;
};

// Runs `loom train` on `ranks` processes (1: no launcher) with extra --set overrides.
Result run(const fs::path& dir, int ranks, const std::vector<std::string>& sets, const std::string& env = "",
           const std::string& cmd = "train") {
  const fs::path cfg = dir / "config.toml";
  if (!fs::exists(cfg)) std::ofstream(cfg) << kConfig;
  std::ostringstream c;
  c << env << " ";
  if (ranks > 0)
    c << LOOM_MPIEXEC << " --allow-run-as-root --oversubscribe -np " << ranks << " -x OMP_NUM_THREADS=1"
      << (env.empty() ? "" : " -x LOOM_FAULT_STALL") << " ";
  c << LOOM_CLI << " " << cmd << " " << cfg.string() << " --set 'run.plugin_path=[\"" << LOOM_TEST_PLUGIN_DIR
    << "\"]'";
  for (const auto& s : sets) c << " --set '" << s << "'";
  const fs::path log = dir / "out.log";
  c << " > " << log.string() << " 2>&1";
  const auto t0 = std::chrono::steady_clock::now();
  Result r;
  r.code = WEXITSTATUS(std::system(c.str().c_str()));
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  r.output = ss.str();
  return r;
}

std::map<int64_t, double> losses(const fs::path& metrics) {
  std::map<int64_t, double> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) out[j.at("step").get<int64_t>()] = j.at("loss").get<double>();
  }
  return out;
}

// `loom convert` reads any checkpoint through the reader resume uses: a
// checkpoint written by `ranks` ranks converts to the HF folder one process
// converts to. Same tensors, names, shapes and config.json; the values agree
// to 1e-5 (the runs' fp32 gradient sums differ in order, nothing else).
void convert_equals_one_process(const fs::path& root, const std::vector<std::string>& one_sets, int ranks,
                                const std::vector<std::string>& many_sets, const std::string& label) {
  static int k = 0;
  const std::string tag = std::to_string(k++);
  const std::vector<std::string> common = {"train.steps=10", "checkpoint.every=10"};
  std::vector<std::string> one = common, many = common;
  one.insert(one.end(), one_sets.begin(), one_sets.end());
  one.push_back("run.out_dir=" + (root / ("one" + tag)).string());
  many.insert(many.end(), many_sets.begin(), many_sets.end());
  many.push_back("run.out_dir=" + (root / ("many" + tag)).string());
  many.push_back("train.grad_accum=" + std::to_string(4 / ranks));
  Result a = run(root, 0, one);
  ASSERT_EQ(a.code, 0) << a.output;
  Result b = run(root, ranks, many);
  ASSERT_EQ(b.code, 0) << b.output;
  for (const std::string who : {"one" + tag, "many" + tag}) {
    const fs::path ck = root / who / "checkpoints" / "step_00000010";
    const std::string cmd = std::string(LOOM_CLI) + " convert " + ck.string() + " --to-hf " +
                            (root / (who + "_hf")).string() + " --dtype fp32 > " +
                            (root / (who + "_convert.txt")).string() + " 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << who;
  }
  std::ifstream c1(root / ("one" + tag + "_hf") / "config.json"), c4(root / ("many" + tag + "_hf") / "config.json");
  EXPECT_EQ(nlohmann::json::parse(c1), nlohmann::json::parse(c4));
  loom::hf::SafeTensorsFile f1((root / ("one" + tag + "_hf") / "model.safetensors").string());
  loom::hf::SafeTensorsFile f4((root / ("many" + tag + "_hf") / "model.safetensors").string());
  ASSERT_EQ(f1.names(), f4.names());
  double worst = 0;
  for (const std::string& n : f1.names()) {
    ASSERT_EQ(f1.info(n).shape, f4.info(n).shape) << n;
    const std::vector<float> x = f1.read_f32(n), y = f4.read_f32(n);
    double num = 0, den = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      num += (static_cast<double>(x[i]) - y[i]) * (static_cast<double>(x[i]) - y[i]);
      den += static_cast<double>(x[i]) * x[i];
    }
    const double rel = std::sqrt(num / den);
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 1e-5) << label << ": " << n;
  }
  std::printf("[convert %s] %zu tensors, worst relative difference %.2e\n", label.c_str(), f1.names().size(), worst);
}

class ShardingCli : public ::testing::Test {
 protected:
  loom::test::TmpDir tmp;

  // The uninterrupted single-process run every resumed run must continue.
  std::map<int64_t, double> reference() {
    Result r = run(tmp.path, 0, {"run.out_dir=" + (tmp.path / "ref").string()});
    EXPECT_EQ(r.code, 0) << r.output;
    return losses(tmp.path / "ref" / "metrics.jsonl");
  }

  // Saves at step 10 with (save_ranks, save_strategy), resumes to 20 with (load_ranks, load_strategy).
  void reshard(int save_ranks, const std::string& save_strategy, std::vector<std::pair<int, std::string>> loads,
               std::vector<std::string> save_extra = {}) {
    const auto ref = reference();
    ASSERT_EQ(ref.size(), 20u);
    const std::string ck = (tmp.path / "ckpt").string();
    std::vector<std::string> save = {"run.out_dir=" + (tmp.path / "save").string(),
                                     "sharding.plugin=" + save_strategy, "train.steps=10", "checkpoint.every=10",
                                     "checkpoint.dir=" + ck, "train.grad_accum=" + std::to_string(4 / std::max(save_ranks, 1))};
    save.insert(save.end(), save_extra.begin(), save_extra.end());
    Result s = run(tmp.path, save_ranks, save);
    ASSERT_EQ(s.code, 0) << s.output;
    const auto first = losses(tmp.path / "save" / "metrics.jsonl");
    for (const auto& [step, loss] : first) EXPECT_NEAR(loss, ref.at(step), 1e-5 * ref.at(step)) << "step " << step;
    int k = 0;
    for (const auto& [ranks, strategy] : loads) {
      const fs::path out = tmp.path / ("load" + std::to_string(k++));
      std::vector<std::string> load = {"run.out_dir=" + out.string(), "sharding.plugin=" + strategy,
                                       "checkpoint.dir=" + ck, "checkpoint.resume=10",
                                       "train.grad_accum=" + std::to_string(4 / std::max(ranks, 1))};
      if (strategy == "hybrid_shard") load.push_back("sharding.shard_group_size=2");
      Result l = run(tmp.path, ranks, load);
      ASSERT_EQ(l.code, 0) << l.output;
      if (ranks != save_ranks || strategy != save_strategy)
        EXPECT_NE(l.output.find("resharding checkpoint"), std::string::npos) << l.output;
      const auto cont = losses(out / "metrics.jsonl");
      ASSERT_EQ(cont.size(), 10u) << l.output;
      for (const auto& [step, loss] : cont) {
        ASSERT_GT(step, 10);
        EXPECT_NEAR(loss, ref.at(step), 1e-5 * ref.at(step))
            << strategy << " on " << ranks << " rank(s), step " << step << " resumed from " << save_strategy << " on "
            << save_ranks;
      }
    }
  }
};

TEST_F(ShardingCli, Zero3OnFourResumesAsDdpOnTwoAndAloneOnOne) {
  reshard(4, "zero3", {{2, "ddp"}, {0, "none"}, {4, "hybrid_shard"}});
}

TEST_F(ShardingCli, DdpOnTwoResumesAsZero3OnFourAndZero1OnTwo) {
  reshard(2, "ddp", {{4, "zero3"}, {2, "zero1"}, {4, "zero2"}});
}

TEST_F(ShardingCli, SingleProcessResumesAsHybridShard) { reshard(0, "none", {{4, "hybrid_shard"}, {2, "zero2"}}); }

// Rank 1 stops answering before step 3; rank 0 must stop with the collective
// and the limit named within a few seconds of run.collective_timeout.
// A zero3 checkpoint written by 4 ranks (each its shard of every unit) with
// fused layers converts to the HF folder of one process with native layers.
TEST_F(ShardingCli, ConvertOfAFourRankZero3CheckpointEqualsOneProcess) {
  convert_equals_one_process(tmp.path, {"model.layers=native"}, 4, {"model.layers=fused", "sharding.plugin=zero3"},
                             "zero3 x4 fused vs one process native");
}

// The same for a mixture of experts trained with expert parallelism: the
// experts units (each rank holding its experts only) are written under the
// experts' global names, so the HF folder is the one of one process.
TEST_F(ShardingCli, ConvertOfAnExpertParallelCheckpointEqualsOneProcess) {
  const std::vector<std::string> moe = {"model.ffn=\"moe\"", "model.num_experts=4", "model.top_k=2"};
  std::vector<std::string> many = moe;
  many.insert(many.end(), {"sharding.plugin=zero3", "sharding.expert_parallel=2"});
  convert_equals_one_process(tmp.path, moe, 4, many, "moe zero3 x4, expert_parallel 2, vs one process");
  std::vector<std::string> ep4 = moe;
  ep4.insert(ep4.end(), {"sharding.plugin=ddp", "sharding.expert_parallel=4"});
  convert_equals_one_process(tmp.path, moe, 4, ep4, "moe ddp x4, expert_parallel 4, vs one process");
}

TEST_F(ShardingCli, StalledRankTimesOutNamingTheCollective) {
  Result r = run(tmp.path, 2,
                 {"run.out_dir=" + (tmp.path / "stall").string(), "sharding.plugin=zero2", "train.grad_accum=2",
                  "run.collective_timeout=2"},
                 "LOOM_FAULT_STALL=1:3");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("did not complete within 2 s"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("run.collective_timeout"), std::string::npos) << r.output;
  const bool named = r.output.find("all_reduce") != std::string::npos ||
                     r.output.find("reduce_scatter") != std::string::npos ||
                     r.output.find("all_gather") != std::string::npos;
  EXPECT_TRUE(named) << r.output;
  EXPECT_LT(r.seconds, 60.0) << "the job should end soon after the 2 s timeout";
}

// Rank 1 dies (SIGKILL) before step 3: the job must end, not hang. mpirun
// takes the other ranks down when one dies; under a launcher that does not,
// they stop at run.collective_timeout as in the test above.
TEST_F(ShardingCli, KilledRankEndsTheJob) {
  Result r = run(tmp.path,
                 2, {"run.out_dir=" + (tmp.path / "kill").string(), "sharding.plugin=zero3", "train.grad_accum=2",
                     "run.collective_timeout=5"},
                 "LOOM_FAULT_STALL=1:3:kill");
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_LT(r.seconds, 60.0) << r.output;
  const bool explained = r.output.find("did not complete within 5 s") != std::string::npos ||
                         r.output.find("signal 9") != std::string::npos ||
                         r.output.find("Killed") != std::string::npos;
  EXPECT_TRUE(explained) << r.output;
}

TEST_F(ShardingCli, MultiRankStrategyStartedAloneIsRefused) {
  Result r = run(tmp.path, 0, {"sharding.plugin=zero3"});
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_NE(r.output.find("sharding.plugin = \"zero3\""), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("mpirun -np N"), std::string::npos) << r.output;
}

TEST_F(ShardingCli, GroupSizeNotDividingWorldIsRefused) {
  Result r = run(tmp.path, 4, {"sharding.plugin=hybrid_shard", "sharding.shard_group_size=3"});
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("shard_group_size = 3 does not divide the world size 4"), std::string::npos) << r.output;
}

TEST_F(ShardingCli, CheckpointOfAnotherModelIsRefusedBeforeTraining) {
  const std::string ck = (tmp.path / "ckpt").string();
  Result s = run(tmp.path, 2, {"run.out_dir=" + (tmp.path / "a").string(), "sharding.plugin=zero3",
                                 "train.steps=2", "checkpoint.every=2", "checkpoint.dir=" + ck, "train.grad_accum=2"});
  ASSERT_EQ(s.code, 0) << s.output;
  Result r = run(tmp.path, 2, {"run.out_dir=" + (tmp.path / "b").string(), "sharding.plugin=ddp",
                                 "checkpoint.dir=" + ck, "checkpoint.resume=auto", "model.ffn_hidden=192"});
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("was written for another model"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(tmp.path / "b" / "metrics.jsonl"));
  EXPECT_TRUE(fs::exists(fs::path(ck) / "step_00000002" / "COMPLETE"));  // the checkpoint is untouched
}

// `loom check` under the launcher prints each rank's plan beside the ZeRO formulas.
TEST_F(ShardingCli, CheckPrintsPerRankPlanAndFormulas) {
  Result r = run(tmp.path, 2, {"sharding.plugin=zero3"}, "", "check");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("ZeRO formulas per rank for zero3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("this is rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("comm"), std::string::npos) << r.output;
}

}  // namespace

namespace {

// `loom compare` under mpirun: one row per strategy, the same losses, the
// expected traffic kinds, and the CSV and PNG written.
TEST_F(ShardingCli, CompareRunsEveryStrategyAndWritesTableCsvPng) {
  const std::string out = (tmp.path / "cmp").string();
  Result c = run(tmp.path, 2, {"train.grad_accum=2"}, "",
                 "compare --strategies=ddp,zero1,zero3 --steps=3 --warmup=1 --out=" + out);
  ASSERT_EQ(c.code, 0) << c.output;
  for (const char* label : {"ddp", "zero1", "zero3", "max |dloss|"})
    EXPECT_NE(c.output.find(label), std::string::npos) << label << "\n" << c.output;
  int rows = 0;
  std::istringstream lines(c.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("COMPARE_JSON ", 0) != 0) continue;
    ++rows;
    auto j = nlohmann::json::parse(line.substr(13));
    EXPECT_EQ(j.at("losses").size(), 4u);
    EXPECT_LE(j.at("max_rel_loss_diff").get<double>(), 1e-5) << line;
    const auto& b = j.at("bytes_per_step");
    if (j.at("label") == "ddp") EXPECT_GT(b.at(0).get<double>(), 1e5) << line;       // all-reduce
    if (j.at("label") == "zero3") EXPECT_GT(b.at(2).get<double>(), 1e5) << line;     // all-gather
  }
  EXPECT_EQ(rows, 3) << c.output;
  EXPECT_TRUE(fs::exists(fs::path(out) / "compare.csv"));
  EXPECT_TRUE(fs::exists(fs::path(out) / "compare_losses.csv"));
  ASSERT_TRUE(fs::exists(fs::path(out) / "compare.png"));
  std::ifstream png(fs::path(out) / "compare.png", std::ios::binary);
  char sig[8] = {};
  png.read(sig, 8);
  EXPECT_EQ(std::string(sig + 1, 3), "PNG");
}

// A strategy with keys of its own (--strategies=name:key=value): hybrid_shard
// in groups of 2 on 4 ranks beside zero3 (one group of 4): the same losses,
// and the traffic of two groups (the shards' all-reduce across the groups,
// half the gathered bytes); a malformed item is refused naming it.
TEST_F(ShardingCli, CompareTakesKeysPerStrategy) {
  const std::string out = (tmp.path / "cmpk").string();
  Result c = run(tmp.path, 4, {}, "",
                 "compare --strategies=zero3,hybrid_shard:shard_group_size=2 --steps=2 --warmup=1 --out=" + out);
  ASSERT_EQ(c.code, 0) << c.output;
  std::map<std::string, nlohmann::json> rows;
  std::istringstream lines(c.output);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("COMPARE_JSON ", 0) == 0) {
      auto j = nlohmann::json::parse(line.substr(13));
      rows[j.at("label").get<std::string>()] = j;
    }
  ASSERT_EQ(rows.size(), 2u) << c.output;
  ASSERT_TRUE(rows.count("hybrid_shard:shard_group_size=2")) << c.output;
  const auto& z = rows.at("zero3").at("bytes_per_step");
  const auto& h = rows.at("hybrid_shard:shard_group_size=2").at("bytes_per_step");
  EXPECT_LE(rows.at("hybrid_shard:shard_group_size=2").at("max_rel_loss_diff").get<double>(), 1e-5);
  EXPECT_GT(h.at(0).get<double>(), 1000.0 * std::max(z.at(0).get<double>(), 1.0)) << "the shards' all-reduce across groups";
  EXPECT_LT(h.at(2).get<double>(), 0.75 * z.at(2).get<double>()) << "gathers within groups of 2, not 4";

  Result bad = run(tmp.path, 2, {}, "", "compare --strategies=hybrid_shard:shard_group_size --steps=1 --warmup=0");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.output.find("'hybrid_shard:shard_group_size'"), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("key=value"), std::string::npos) << bad.output;

  // An empty list (a shell variable that expanded to nothing) would compare the base config with itself.
  for (const char* empty : {"--strategies=", "--configs=,"}) {
    Result e = run(tmp.path, 0, {}, "", std::string("compare ") + empty + " --steps=1 --warmup=0");
    EXPECT_NE(e.code, 0) << empty;
    EXPECT_NE(e.output.find(std::string(empty) + " names nothing to compare"), std::string::npos) << e.output;
    EXPECT_EQ(e.output.find("COMPARE_JSON"), std::string::npos) << e.output;
  }
}

// Several configs, one process, no launcher; a run whose memory plan does
// not fit is a failed row, not the end of the comparison; a strategy that does
// not exist stops the comparison before anything runs, naming it.
TEST_F(ShardingCli, CompareConfigsAndAFailedRow) {
  const fs::path other = tmp.path / "other.toml";
  std::ofstream(other) << kConfig;
  const std::string out = (tmp.path / "cmpc").string();
  Result c = run(tmp.path, 0, {}, "",
                 "compare --configs=" + other.string() + " --steps=2 --warmup=0 --out=" + out);
  ASSERT_EQ(c.code, 0) << c.output;
  int rows = 0;
  std::istringstream lines(c.output);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("COMPARE_JSON ", 0) == 0) {
      ++rows;
      EXPECT_EQ(nlohmann::json::parse(line.substr(13)).at("max_rel_loss_diff").get<double>(), 0.0) << line;
    }
  EXPECT_EQ(rows, 2) << c.output;

  // 100 layers of hidden 8192: about 1.5 TB of weights and state, which no machine's memory holds
  // (refused from the config's numbers, before the layers are built).
  const fs::path huge = tmp.path / "huge.toml";
  std::ofstream(huge) << kConfig << "\n";
  Result h = run(tmp.path, 0, {}, "",
                 "compare --configs=" + huge.string() +
                     " --set model.hidden=8192 --set model.num_layers=100 --set model.ffn_hidden=28672"
                     " --set model.num_heads=64 --set model.num_kv_heads=8 --steps=2 --warmup=0 --out=" + out);
  ASSERT_EQ(h.code, 0) << h.output;
  rows = 0;
  std::istringstream hl(h.output);
  for (std::string line; std::getline(hl, line);)
    if (line.rfind("COMPARE_JSON ", 0) == 0) {
      ++rows;
      EXPECT_NE(nlohmann::json::parse(line.substr(13)).at("note").get<std::string>().find("failed: "),
                std::string::npos) << line;
    }
  EXPECT_EQ(rows, 2) << h.output;
  EXPECT_NE(h.output.find("the memory plan cannot fit"), std::string::npos) << h.output;

  Result f = run(tmp.path, 2, {"train.grad_accum=2"}, "",
                 "compare --strategies=zero2,no_such_strategy --steps=2 --warmup=0 --out=" + out);
  EXPECT_NE(f.code, 0) << f.output;
  EXPECT_NE(f.output.find("'no_such_strategy' cannot start, so nothing was run: no sharding plugin named "
                          "'no_such_strategy'"),
            std::string::npos) << f.output;
  EXPECT_EQ(f.output.find("COMPARE_JSON"), std::string::npos) << "zero2 ran before the missing strategy was found";
  EXPECT_EQ(f.output.find("compare: zero2 ("), std::string::npos) << f.output;
}

}  // namespace
