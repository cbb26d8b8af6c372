// The training step allocates nothing: after the first steps have built every
// GEMM plan, attention graph and buffer, queuing steps makes no C++ heap
// allocation in libloom, the plugins or the step loop (tests/alloc_counter.hpp
// counts every operator new in the process; allocations inside NVIDIA's
// libraries are reported, not ours to remove). On the CPU (the reference
// path, in CI) and, where there is one, on the GPU at the llama-125m shape.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "alloc_counter.hpp"
#include "config/run_config.hpp"
#include "gpu_test_util.hpp"
#include "train/session.hpp"

namespace fs = std::filesystem;

namespace {

void expect_steps_allocate_nothing(const loom::Config& cfg, const char* what) {
  loom::Session s(cfg);
  s.initialise();
  for (int i = 0; i < 3; ++i) s.train_step();  // warm: plans, graphs, first-use tables
  (void)s.read_step_logs();
  loom_test::AllocCounter counter;
  counter.start();
  for (int i = 0; i < 4; ++i) s.train_step();
  const loom_test::AllocCounts c = counter.stop();
  EXPECT_EQ(c.ours_new, 0) << what << ": the step allocated; first at\n" << c.first_ours;
  EXPECT_EQ(c.ours_delete, 0) << what;
  std::printf("[step allocations %s] ours %lld, inside NVIDIA libraries %lld, over 4 steps\n", what,
              static_cast<long long>(c.ours_new), static_cast<long long>(c.vendor_new));
  EXPECT_EQ(s.read_step_logs().size(), 4u);
}

std::string tiny(const std::string& layers, const fs::path& out) {
  std::ostringstream c;
  c << "[run]\ndevice = \"cpu\"\nseed = 3\nthreads = 2\nout_dir = \"" << out.string() << "\"\n"
    << "plugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nlayers = \"" << layers << "\"\nhidden = 64\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\n"
    << "ffn_hidden = 160\nvocab_size = 96\nmax_seq_len = 32\n" << (layers == "fused" ? "head_chunk = 40\n" : "")
    << "[train]\nsteps = 10\nmicro_batch = 4\nseq_len = 31\ngrad_accum = 2\nlog_every = 10\n"
    << "[checkpoint]\nresume = \"none\"\n"
    << "[precision]\nplugin = \"fp32\"\n[attention]\nplugin = \"naive\"\n[sharding]\nplugin = \"none\"\n"
    << "[data]\nplugin = \"synthetic\"\npattern = \"ramp\"\n";
  return c.str();
}

TEST(StepAllocations, CpuStepAllocatesNothing) {
  for (const char* layers : {"native", "fused"}) {
    const fs::path out = fs::path(LOOM_BINARY_DIR) / "test_tmp" / "step_alloc" / layers;
    expect_steps_allocate_nothing(loom::parse_config_string(tiny(layers, out), "alloc.toml", {}), layers);
  }
}

// The moe FFN block too: expert GEMMs on row counts that change every step,
// router jitter, the aux loss.
TEST(StepAllocations, CpuMoeStepAllocatesNothing) {
  const fs::path out = fs::path(LOOM_BINARY_DIR) / "test_tmp" / "step_alloc" / "moe";
  expect_steps_allocate_nothing(
      loom::parse_config_string(tiny("native", out), "alloc.toml",
                                {"model.ffn=\"moe\"", "model.num_experts=4", "model.top_k=2",
                                 "model.router_jitter_noise=0.01"}),
      "moe");
}

// Packed documents (the three [train] switches): the host derives each
// micro-batch's spans, positions and loss mask into the tokens' staging slot,
// and the count of spans, which changes every micro-batch, reaches the model
// without allocating.
const std::vector<std::string> kDocuments = {"train.reset_attention_mask=true", "train.reset_position_ids=true",
                                             "train.eod_mask_loss=true", "data.document_length=6"};

TEST(StepAllocations, CpuDocumentMaskingStepAllocatesNothing) {
  for (const char* layers : {"native", "fused"}) {
    const fs::path out = fs::path(LOOM_BINARY_DIR) / "test_tmp" / "step_alloc_docmask" / layers;
    expect_steps_allocate_nothing(loom::parse_config_string(tiny(layers, out), "alloc.toml", kDocuments),
                                  (std::string("documents ") + layers).c_str());
  }
}

// The moe block on CUDA: expert GEMMs on row counts that change every step
// run through one cuBLASLt plan per expert matrix (LinearDesc::variable_rows),
// so after the warm-up no count builds a plan; jitter, aux loss, bf16 + cuDNN.
TEST(StepAllocations, CudaMoeStepAllocatesNothing) {
  LOOM_REQUIRE_GPU();
  for (const char* layers : {"native", "fused"}) {
    const fs::path out = fs::path(LOOM_BINARY_DIR) / "test_tmp" / "step_alloc_cuda_moe" / layers;
    expect_steps_allocate_nothing(
        loom::parse_config_string(tiny(layers, out), "alloc.toml",
                                  {"run.device=\"cuda\"", "precision.plugin=\"bf16\"", "attention.plugin=\"cudnn\"",
                                   "model.ffn=\"moe\"", "model.num_experts=4", "model.top_k=2",
                                   "model.router_jitter_noise=0.01"}),
        layers);
  }
}

TEST(StepAllocations, CudaStepAllocatesNothing) {
  LOOM_REQUIRE_GPU();
  for (const char* layers : {"native", "fused"}) {
    const fs::path out = fs::path(LOOM_BINARY_DIR) / "test_tmp" / "step_alloc_cuda" / layers;
    const std::vector<std::string> ov = {"run.out_dir=\"" + out.string() + "\"",
                                         "run.plugin_path=[\"" + std::string(LOOM_TEST_PLUGIN_DIR) + "\"]",
                                         "model.layers=" + std::string(layers), "train.log_every=10",
                                         "checkpoint.resume=none"};
    expect_steps_allocate_nothing(
        loom::load_config(fs::path(LOOM_SOURCE_DIR) / "configs" / "bench" / "llama-125m.toml", ov), layers);
  }
}

// Packed documents on CUDA at the llama-125m shape (bf16, cuDNN): every
// micro-batch has another count of document spans, so cuDNN's ragged
// attention runs graphs of several sequence-count buckets, all built at
// start-up (a graph built in the step would allocate). One row of 1024
// tokens a micro-batch, two a step, documents of 64 tokens on average
// (log-normal, sigma 1): about 17 +- 5 spans, on both sides of the bucket
// boundary at 16.
TEST(StepAllocations, CudaDocumentMaskingStepAllocatesNothing) {
  LOOM_REQUIRE_GPU();
  for (const char* layers : {"native", "fused"}) {
    const fs::path out = fs::path(LOOM_BINARY_DIR) / "test_tmp" / "step_alloc_cuda_docmask" / layers;
    std::vector<std::string> ov = {"run.out_dir=\"" + out.string() + "\"",
                                   "run.plugin_path=[\"" + std::string(LOOM_TEST_PLUGIN_DIR) + "\"]",
                                   "model.layers=" + std::string(layers), "train.log_every=10",
                                   "checkpoint.resume=none", "train.reset_attention_mask=true",
                                   "train.reset_position_ids=true", "train.eod_mask_loss=true",
                                   "train.micro_batch=1", "train.grad_accum=2", "data.document_length=64"};
    expect_steps_allocate_nothing(
        loom::load_config(fs::path(LOOM_SOURCE_DIR) / "configs" / "bench" / "llama-125m.toml", ov),
        (std::string("documents ") + layers).c_str());
  }
}

// The FP8 recipes (fp8_block too) on CUDA with weight_cache = "layer" (the default at
// grad_accum = 1): the weight casts into the shared scratch before every fprop
// and dgrad, and the blocks' transient linear inputs, allocate nothing either.
TEST(StepAllocations, CudaFp8StepAllocatesNothing) {
  LOOM_REQUIRE_GPU();
  for (const char* plugin : {"fp8_delayed", "fp8_current", "fp8_block"}) {
    const fs::path out = fs::path(LOOM_BINARY_DIR) / "test_tmp" / "step_alloc_cuda_fp8" / plugin;
    const std::vector<std::string> ov = {"run.out_dir=\"" + out.string() + "\"",
                                         "run.plugin_path=[\"" + std::string(LOOM_TEST_PLUGIN_DIR) + "\"]",
                                         "precision.plugin=" + std::string(plugin), "precision.weight_cache=layer",
                                         "train.log_every=10", "checkpoint.resume=none"};
    expect_steps_allocate_nothing(
        loom::load_config(fs::path(LOOM_SOURCE_DIR) / "configs" / "bench" / "llama-125m.toml", ov), plugin);
  }
}

}  // namespace
