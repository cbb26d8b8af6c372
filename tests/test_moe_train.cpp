// The `moe` feed-forward block in training, on the CPU reference path: the
// load-balancing loss logged apart from the LM loss and scaled like it under
// gradient accumulation, exact resume (router jitter included), the attention
// variants and recompute modes, checkpoints converted to HF Mixtral folders.
// Whole-model numbers against transformers are test_golden's MixtralGolden.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "config/run_config.hpp"
#include "hf/hf_llama.hpp"
#include "loom/error.hpp"
#include "loom/ops/backend.hpp"
#include "session_runs.hpp"
#include "test_util.hpp"
#include "train/progress.hpp"
#include "train/session_probe.hpp"

namespace fs = std::filesystem;
using loom::RunSummary;
using loom::Session;

namespace {

using loom::test::temp_dir;

// A small Mixtral: 4 experts, top-2, on synthetic ramp data.
std::string moe_config(const fs::path& out) {
  std::ostringstream s;
  s << "[run]\nname = \"moe\"\nout_dir = \"" << out.string() << "\"\ndevice = \"cpu\"\nseed = 7\nthreads = 2\n"
    << "plugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nhidden = 48\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nffn_hidden = 40\n"
    << "vocab_size = 96\nmax_seq_len = 64\nffn = \"moe\"\nnum_experts = 4\ntop_k = 2\n"
    << "[train]\nsteps = 8\nmicro_batch = 4\nseq_len = 31\ngrad_accum = 2\nlr = 3e-3\nmin_lr = 3e-4\n"
    << "warmup_steps = 2\nschedule = \"cosine\"\n"
    << "[checkpoint]\nevery = 0\nresume = \"none\"\n"
    << "[precision]\nplugin = \"fp32\"\n[attention]\nplugin = \"naive\"\n[sharding]\nplugin = \"none\"\n"
    << "[data]\nplugin = \"synthetic\"\npattern = \"ramp\"\n";
  return s.str();
}

loom::Config parse(const std::string& text, const std::vector<std::string>& overrides = {}) {
  return loom::parse_config_string(text, "moe.toml", overrides);
}

}  // namespace

// The aux loss is logged on every step, apart from the LM loss, in the log
// line and metrics.jsonl; the run learns.
TEST(MoeTrain, LearnsAndLogsTheAuxLossApart) {
  fs::path d = temp_dir("moe_learns");
  RunSummary r;
  {
    Session s(parse(moe_config(d / "run")));
    r = s.train();
  }
  ASSERT_EQ(r.steps.size(), 8u);
  for (const auto& st : r.steps) {
    ASSERT_TRUE(st.has_aux);
    // E sum_e f_e P_e with f summing to top_k: between 0 and E * top_k, k for a balanced router.
    EXPECT_GT(st.aux_loss, 0.5);
    EXPECT_LT(st.aux_loss, 8.0);
    EXPECT_NE(loom::log_line(st, 8).find("aux loss"), std::string::npos);
  }
  EXPECT_LT(r.steps.back().loss, r.steps.front().loss - 0.3);
  std::ifstream m(d / "run" / "metrics.jsonl");
  std::string line;
  int with_aux = 0;
  while (std::getline(m, line)) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    ASSERT_TRUE(j.contains("aux_loss")) << line;
    const int64_t step = j["step"].get<int64_t>();
    EXPECT_EQ(j["aux_loss"].get<double>(), r.steps[static_cast<size_t>(step - 1)].aux_loss);
    ++with_aux;
  }
  EXPECT_EQ(with_aux, 8);
}

