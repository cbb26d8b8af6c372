// Non-finite training (docs/RELIABILITY.md "Non-finite values"):
//  - NaN/inf weights or optimizer state are refused where they enter — an HF
//    folder, a checkpoint — naming the tensor;
//  - a checkpoint is never written from non-finite state (every rank refuses;
//    the complete checkpoints stay);
//  - train.max_skipped_steps consecutive skipped steps stop the run with an
//    error, and a run whose every step was skipped does not end with success;
//  - an update that overflows AdamW's second moment is found and stops the run,
//    naming the tensors.
// Each case is checked on more than one tensor or dtype so that the class,
// not one example, is covered.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/file_util.hpp"
#include "checkpoint/train_checkpoint.hpp"
#include "config/run_config.hpp"
#include "hf/hf_llama.hpp"
#include "hf/safetensors.hpp"
#include "reliability_util.hpp"
#include "test_util.hpp"
#include "train/finite_checks.hpp"
#include "train/session_probe.hpp"

namespace fs = std::filesystem;
using namespace loom::test;
using loom::Session;

namespace {

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

loom::Config parse(const std::string& text, const std::vector<std::string>& ov = {}) {
  return loom::parse_config_string(text, "nonfinite.toml", ov);
}

void expect_session_error(const loom::Config& cfg, std::initializer_list<std::string> parts) {
  expect_error(
      [&] {
        Session s(cfg);
        s.initialise();
      },
      parts);
}

// Rewrites one tensor of rank 0's file of a complete checkpoint the way an
// older loom, which did not look at values, would have written it: the file,
// meta.json's record of it and COMPLETE are all consistent, only the values
// are bad. `poison(values, n)` edits the fp32 values.
void rewrite_checkpoint_tensor(const fs::path& step_dir, const std::string& tensor,
                               const std::function<void(float*, int64_t)>& poison) {
  using namespace loom::ckpt;
  const fs::path root = step_dir.parent_path();
  const int64_t step = CheckpointReader(step_dir.string(), 0).step();
  std::vector<std::vector<std::byte>> bufs;
  std::vector<std::pair<std::string, loom::Tensor>> items;
  {
    CheckpointReader r(step_dir.string(), 0);
    ASSERT_TRUE(r.has(tensor)) << tensor << " is not in " << step_dir.string();
    for (const std::string& name : r.names()) {
      const TensorRecord& rec = r.info(name);
      bufs.emplace_back(rec.bytes);
      int64_t n = 1;
      for (int64_t d : rec.shape) n *= d;
      loom::Tensor t(bufs.back().data(), rec.dtype, loom::Device::cpu, {n});
      r.read(name, t);
      if (name == tensor) poison(t.ptr<float>(), n);
      items.emplace_back(name, t);
    }
  }
  fs::remove(step_dir / "COMPLETE");
  CheckpointWriter w(root.string(), step, 0);
  for (auto& [name, t] : items) w.add(name, t);
  const uint32_t crc = w.write_shard();
  auto meta = nlohmann::json::parse(read_text(step_dir / "meta.json"));
  meta["shard_header_crc32"][0] = crc;
  fs::remove(step_dir / "meta.json");
  CheckpointWriter::write_meta(root.string(), step, meta.dump(2));
  CheckpointWriter::mark_complete(root.string(), step);
}

// A completed run with a checkpoint at step 2.
fs::path trained_checkpoint(const fs::path& dir) {
  Session s(parse(tiny_config(dir / "run", 2), {"checkpoint.every=2"}));
  s.train();
  return dir / "run" / "checkpoints" / "step_00000002";
}

}  // namespace

TEST(ReliabilityNonFinite, CountsNaNAndInfInEveryFloatDtype) {
  const std::vector<float> f = {1.f, kNaN, 2.f, kInf, -kInf, 0.f};
  loom::NonFiniteCount c = loom::count_nonfinite(f.data(), loom::DType::f32, 6);
  EXPECT_EQ(c.nan, 1);
  EXPECT_EQ(c.inf, 2);
  EXPECT_EQ(c.first, 1);
  const std::vector<uint16_t> bf = {0x3f80, 0x7f80 /* inf */, 0xffc0 /* nan */, 0x0000};
  c = loom::count_nonfinite(bf.data(), loom::DType::bf16, 4);
  EXPECT_EQ(c.inf, 1);
  EXPECT_EQ(c.nan, 1);
  EXPECT_EQ(c.first, 1);
  const std::vector<uint16_t> h = {0x3c00, 0x7c00 /* inf */, 0x7e00 /* nan */};
  c = loom::count_nonfinite(h.data(), loom::DType::f16, 3);
  EXPECT_EQ(c.count(), 2);
  const std::vector<double> d = {1.0, std::nan(""), 3.0};
  c = loom::count_nonfinite(d.data(), loom::DType::f64, 3);
  EXPECT_EQ(c.nan, 1);
  EXPECT_EQ(c.first, 1);
  // Large finite values are finite (the largest fp32, bf16 65280 exponent below all ones).
  const std::vector<float> big = {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max()};
  EXPECT_FALSE(loom::count_nonfinite(big.data(), loom::DType::f32, 2));
  // Parallel path (above 65536 elements) agrees with the serial count.
  std::vector<float> many(200000, 1.f);
  many[150001] = kNaN;
  many[70000] = kInf;
  c = loom::count_nonfinite(many.data(), loom::DType::f32, static_cast<int64_t>(many.size()));
  EXPECT_EQ(c.count(), 2);
  EXPECT_EQ(c.first, 70000);
}

