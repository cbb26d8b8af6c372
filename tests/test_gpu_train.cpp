// Training on the GPU against the CPU fp32 reference, and determinism.
// Skips without a GPU.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>

#include <cuda_runtime.h>
#include <filesystem>
#include <sstream>

#include "config/run_config.hpp"
#include "gpu_test_util.hpp"
#include "test_util.hpp"
#include "train/session_probe.hpp"

namespace fs = std::filesystem;

namespace {

using loom::test::temp_dir;

// The quickstart recipe on the prepared fortune corpus: CUDA bf16 + cuDNN,
// with native and with fused layers, against the CPU fp32 reference from the
// same initial weights (same seed, so the same random init), 300 steps.
// Bounds: final validation loss within 2%, every logged validation loss
// within 3% (bf16 rounding shifts the trajectory, it must not change where it
// goes). With a GPU present the corpus must be there: scripts/gpu_check.sh
// prepares it, and a missing corpus fails rather than skips.
TEST(GpuTrain, Bf16CudnnFollowsTheCpuReference) {
  LOOM_REQUIRE_GPU();
  const fs::path data = fs::path(LOOM_SOURCE_DIR) / "data" / "fortunes";
  ASSERT_TRUE(fs::exists(data / "val.bin"))
      << "the fortune corpus is missing: loom prepare text data/fortunes /usr/share/games/fortunes "
         "(scripts/gpu_check.sh does this from the copy scripts/gpu_build.sh stages)";
  fs::path d = temp_dir("gpu_curve");
  auto run = [&](const std::string& device, const std::string& precision, const std::string& attention,
                 const std::string& layers) {
    std::vector<std::string> ov = {
        "run.out_dir=\"" + (d / (device + layers)).string() + "\"", "run.device=" + device,
        "model.layers=" + layers,
        "run.plugin_path=[\"" + std::string(LOOM_TEST_PLUGIN_DIR) + "\"]",
        "data.train=\"" + (data / "train_*.bin").string() + "\"", "data.val=\"" + (data / "val.bin").string() + "\"",
        "precision.plugin=" + precision, "attention.plugin=" + attention, "train.steps=300",
        "train.validation_every=50", "train.validation_batches=8", "checkpoint.every=0", "checkpoint.resume=none"};
    loom::Session s(loom::load_config(fs::path(LOOM_SOURCE_DIR) / "configs" / "quickstart.toml", ov));
    loom::RunSummary r = s.train();
    // A stop signal (a timeout wrapped around the suite) ends a run early with
    // a checkpoint; comparing a cut curve would fail on its length instead.
    EXPECT_EQ(r.stop_signal, 0) << device << " " << layers << " run stopped by signal " << r.stop_signal
                                << " at step " << r.last_step << " of 300: give the suite more time";
    return r;
  };
  const loom::RunSummary cpu = run("cpu", "fp32", "naive", "native");
  for (const char* layers : {"native", "fused"}) {
    const loom::RunSummary gpu = run("cuda", "bf16", "cudnn", layers);
    ASSERT_EQ(cpu.val_losses.size(), gpu.val_losses.size());
    double worst = 0;
    for (size_t i = 0; i < cpu.val_losses.size(); ++i) {
      const double a = gpu.val_losses[i].second, b = cpu.val_losses[i].second;
      const double e = std::abs(a - b) / b;
      EXPECT_LT(e, 0.03) << layers << " step " << cpu.val_losses[i].first << ": gpu " << a << " cpu " << b;
      worst = std::max(worst, e);
    }
    const double final_e = std::abs(gpu.val_losses.back().second - cpu.val_losses.back().second) /
                           cpu.val_losses.back().second;
    EXPECT_LT(final_e, 0.02) << layers;
    std::printf("[gpu curve, %s layers] val loss cpu %.4f -> %.4f, gpu %.4f -> %.4f; final diff %.2f%%, worst %.2f%%\n",
                layers, cpu.val_losses.front().second, cpu.val_losses.back().second, gpu.val_losses.front().second,
                gpu.val_losses.back().second, 100 * final_e, 100 * worst);
  }
}

// run.deterministic = true: two runs give bitwise-equal losses and grad norms,
// at the llama-125m benchmark shape (12 layers, 12 heads, batch 16 x 1024):
// at toy sizes cuDNN's non-deterministic backward happens to be exact, so a
// small model passed while the flag never reached the model's backward; this
// one differed from step 2 (10.436490 vs 10.436505). Native and fused layers.
TEST(GpuTrain, DeterministicRunsAreBitwiseEqual) {
  LOOM_REQUIRE_GPU();
  fs::path d = temp_dir("gpu_det");
  for (const char* layers : {"native", "fused"}) {
    auto run = [&](const std::string& sub) {
      const std::vector<std::string> ov = {
          "run.out_dir=\"" + (d / (sub + layers)).string() + "\"", "run.deterministic=true",
          "run.plugin_path=[\"" + std::string(LOOM_TEST_PLUGIN_DIR) + "\"]", "model.layers=" + std::string(layers),
          "train.steps=6", "train.warmup_steps=2", "data.pattern=\"ramp\"", "checkpoint.every=0",
          "checkpoint.resume=none", "train.log_every=6"};
      loom::Session s(loom::load_config(fs::path(LOOM_SOURCE_DIR) / "configs" / "bench" / "llama-125m.toml", ov));
      return s.train();
    };
    const loom::RunSummary a = run("a"), b = run("b");
    ASSERT_EQ(a.steps.size(), 6u);
    for (size_t i = 0; i < a.steps.size(); ++i) {
      EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << layers << " step " << i + 1;
      EXPECT_EQ(a.steps[i].grad_norm, b.steps[i].grad_norm) << layers << " step " << i + 1;
    }
    EXPECT_LT(a.steps.back().loss, a.steps.front().loss) << layers;
    std::printf("[deterministic %s] 6 steps at llama-125m: losses %.6f -> %.6f, bitwise equal twice\n", layers,
                a.steps.front().loss, a.steps.back().loss);
  }
}

// The step never makes the host wait for the GPU (loom/ops/backend.hpp counts
// every blocking call of the CUDA backend): at the llama-125m shape, steps
// that are not log steps make none, a log step exactly one. The FP8 recipes
// (fp8_delayed, fp8_current, fp8_block: both families' GPU paths) log every
// step, their log_summary() read after each step's log as `loom train`
// prints it. The recipe's own CUDA calls are not the backend's to
// count, so the test holds the compute stream behind a host function that
// waits for the test's release (up to 20 s): a log_summary() that waited for
// the device would run into that timeout; one that reads what the step
// already copied back returns at once.
TEST(GpuTrain, StepMakesNoHostSynchronisation) {
  LOOM_REQUIRE_GPU();
  fs::path d = temp_dir("gpu_syncs");
  for (const char* layers : {"native", "fused", "fp8_delayed", "fp8_current", "fp8_block"}) {
    const bool fp8 = std::string(layers).rfind("fp8_", 0) == 0;
    const int64_t every = fp8 ? 1 : 3;
    std::vector<std::string> ov = {
        "run.out_dir=\"" + (d / layers).string() + "\"", "run.plugin_path=[\"" + std::string(LOOM_TEST_PLUGIN_DIR) + "\"]",
        "model.layers=" + std::string(fp8 ? "fused" : layers), "train.steps=9",
        "train.log_every=" + std::to_string(every), "checkpoint.every=0", "checkpoint.resume=none"};
    if (fp8) ov.push_back("precision.plugin=\"" + std::string(layers) + "\"");
    // What each family's log line says once the state it reads has been copied back.
    const char* said = std::string(layers) == "fp8_block" ? "non-finite tiles" : "scales";
    loom::Session s(loom::load_config(fs::path(LOOM_SOURCE_DIR) / "configs" / "bench" / "llama-125m.toml", ov));
    s.initialise();
    for (int64_t step = 1; step <= 9; ++step) {
      const int64_t before = loom::probe(s).host_syncs();
      s.train_step();
      if (step % every == 0) EXPECT_EQ(s.read_step_logs().size(), static_cast<size_t>(every));
      EXPECT_EQ(loom::probe(s).host_syncs() - before, step % every == 0 ? 1 : 0) << layers << " step " << step;
      if (!fp8) continue;
      struct Gate {
        std::atomic<bool> open{false}, timed_out{false};
      } gate;
      auto hold = [](void* p) {
        auto* g = static_cast<Gate*>(p);
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        while (!g->open.load() && std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (!g->open.load()) g->timed_out = true;
      };
      auto stream = static_cast<cudaStream_t>(loom::probe(s).backend().ctx().stream);
      ASSERT_EQ(cudaLaunchHostFunc(stream, hold, &gate), cudaSuccess);
      const auto t0 = std::chrono::steady_clock::now();
      const std::string summary = loom::probe(s).precision().log_summary();
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      gate.open = true;
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      EXPECT_FALSE(gate.timed_out.load()) << layers << ": log_summary() waited for the device at step " << step;
      EXPECT_LT(ms, 1000.0) << layers << ": log_summary() took " << ms << " ms at step " << step;
      EXPECT_NE(summary.find(said), std::string::npos) << layers << " step " << step << ": " << summary;
      if (step == 9) std::printf("[%s log line, step 9] precision: %s\n", layers, summary.c_str());
    }
  }
}

// The same with packed documents (the three [train] switches, bf16 + cuDNN's
// ragged attention): the spans, positions and loss mask travel with the
// tokens, the count of spans picks a graph built at start-up, and the ragged
// offsets are computed on the device: no step but a log step waits.
TEST(GpuTrain, DocumentMaskingStepMakesNoHostSynchronisation) {
  LOOM_REQUIRE_GPU();
  fs::path d = temp_dir("gpu_syncs_docmask");
  for (const char* layers : {"native", "fused"}) {
    const std::vector<std::string> ov = {
        "run.out_dir=\"" + (d / layers).string() + "\"", "run.plugin_path=[\"" + std::string(LOOM_TEST_PLUGIN_DIR) + "\"]",
        "model.layers=" + std::string(layers), "train.steps=9", "train.log_every=3", "checkpoint.every=0",
        "checkpoint.resume=none", "train.reset_attention_mask=true", "train.reset_position_ids=true",
        "train.eod_mask_loss=true", "train.micro_batch=2", "train.grad_accum=2", "data.document_length=100"};
    loom::Session s(loom::load_config(fs::path(LOOM_SOURCE_DIR) / "configs" / "bench" / "llama-125m.toml", ov));
    s.initialise();
    for (int64_t step = 1; step <= 9; ++step) {
      const int64_t before = loom::probe(s).host_syncs();
      s.train_step();
      if (step % 3 == 0) {
        const auto logs = s.read_step_logs();
        ASSERT_EQ(logs.size(), 3u);
        EXPECT_TRUE(std::isfinite(logs.back().loss)) << layers;
      }
      EXPECT_EQ(loom::probe(s).host_syncs() - before, step % 3 == 0 ? 1 : 0) << layers << " step " << step;
    }
  }
}

}  // namespace

namespace {

// Stop after step 4 with a checkpoint, resume in a new session: steps 5..8
// give bitwise the same losses as an uninterrupted run (deterministic mode;
// params, fp32 master and AdamW state go through the host and back).
TEST(GpuTrain, StopAndResumeOnCudaIsBitwiseExact) {
  LOOM_REQUIRE_GPU();
  fs::path d = temp_dir("gpu_resume");
  for (const char* layers : {"native", "fused"}) {
  auto config = [&](const std::string& sub, const std::string& extra) {
    std::ostringstream c;
    c << "[run]\ndevice = \"cuda\"\nseed = 5\ndeterministic = true\nout_dir = \"" << (d / (sub + layers)).string()
      << "\"\n"
      << "plugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
      << "[model]\nlayers = \"" << layers << "\"\nhidden = 128\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nffn_hidden = 352\n"
      << "vocab_size = 500\nmax_seq_len = 128\n"
      << "[train]\nsteps = 8\nmicro_batch = 4\nseq_len = 96\ngrad_accum = 2\nlr = 1e-3\nmin_lr = 1e-4\n"
      << "[checkpoint]\n" << extra << "\n"
      << "[precision]\nplugin = \"bf16\"\n[attention]\nplugin = \"cudnn\"\n[sharding]\nplugin = \"none\"\n"
      << "[data]\nplugin = \"synthetic\"\npattern = \"ramp\"\n";
    return loom::parse_config_string(c.str(), "resume.toml", {});
  };
  loom::RunSummary full, first, second;
  {
    loom::Session s(config("full", "resume = \"none\""));
    full = s.train();
  }
  {
    loom::Session s(config("split", "every = 4\nresume = \"auto\""));
    first = s.train(4);
  }
  {
    loom::Session s(config("split", "every = 4\nresume = \"auto\""));
    second = s.train();
  }
  ASSERT_EQ(full.steps.size(), 8u);
  ASSERT_EQ(second.first_step, 4);
  ASSERT_EQ(second.steps.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(first.steps[i].loss, full.steps[i].loss) << layers << " step " << i + 1;
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(second.steps[i].loss, full.steps[4 + i].loss) << layers << " step " << 5 + i;
  }
}

}  // namespace