// The aux gradient is scaled like the LM loss's mean: one micro-batch with
// scale 1/N gives the same gradients as the same micro-batch accumulated twice
// with 1/(2N) — for the router, whose gradient holds most of the aux term at
// coef = 1 — and the aux value is that micro-batch's, not a sum.
TEST(MoeTrain, AuxGradientScalesWithAccumulation) {
  fs::path d = temp_dir("moe_accum");
  Session s(parse(moe_config(d / "run"), {"model.router_aux_loss_coef=1.0", "train.grad_accum=1"}));
  s.initialise();
  const int64_t N = 4 * 31;
  std::vector<int32_t> in(static_cast<size_t>(N)), tg(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) {
    in[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7) % 96);
    tg[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7 + 3) % 96);
  }
  loom::probe(s).load_batch(in.data(), tg.data());
  const std::string router = "model.layers.1.block_sparse_moe.gate.weight";
  loom::probe(s).zero_grads();
  loom::probe(s).forward(true, 1.0f / static_cast<float>(N));
  loom::probe(s).backward();
  const double aux1 = loom::probe(s).batch_aux_loss();
  const std::vector<float> once = loom::probe(s).read_param(router, true);
  loom::probe(s).zero_grads();
  for (int i = 0; i < 2; ++i) {
    loom::probe(s).forward(true, 0.5f / static_cast<float>(N));
    loom::probe(s).backward();
    EXPECT_EQ(loom::probe(s).batch_aux_loss(), aux1);
  }
  const std::vector<float> twice = loom::probe(s).read_param(router, true);
  ASSERT_EQ(once.size(), twice.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < once.size(); ++i) {
    num += (static_cast<double>(once[i]) - twice[i]) * (static_cast<double>(once[i]) - twice[i]);
    den += static_cast<double>(once[i]) * once[i];
  }
  // Two halves summed in fp32 versus one whole: rounding only.
  EXPECT_LT(std::sqrt(num / den), 1e-6);
  // And the aux term is in that gradient: without it the router's gradient differs.
  Session t(parse(moe_config(d / "run0"), {"model.router_aux_loss_coef=0", "train.grad_accum=1"}));
  t.initialise();
  loom::probe(t).load_batch(in.data(), tg.data());
  loom::probe(t).zero_grads();
  loom::probe(t).forward(true, 1.0f / static_cast<float>(N));
  loom::probe(t).backward();
  EXPECT_EQ(loom::probe(t).batch_aux_loss(), aux1);  // the same routing: logged, not optimised
  const std::vector<float> without = loom::probe(t).read_param(router, true);
  double diff = 0;
  for (size_t i = 0; i < once.size(); ++i) diff += std::abs(static_cast<double>(once[i]) - without[i]);
  EXPECT_GT(diff, 1e-4);
}

// A stopped run resumed from its checkpoint continues bitwise: LM and aux
// losses; router jitter draws from (seed, step, micro-batch, layer), so it is
// reproduced too.
TEST(MoeTrain, StopAndResumeContinuesExactlyWithJitter) {
  fs::path d = temp_dir("moe_resume");
  const std::vector<std::string> jitter = {"model.router_jitter_noise=0.05"};
  RunSummary full, first, second;
  {
    Session s(parse(moe_config(d / "full"), jitter));
    full = s.train();
  }
  std::vector<std::string> ov = jitter;
  for (const char* o : {"checkpoint.every=4", "checkpoint.resume=\"auto\""}) ov.push_back(o);
  {
    Session s(parse(moe_config(d / "split"), ov));
    first = s.train(4);
  }
  ASSERT_TRUE(fs::exists(d / "split" / "checkpoints" / "step_00000004" / "COMPLETE"));
  // The layout is recorded by parameter name, the experts included.
  const auto meta = nlohmann::json::parse(std::ifstream(d / "split" / "checkpoints" / "step_00000004" / "meta.json"));
  EXPECT_EQ(meta["model"]["num_experts"], 4);
  EXPECT_EQ(meta["model"]["top_k"], 2);
  bool found = false;
  for (const auto& u : meta["units"])
    for (const auto& p : u["params"])
      found = found || p["name"] == "model.layers.1.block_sparse_moe.experts.3.w2.weight";
  EXPECT_TRUE(found);
  {
    Session s(parse(moe_config(d / "split"), ov));
    second = s.train();
  }
  ASSERT_EQ(first.steps.size(), 4u);
  ASSERT_EQ(second.steps.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(first.steps[i].loss, full.steps[i].loss) << "step " << i + 1;
    EXPECT_EQ(first.steps[i].aux_loss, full.steps[i].aux_loss) << "step " << i + 1;
    EXPECT_EQ(second.steps[i].loss, full.steps[4 + i].loss) << "step " << 5 + i;
    EXPECT_EQ(second.steps[i].aux_loss, full.steps[4 + i].aux_loss) << "step " << 5 + i;
    EXPECT_EQ(second.steps[i].grad_norm, full.steps[4 + i].grad_norm) << "step " << 5 + i;
  }
  // Jitter is on: the same run without it routes differently.
  RunSummary plain;
  {
    Session s(parse(moe_config(d / "plain")));
    plain = s.train(2);
  }
  EXPECT_NE(plain.steps[1].loss, full.steps[1].loss);
}