// An HF folder whose weights hold NaN or inf: refused at load, naming the tensor,
// whichever tensor it is.
TEST(ReliabilityNonFinite, HfWeightsWithNaNOrInfAreRefusedNamingTheTensor) {
  const fs::path dir = fresh_dir("nonfinite_hf");
  const loom::Config base = parse(tiny_config(dir / "run", 2));
  const loom::ModelSpec spec = base.model.spec;
  for (const auto& [bad_tensor, value] : std::vector<std::pair<std::string, float>>{
           {"model.layers.1.mlp.up_proj.weight", kNaN}, {"model.norm.weight", kInf}, {"lm_head.weight", -kInf}}) {
    SCOPED_TRACE(bad_tensor);
    const fs::path hf = dir / "hf";
    fs::remove_all(hf);
    std::map<std::string, std::vector<float>> w;
    for (const loom::UnitInfo& u : loom::model_units(spec))
      for (const loom::ParamInfo& p : u.params) {
        w[p.name].assign(static_cast<size_t>(p.numel), 0.01f);
        if (p.name == bad_tensor) w[p.name][7] = value;
      }
    loom::hf::save_hf_llama(hf.string(), spec, [&](const std::string& n) { return w.at(n).data(); }, loom::DType::f32);
    expect_session_error(parse(tiny_config(dir / "run", 2), {"model.init=\"hf:" + hf.string() + "\""}),
                         {bad_tensor, "non-finite", "element 7", hf.string()});
  }
}

// A checkpoint whose weights or AdamW state hold NaN/inf (written before this
// check existed, or by hand): refused at resume, naming what holds them.
TEST(ReliabilityNonFinite, CheckpointWithNonFiniteStateIsRefusedNamingTheTensor) {
  for (const auto& [tensor, words] : std::vector<std::pair<std::string, std::string>>{
           {"params.layer.1", "weights (params)"},
           {"adam_v.embedding", "AdamW second moment (adam_v)"},
           {"adam_m.head", "AdamW first moment (adam_m)"}}) {
    SCOPED_TRACE(tensor);
    const fs::path dir = fresh_dir("nonfinite_ckpt_" + tensor);
    const fs::path step = trained_checkpoint(dir);
    rewrite_checkpoint_tensor(step, tensor, [](float* v, int64_t n) { v[n / 2] = kNaN; });
    // The rewritten checkpoint is otherwise valid (CRCs and certificates agree).
    EXPECT_NO_THROW(loom::ckpt::CheckpointReader(step.string(), 0));
    expect_session_error(parse(tiny_config(dir / "run", 4)), {words, "non-finite", "1 NaN", step.string(),
                                                              "cannot be resumed"});
  }
}

// Saving refuses non-finite state, and the previous complete checkpoint stays.
TEST(ReliabilityNonFinite, CheckpointIsNeverWrittenFromNonFiniteState) {
  const fs::path dir = fresh_dir("nonfinite_save");
  Session s(parse(tiny_config(dir / "run", 10)));
  s.initialise();
  s.train_step();
  (void)s.read_step_logs();
  s.save_checkpoint(1);
  const fs::path root = dir / "run" / "checkpoints";
  ASSERT_TRUE(fs::exists(root / "step_00000001" / "COMPLETE"));
  const std::string meta_before = read_text(root / "step_00000001" / "meta.json");
  // A NaN in the weights, then in the optimizer state: each refused by name.
  std::vector<float> gain = loom::probe(s).read_param("model.layers.0.post_attention_layernorm.weight");
  gain[3] = kNaN;
  loom::probe(s).write_param("model.layers.0.post_attention_layernorm.weight", gain.data());
  expect_error([&] { s.save_checkpoint(2); },
               {"no checkpoint of step 2 was written", "'model.layers.0.post_attention_layernorm.weight' (element 3)",
                "weights (params)", "1 NaN", "step_00000001"});
  EXPECT_FALSE(fs::exists(root / "step_00000002" / "COMPLETE"));
  gain[3] = 1.f;
  loom::probe(s).write_param("model.layers.0.post_attention_layernorm.weight", gain.data());
  loom::UnitState& head = loom::probe(s).units().back();
  std::vector<float> v = loom::probe(s).read_tensor(head.adam_v);
  v[5] = kInf;
  loom::probe(s).backend().upload(head.adam_v, v.data(), v.size() * 4);
  expect_error([&] { s.save_checkpoint(3); }, {"no checkpoint of step 3", "AdamW second moment (adam_v)", "1 inf"});
  EXPECT_FALSE(fs::exists(root / "step_00000003" / "COMPLETE"));
  // The good checkpoint is untouched and still loads.
  EXPECT_EQ(read_text(root / "step_00000001" / "meta.json"), meta_before);
  EXPECT_NO_THROW(loom::ckpt::CheckpointSet((root / "step_00000001").string()));
}

