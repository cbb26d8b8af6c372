// The moe feed-forward block on CUDA: training against the CPU fp32
// reference, bitwise repeatability under run.deterministic, and the one host
// wait per layer that reading the expert row counts adds. Skips without a GPU.
// (The whole-model HF golden on CUDA is in test_golden.cpp; the routing
// kernels one by one in test_cuda_moe.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "config/run_config.hpp"
#include "gpu_test_util.hpp"
#include "train/session_probe.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;

namespace {

using loom::test::temp_dir;

// A small Mixtral: 2 layers, 4 experts top-2, router jitter on (the device
// draws the CPU's noise), grad_accum 2, 10 steps.
std::string small_moe(const fs::path& out) {
  std::ostringstream s;
  s << "[run]\nname = \"moe\"\nout_dir = \"" << out.string() << "\"\ndevice = \"cpu\"\nseed = 7\nthreads = 2\n"
    << "plugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nhidden = 64\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nffn_hidden = 48\n"
    << "vocab_size = 96\nmax_seq_len = 64\nffn = \"moe\"\nnum_experts = 4\ntop_k = 2\nrouter_jitter_noise = 0.01\n"
    << "[train]\nsteps = 10\nmicro_batch = 4\nseq_len = 32\ngrad_accum = 2\nlr = 3e-3\nmin_lr = 3e-4\n"
    << "warmup_steps = 2\nschedule = \"cosine\"\nlog_every = 1\nvalidation_every = 0\n"
    << "[checkpoint]\nevery = 0\nresume = \"none\"\n"
    << "[precision]\nplugin = \"fp32\"\n[attention]\nplugin = \"naive\"\n[sharding]\nplugin = \"none\"\n"
    << "[data]\nplugin = \"synthetic\"\npattern = \"ramp\"\n";
  return s.str();
}

loom::RunSummary train(const std::string& text, const std::vector<std::string>& ov) {
  loom::Session s(loom::parse_config_string(text, "moe.toml", ov));
  return s.train();
}

// 10 steps on CUDA against the CPU fp32 run from the same initial weights
// (same seed). fp32 + naive: both sides fp32 with different summation orders
// (~1e-6 per op); the bound 1e-3 relative on every step's LM and aux loss
// leaves room for that to grow over 10 AdamW steps and for a rare router
// near-tie to go the other way (one of ~500 rows per layer and step), and is
// far below what a wrong expert, weight or gradient gives (the loss falls by
// ~1 over the run). bf16 + cuDNN: 3% on the LM loss and 5% on the aux loss —
// the quickstart GPU curve's bound; bf16 rounding of every GEMM input (2^-9)
// shifts the trajectory and moves a few routing choices.
TEST(GpuMoe, TrainingFollowsTheCpuReference) {
  LOOM_REQUIRE_GPU();
  const fs::path d = temp_dir("gpu_moe_train");
  const std::string base = small_moe(d / "run");
  const loom::RunSummary cpu = train(base, {"run.out_dir=\"" + (d / "cpu").string() + "\""});
  ASSERT_EQ(cpu.steps.size(), 10u);
  EXPECT_LT(cpu.steps.back().loss, cpu.steps.front().loss - 0.3);
  struct Case {
    const char* precision;
    const char* attention;
    const char* layers;
    double tol_loss, tol_aux;
  };
  for (const Case& c : {Case{"fp32", "naive", "native", 1e-3, 1e-3}, Case{"fp32", "naive", "fused", 1e-3, 1e-3},
                        Case{"bf16", "cudnn", "native", 3e-2, 5e-2}, Case{"bf16", "cudnn", "fused", 3e-2, 5e-2}}) {
    const std::string tag = std::string(c.precision) + "_" + c.layers;
    const loom::RunSummary gpu =
        train(base, {"run.out_dir=\"" + (d / tag).string() + "\"", "run.device=\"cuda\"",
                     "precision.plugin=\"" + std::string(c.precision) + "\"",
                     "attention.plugin=\"" + std::string(c.attention) + "\"",
                     "model.layers=\"" + std::string(c.layers) + "\""});
    ASSERT_EQ(gpu.steps.size(), cpu.steps.size()) << tag;
    double worst = 0, worst_aux = 0;
    for (size_t i = 0; i < cpu.steps.size(); ++i) {
      const auto& a = gpu.steps[i];
      const auto& b = cpu.steps[i];
      ASSERT_TRUE(a.has_aux && b.has_aux) << tag;
      const double e = std::abs(a.loss - b.loss) / std::abs(b.loss);
      const double ea = std::abs(a.aux_loss - b.aux_loss) / std::abs(b.aux_loss);
      EXPECT_LT(e, c.tol_loss) << tag << " step " << i + 1 << ": gpu " << a.loss << " cpu " << b.loss;
      EXPECT_LT(ea, c.tol_aux) << tag << " step " << i + 1 << ": gpu aux " << a.aux_loss << " cpu " << b.aux_loss;
      worst = std::max(worst, e);
      worst_aux = std::max(worst_aux, ea);
    }
    std::printf("[gpu moe %s] loss cpu %.5f -> %.5f, gpu %.5f -> %.5f; worst rel diff loss %.2e aux %.2e\n",
                tag.c_str(), cpu.steps.front().loss, cpu.steps.back().loss, gpu.steps.front().loss,
                gpu.steps.back().loss, worst, worst_aux);
  }
}

// The FP8 recipes on the MoE block: about 64 rows per expert and call here,
// each expert's run padded on the device to the recipe's
// variable_row_multiple() (16; fp8_block 128) with zero rows, so every expert
// call runs whole in FP8. 10 steps of fused layers and cuDNN against bf16 on
// CUDA from the same initial weights: every step's LM loss within 6% of
// bf16's and the aux loss within 10% (the FP8 quickstart curve's bound; FP8
// rounding of x, W and dy also moves a few routing choices, which the aux loss
// counts), the loss falling. fp8_block needs every dimension a multiple of 128:
// it runs at hidden 128, ffn 128, four KV heads, beside bf16 at that shape.
TEST(GpuMoe, Fp8RecipesTrainLikeBf16) {
  LOOM_REQUIRE_GPU();
  const fs::path d = temp_dir("gpu_moe_fp8");
  const std::string base = small_moe(d / "run");
  auto run = [&](const std::string& precision, const std::string& tag, const std::vector<std::string>& extra) {
    std::vector<std::string> sets = {"run.out_dir=\"" + (d / tag).string() + "\"", "run.device=\"cuda\"",
                                     "precision.plugin=\"" + precision + "\"", "attention.plugin=\"cudnn\"",
                                     "model.layers=\"fused\""};
    sets.insert(sets.end(), extra.begin(), extra.end());
    return train(base, sets);
  };
  const std::vector<std::string> wide = {"model.hidden=128", "model.ffn_hidden=128", "model.num_kv_heads=4"};
  struct Case {
    const char* recipe;
    bool wide;
  };
  const loom::RunSummary bf16 = run("bf16", "bf16", {}), bf16_wide = run("bf16", "bf16_wide", wide);
  ASSERT_EQ(bf16.steps.size(), 10u);
  for (const Case c : {Case{"fp8_delayed", false}, Case{"fp8_current", false}, Case{"fp8_block", true}}) {
    const char* p = c.recipe;
    const loom::RunSummary& ref = c.wide ? bf16_wide : bf16;
    const loom::RunSummary f = run(p, p, c.wide ? wide : std::vector<std::string>{});
    ASSERT_EQ(f.steps.size(), ref.steps.size()) << p;
    double worst = 0, worst_aux = 0;
    for (size_t i = 0; i < f.steps.size(); ++i) {
      const auto& a = f.steps[i];
      const auto& b = ref.steps[i];
      ASSERT_TRUE(std::isfinite(a.loss) && a.has_aux) << p << " step " << i + 1;
      const double e = std::abs(a.loss - b.loss) / std::abs(b.loss);
      const double ea = std::abs(a.aux_loss - b.aux_loss) / std::abs(b.aux_loss);
      EXPECT_LT(e, 0.06) << p << " step " << i + 1 << ": " << a.loss << " vs bf16 " << b.loss;
      EXPECT_LT(ea, 0.10) << p << " step " << i + 1 << ": aux " << a.aux_loss << " vs bf16 " << b.aux_loss;
      worst = std::max(worst, e);
      worst_aux = std::max(worst_aux, ea);
    }
    EXPECT_LT(f.steps.back().loss, f.steps.front().loss - 0.3) << p;
    std::printf("[gpu moe %s] loss bf16 %.5f -> %.5f, %s %.5f -> %.5f; worst rel diff loss %.2e aux %.2e\n", p,
                ref.steps.front().loss, ref.steps.back().loss, p, f.steps.front().loss, f.steps.back().loss, worst,
                worst_aux);
  }
}

// run.deterministic = true: two runs give bitwise-equal losses, aux losses and
// grad norms at a shape where a reduction whose order depended on timing
// (atomics) would show: 8 experts top-2, hidden 512, 4096 tokens per
// micro-batch (~1000 rows per expert, the router's weight gradient a sum over
// 4096 tokens), bf16 + cuDNN, native and fused layers, jitter on.
TEST(GpuMoe, DeterministicRunsAreBitwiseEqual) {
  LOOM_REQUIRE_GPU();
  const fs::path d = temp_dir("gpu_moe_det");
  for (const char* layers : {"native", "fused"}) {
    auto run = [&](const char* tag) {
      const std::vector<std::string> ov = {
          "run.out_dir=\"" + (d / (std::string(layers) + tag)).string() + "\"", "run.device=\"cuda\"",
          "run.deterministic=true", "precision.plugin=\"bf16\"", "attention.plugin=\"cudnn\"",
          "model.layers=\"" + std::string(layers) + "\"", "model.hidden=512", "model.num_heads=8",
          "model.num_kv_heads=4", "model.ffn_hidden=1024", "model.num_experts=8", "model.vocab_size=4096",
          "model.max_seq_len=1024", "train.micro_batch=4", "train.seq_len=1024", "train.grad_accum=1",
          "train.steps=4"};
      return train(small_moe(d / "run"), ov);
    };
    const loom::RunSummary a = run("a"), b = run("b");
    ASSERT_EQ(a.steps.size(), 4u);
    ASSERT_EQ(b.steps.size(), 4u);
    for (size_t i = 0; i < a.steps.size(); ++i) {
      EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << layers << " step " << i + 1;
      EXPECT_EQ(a.steps[i].aux_loss, b.steps[i].aux_loss) << layers << " step " << i + 1;
      EXPECT_EQ(a.steps[i].grad_norm, b.steps[i].grad_norm) << layers << " step " << i + 1;
    }
    EXPECT_LT(a.steps.back().loss, a.steps.front().loss) << layers;
    std::printf("[gpu moe deterministic %s] 4 steps, 8 experts, h 512, 4096 tokens: losses %.6f -> %.6f, bitwise "
                "equal twice\n",
                layers, a.steps.front().loss, a.steps.back().loss);
  }
}

// The MoE layer's one host wait: its forward reads the expert row counts
// (Backend::moe_read_counts) once; backward reuses them. So a step that is
// not a log step makes layers x grad_accum waits (2 x 2 here), a log step one
// more (the read of the step log), and nothing else waits.
TEST(GpuMoe, StepWaitsOncePerLayerForward) {
  LOOM_REQUIRE_GPU();
  const fs::path d = temp_dir("gpu_moe_syncs");
  for (const char* layers : {"native", "fused"}) {
    loom::Session s(loom::parse_config_string(
        small_moe(d / layers), "moe.toml",
        {"run.device=\"cuda\"", "model.layers=\"" + std::string(layers) + "\"", "train.steps=9",
         "train.log_every=3"}));
    s.initialise();
    const int64_t per_step = 2 * 2;  // num_layers x grad_accum
    for (int64_t step = 1; step <= 9; ++step) {
      const int64_t before = loom::probe(s).host_syncs();
      s.train_step();
      if (step % 3 == 0) EXPECT_EQ(s.read_step_logs().size(), 3u);
      EXPECT_EQ(loom::probe(s).host_syncs() - before, per_step + (step % 3 == 0 ? 1 : 0)) << layers << " step " << step;
    }
  }
}

}  // namespace