// Full recompute rebuilds the layer, routing included, without counting its
// tokens twice in the aux loss: bitwise the same run. Fused attention with the
// MoE block matches native attention to rounding.
TEST(MoeTrain, RecomputeAndAttentionVariants) {
  fs::path d = temp_dir("moe_variants");
  RunSummary base, full, fused;
  {
    Session s(parse(moe_config(d / "base"), {"train.steps=4"}));
    base = s.train();
  }
  {
    Session s(parse(moe_config(d / "full"), {"train.steps=4", "model.recompute=\"full\""}));
    full = s.train();
  }
  {
    Session s(parse(moe_config(d / "fused"), {"train.steps=4", "model.layers=\"fused\""}));
    fused = s.train();
  }
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(full.steps[i].loss, base.steps[i].loss) << "step " << i + 1;
    EXPECT_EQ(full.steps[i].aux_loss, base.steps[i].aux_loss) << "step " << i + 1;
    EXPECT_NEAR(fused.steps[i].loss, base.steps[i].loss, 1e-5 * base.steps[i].loss) << "step " << i + 1;
    EXPECT_NEAR(fused.steps[i].aux_loss, base.steps[i].aux_loss, 1e-5 * base.steps[i].aux_loss) << "step " << i + 1;
  }
}

// loom convert --to-hf writes a Mixtral folder (config and per-expert
// tensors) that initialises a new run with the same weights.
TEST(MoeTrain, ConvertCheckpointToHfMixtral) {
  fs::path d = temp_dir("moe_convert");
  const std::string name = "model.layers.0.block_sparse_moe.experts.2.w3.weight";
  std::vector<float> trained;
  {
    Session s(parse(moe_config(d / "run"), {"checkpoint.every=3", "train.steps=3"}));
    s.train();
    trained = loom::probe(s).read_param(name);
  }
  const fs::path ck = d / "run" / "checkpoints" / "step_00000003";
  const std::string cmd = std::string(LOOM_CLI) + " convert " + ck.string() + " --to-hf " + (d / "hf").string() +
                          " --dtype fp32 > " + (d / "convert.txt").string() + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const auto config = nlohmann::json::parse(std::ifstream(d / "hf" / "config.json"));
  EXPECT_EQ(config["model_type"], "mixtral");
  EXPECT_EQ(config["architectures"][0], "MixtralForCausalLM");
  EXPECT_EQ(config["num_local_experts"], 4);
  EXPECT_EQ(config["num_experts_per_tok"], 2);
  EXPECT_EQ(config["router_aux_loss_coef"], 0.02);
  EXPECT_TRUE(config["sliding_window"].is_null());
  // The folder's config.json defines the model: the config's sizes match it,
  // but for max_seq_len (the checkpoint's export says 2048), left out here.
  std::string text = moe_config(d / "run2");
  text.erase(text.find("max_seq_len = 64\n"), 17);
  Session s2(parse(text, {"model.init=\"hf:" + (d / "hf").string() + "\""}));
  s2.initialise();
  EXPECT_EQ(loom::probe(s2).read_param(name), trained);
}

// The first micro-batch writes the experts' gradients, and zeroes those of
// experts that got no rows (8 experts, top-1, 4 tokens a micro-batch: at
// least half get none); the router's and the norms' are zeroed before their
// kernels add to them. Gradients poisoned before every step change no bit.
TEST(MoeTrain, StaleGradientsAreOverwritten) {
  fs::path d = temp_dir("moe_stale_grads");
  for (const std::string accum : {"1", "2"}) {
    SCOPED_TRACE("grad_accum=" + accum);
    loom::test::stale_gradients_are_overwritten(
        parse(moe_config(d / ("run" + accum)), {"model.num_experts=8", "model.top_k=1", "train.micro_batch=1",
                                                "train.seq_len=4", "train.grad_accum=" + accum, "train.steps=5"}),
        5);
  }
}