// Consecutive skipped steps stop the run at train.max_skipped_steps, counted
// at log steps (log_every 1 and 4 here), and write no checkpoint.
TEST(ReliabilityNonFinite, ConsecutiveSkippedStepsStopTheRun) {
  for (int64_t log_every : {1, 4}) {
    SCOPED_TRACE(log_every);
    const fs::path dir = fresh_dir("nonfinite_skips_" + std::to_string(log_every));
    Session s(parse(tiny_config(dir / "run", 50), {"train.max_skipped_steps=3",
                                                  "train.log_every=" + std::to_string(log_every)}));
    s.initialise();
    // NaN weights: every step's gradient norm is NaN, every step is skipped.
    std::vector<float> w = loom::probe(s).read_param("model.layers.1.mlp.down_proj.weight");
    w[0] = kNaN;
    loom::probe(s).write_param("model.layers.1.mlp.down_proj.weight", w.data());
    // Found at the first log step at or after the limit: step 3, or step 4 with log_every = 4.
    expect_error([&] { s.train(); }, {"steps 1 to 3: 3 consecutive steps were skipped", "train.max_skipped_steps = 3"});
    EXPECT_EQ(count_lines(dir / "run" / "metrics.jsonl"), log_every == 1 ? 3 : 4);
    EXPECT_TRUE(loom::ckpt::list_checkpoints((dir / "run" / "checkpoints").string()).empty());
  }
}

// Skipped steps below the limit: a run that recovers goes on; a run whose
// every step was skipped ends with an error even when shorter than the limit.
TEST(ReliabilityNonFinite, ARunThatOnlySkippedDoesNotSucceed) {
  const fs::path dir = fresh_dir("nonfinite_all_skipped");
  Session s(parse(tiny_config(dir / "run", 2), {"train.max_skipped_steps=5"}));
  s.initialise();
  std::vector<float> w = loom::probe(s).read_param("model.embed_tokens.weight");
  w[10] = kInf;
  loom::probe(s).write_param("model.embed_tokens.weight", w.data());
  expect_error([&] { s.train(); }, {"every one of the 2 steps", "skipped"});
  // max_skipped_steps = 0 disables the limit, not the end-of-run check.
  const fs::path dir2 = fresh_dir("nonfinite_no_limit");
  Session s2(parse(tiny_config(dir2 / "run", 7), {"train.max_skipped_steps=0"}));
  s2.initialise();
  loom::probe(s2).write_param("model.embed_tokens.weight", w.data());
  expect_error([&] { s2.train(); }, {"every one of the 7 steps"});
}

// An unclipped update with a huge gradient overflows AdamW's second moment:
// found at the log step, naming the tensor; the same update clipped is fine.
TEST(ReliabilityNonFinite, OptimizerStateOverflowIsDetected) {
  for (const char* clip : {"0", "1.0"}) {
    SCOPED_TRACE(clip);
    const fs::path dir = fresh_dir(std::string("nonfinite_overflow_") + clip);
    Session s(parse(tiny_config(dir / "run", 3), {std::string("train.grad_clip=") + clip, "checkpoint.every=1"}));
    s.initialise();
    // A final-norm gain of 1e25 makes the head's input, and so its gradient,
    // about 1e24 per element: finite in fp32, but its square is not.
    std::vector<float> g(64, 1e25f);
    loom::probe(s).write_param("model.norm.weight", g.data());
    if (std::string(clip) == "0") {
      expect_error([&] { s.train(); }, {"step 1: the optimizer state overflowed", "train.grad_clip = 0",
                                        "AdamW second moment (adam_v) of 'model.embed_tokens.weight'", "inf"});
      // Nothing was checkpointed from that state.
      EXPECT_TRUE(loom::ckpt::list_checkpoints((dir / "run" / "checkpoints").string()).empty());
    } else {
      const loom::RunSummary r = s.train();
      EXPECT_EQ(r.last_step, 3);
      EXPECT_TRUE(fs::exists(dir / "run" / "checkpoints" / "step_00000003" / "COMPLETE"));
    }
  }
}

// The reported case end to end: `loom train` with the largest learning rate
// and no clipping overflows AdamW's second moment within the first log
// window; the run stops with exit code 1 naming the tensor instead of
// training on with frozen weights.
TEST(ReliabilityNonFinite, LargeLearningRateWithoutClippingIsStoppedByTheCommand) {
  const fs::path dir = fresh_dir("nonfinite_cli_lr");
  const fs::path cfg = dir / "run.toml";
  std::ofstream(cfg) << tiny_config(dir / "run", 300);
  const ProcResult r = run_shell(std::string("'") + LOOM_CLI + "' train '" + cfg.string() +
                                 "' --set train.lr=10 --set train.grad_clip=0 --set train.log_every=50");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, "the optimizer state overflowed");
  EXPECT_CONTAINS(r.out, "AdamW second moment (adam_v) of '");
  EXPECT_CONTAINS(r.out, "train.grad_clip = 0");
}