// What cannot run is refused before any work, naming the key.
TEST(MoeTrain, RefusalsNameTheKey) {
  fs::path d = temp_dir("moe_refusals");
  const std::string c = moe_config(d / "run");
  loom::test::expect_error([&] { parse(c, {"model.top_k=5"}); },
                           {"--set model.top_k=5", "model.top_k = 5 exceeds model.num_experts = 4"});
  loom::test::expect_error([&] { parse(c, {"model.top_k=0"}); }, {"top_k"});
  loom::test::expect_error([&] { parse(c, {"model.ffn=\"dense\""}); },
                           {"model.num_experts applies to a mixture of experts only", "model.ffn = \"moe\""});
  loom::test::expect_error([&] { parse(c, {"model.router_jitter_noise=1.0"}); }, {"router_jitter_noise"});
  loom::test::expect_error([&] { parse(c, {"model.ffn=\"experts\""}); }, {"model.ffn", "dense", "moe"});
}

// loom check prints active and total parameters and FLOPs, and plans the run
// for a world it does not start (--world N --gpus-per-node G): zero3's
// per-rank share is the total over N.
TEST(MoeTrain, CheckPrintsActiveAndTotalAndPlansAWorld) {
  fs::path d = temp_dir("moe_check");
  {
    std::ofstream f(d / "moe.toml");
    f << moe_config(d / "run");
  }
  auto run = [&](const std::string& args, const std::string& out) {
    const std::string cmd = std::string(LOOM_CLI) + " check " + (d / "moe.toml").string() + " " + args + " > " +
                            (d / out).string() + " 2>&1";
    const int rc = std::system(cmd.c_str());
    std::ifstream in(d / out);
    std::stringstream ss;
    ss << in.rdbuf();
    return std::make_pair(rc, ss.str());
  };
  const auto [rc, text] = run("--world 16 --gpus-per-node 8 --set sharding.plugin='\"zero3\"'", "check.txt");
  EXPECT_EQ(rc, 0) << text;
  const loom::ModelSpec spec = parse(moe_config(d / "run")).model.spec;
  for (const std::string& want :
       {std::string("experts: 4 per layer, top 2 per token"),
        loom::cat(spec.active_params(), " / ", spec.total_params(), ")"), std::string("ranks 16"),
        std::string("ZeRO formulas per rank for zero3"), std::string("if every expert ran")})
    EXPECT_NE(text.find(want), std::string::npos) << "missing '" << want << "' in:\n" << text;
  EXPECT_LT(spec.active_params(), spec.total_params());
  // Expert parallelism in a planned world: the expert group has
  // expert_parallel ranks, not the world's 16 (which would not divide the 4
  // experts), and the layer's receive buffers are planned for that group, as
  // in a world of just 2 ranks.
  auto activations = [](const std::string& t) {
    const size_t at = t.find("\n  activations");
    return at == std::string::npos ? std::string("(none)") : t.substr(at + 1, t.find('\n', at + 1) - at - 1);
  };
  const auto ep16 = run("--world 16 --gpus-per-node 8 --set sharding.plugin='\"zero3\"' "
                        "--set sharding.expert_parallel=2", "ep16.txt");
  EXPECT_EQ(ep16.first, 0) << ep16.second;
  const auto ep2 = run("--world 2 --set sharding.plugin='\"zero3\"' --set sharding.expert_parallel=2", "ep2.txt");
  EXPECT_EQ(ep2.first, 0) << ep2.second;
  const auto ep1 = run("--world 2 --set sharding.plugin='\"zero3\"'", "ep1.txt");
  EXPECT_EQ(activations(ep16.second), activations(ep2.second)) << ep16.second << "\n---\n" << ep2.second;
  EXPECT_NE(activations(ep2.second), activations(ep1.second)) << "the exchange's buffers are not planned";
  const auto bad = run("--world 12 --gpus-per-node 8", "bad.txt");
  EXPECT_NE(bad.first, 0);
  EXPECT_NE(bad.second.find("--world 12 is not a multiple of --gpus-per-node 8"), std::string::npos) << bad.second;
  const auto junk = run("--world many", "junk.txt");
  EXPECT_NE(junk.first, 0);
  EXPECT_NE(junk.second.find("--world many is not a number of ranks"), std::string::npos) << junk.second;
}

// The whole model's gradient with router jitter on and a large aux weight,
// against central differences of its objective J = LM loss + coef x aux along
// the gradient's direction (restricted to a router, an expert, a norm gain and
// the embedding). The jitter noise is a function of the seed, the same in
// every forward here, so J is a fixed function of the weights. fp32 limits
// the comparison: with step 3e-3 along a unit direction the rounding of J
// (~5e-7 absolute, twice) gives up to ~2e-4 of the directional derivative
// (~0.76 here), the curvature less (measured: 2e-5 in all): tolerance 1e-3. A
// wrong jitter or aux backward (a missing noise factor, the un-jittered router
// input, an unscaled aux gradient) changes these gradients by far more.
TEST(MoeTrain, GradientWithJitterAndAuxMatchesFiniteDifferences) {
  fs::path d = temp_dir("moe_fd");
  Session s(parse(moe_config(d / "run"),
                  {"model.router_jitter_noise=0.2", "model.router_aux_loss_coef=0.5", "train.grad_accum=1"}));
  s.initialise();
  const int64_t N = 4 * 31;
  std::vector<int32_t> in(static_cast<size_t>(N)), tg(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) {
    in[static_cast<size_t>(i)] = static_cast<int32_t>((i * 13 + 5) % 96);
    tg[static_cast<size_t>(i)] = static_cast<int32_t>((i * 13 + 9) % 96);
  }
  loom::probe(s).load_batch(in.data(), tg.data());
  auto objective = [&] {
    loom::probe(s).zero_grads();
    loom::probe(s).forward(true, 1.0f / static_cast<float>(N));
    loom::probe(s).backward();
    return loom::probe(s).batch_loss() + 0.5 * loom::probe(s).batch_aux_loss();
  };
  const std::vector<std::string> names = {
      "model.layers.0.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.gate.weight",
      "model.layers.1.block_sparse_moe.experts.2.w1.weight", "model.layers.0.block_sparse_moe.experts.0.w2.weight",
      "model.layers.0.post_attention_layernorm.weight", "model.embed_tokens.weight"};
  objective();
  std::vector<std::vector<float>> w0, g;
  double gnorm2 = 0;
  for (const auto& n : names) {
    w0.push_back(loom::probe(s).read_param(n));
    g.push_back(loom::probe(s).read_param(n, true));
    for (float x : g.back()) gnorm2 += static_cast<double>(x) * x;
  }
  const double gnorm = std::sqrt(gnorm2);  // the directional derivative along g / |g|
  ASSERT_GT(gnorm, 1e-3);
  const double eps = 3e-3;
  auto shifted = [&](double sign) {
    for (size_t i = 0; i < names.size(); ++i) {
      std::vector<float> w = w0[i];
      for (size_t j = 0; j < w.size(); ++j) w[j] += static_cast<float>(sign * eps * g[i][j] / gnorm);
      loom::probe(s).write_param(names[i], w.data());
    }
    return objective();
  };
  const double fd = (shifted(+1) - shifted(-1)) / (2 * eps);
  EXPECT_NEAR(fd, gnorm, 1e-3 * gnorm) << "finite difference " << fd << " vs analytic " << gnorm;
  std::printf("[moe fd] directional derivative: analytic %.6f, central difference %.6f (rel %.2e)\n", gnorm, fd,
              std::abs(fd - gnorm) / gnorm);
}

// Resume checks the architecture: another top_k or number of experts is
// another model and is refused; the aux weight and the jitter are training
// settings a resume may change.
TEST(MoeTrain, ResumeRefusesAnotherMixtureButTakesNewRouterSettings) {
  fs::path d = temp_dir("moe_resume_model");
  const std::vector<std::string> ov = {"checkpoint.every=2", "checkpoint.resume=\"auto\"", "train.steps=2"};
  {
    Session s(parse(moe_config(d / "run"), ov));
    s.train();
  }
  auto with = [&](const std::string& extra) {
    std::vector<std::string> o = ov;
    o.push_back("train.steps=3");
    o.push_back(extra);
    return o;
  };
  for (const std::string& other : {std::string("model.top_k=1"), std::string("model.num_experts=3")})
    loom::test::expect_error(
        [&] {
          Session s(parse(moe_config(d / "run"), with(other)));
          s.initialise();
        },
        {"step_00000002", "was written for another model"});
  Session s(parse(moe_config(d / "run"), with("model.router_aux_loss_coef=0.1")));
  const RunSummary r = s.train();
  EXPECT_EQ(r.first_step, 2);
  ASSERT_EQ(r.steps.size(), 1u);
  EXPECT_TRUE(std::isfinite(r.steps[0].loss));
}

namespace {

// A backend with no MoE kernels of its own, as this build's CUDA backend: only
// the Backend base class's moe_* entry points, which the test calls. Its other
// ops are never reached.
class NoMoeBackend final : public loom::Backend {
 public:
  using Tensor = loom::Tensor;
  loom::Device device() const override { return loom::Device::cuda; }
  const loom::ExecContext& ctx() const override { return ctx_; }
  void upload(Tensor&, const void*, size_t) override {}
  void download(void*, const Tensor&, size_t) override {}
  void* host_alloc(size_t) override { return nullptr; }
  void host_free(void*) override {}
  void upload_async(Tensor&, const void*, size_t) override {}
  void zero(Tensor&) override {}
  void copy(Tensor&, const Tensor&) override {}
  void synchronize() override {}
  void embedding_forward(Tensor&, const Tensor&, const Tensor&) override {}
  void embedding_backward(Tensor&, const Tensor&, const Tensor&) override {}
  void rmsnorm_forward(Tensor&, Tensor&, const Tensor&, const Tensor&, float) override {}
  void rmsnorm_backward(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) override {}
  void rope_forward(Tensor&, double) override {}
  void rope_backward(Tensor&, double) override {}
  void swiglu_forward(Tensor&, const Tensor&, const Tensor&) override {}
  void swiglu_backward(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&) override {}
  void add(Tensor&, const Tensor&, const Tensor&) override {}
  void accumulate(Tensor&, const Tensor&) override {}
  void cross_entropy(Tensor&, const Tensor&, Tensor&, float) override {}
  double sum(const Tensor&) override { return 0; }
  double sq_norm(const Tensor&, int64_t, int64_t) override { return 0; }
  void sum_into(Tensor&, const Tensor&, int64_t, int64_t, bool) override {}
  void clip_scale(Tensor&, float, float) override {}
  void scale(Tensor&, float) override {}
  void adamw(Tensor&, Tensor*, const Tensor&, Tensor&, Tensor&, const AdamWArgs&) override {}
  void convert(Tensor&, const Tensor&) override {}
  void timer_start() override {}
  double timer_stop_ms() override { return 0; }
  void timer_reserve(int) override {}
  void timer_mark(int) override {}
  double timer_elapsed_ms(int, int) override { return 0; }
  void timestamp(Tensor&) override {}

 private:
  loom::ExecContext ctx_{};
};

}  // namespace

TEST(MoeTrain, BackendWithoutMoeKernelsRefusesEveryEntryPoint) {
  NoMoeBackend b;
  loom::Tensor t;
  loom::MoeRouting r;
  const std::vector<std::string> parts = {"cuda backend has no mixture-of-experts kernels in this build",
                                          "model.ffn = \"moe\" runs on the CPU and CUDA backends"};
  auto refuses = [&](const char* op, const std::function<void()>& f) {
    try {
      f();
      ADD_FAILURE() << op << " did not refuse";
    } catch (const loom::Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(op), std::string::npos) << m;
      for (const auto& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "missing '" << p << "' in: " << m;
    }
  };
  refuses("moe_jitter", [&] { b.moe_jitter(t, t, t, 0.1, 1); });
  refuses("moe_route", [&] { b.moe_route(r, t, t); });
  refuses("moe_gather", [&] { b.moe_gather(t, t, r); });
  refuses("moe_combine", [&] { b.moe_combine(t, t, r); });
  refuses("moe_combine_backward", [&] { b.moe_combine_backward(t, t, t, t, r); });
  refuses("moe_route_backward", [&] { b.moe_route_backward(t, t, t, t, t, t, t, r, nullptr); });
  refuses("moe_scatter_add", [&] { b.moe_scatter_add(t, t, r, nullptr); });
  refuses("moe_aux_accumulate", [&] { b.moe_aux_accumulate(t, r); });
  refuses("moe_aux_finish", [&] { b.moe_aux_finish(t, t, t, 0.02, 1.0); });
}
