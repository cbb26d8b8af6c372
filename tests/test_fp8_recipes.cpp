// The FP8 recipes (fp8_delayed, fp8_current) as plugins, on the CPU:
//   - delayed scaling through the plugin over a short run against scales
//     computed here from the amaxes of the data (history window, margin, "max"
//     and "most_recent"), and the GEMM outputs against a float64 reference on
//     operands cast with those scales;
//   - the weight cast once per optimizer step, a validation forward that
//     leaves the scales alone, the LM head in fp32 (or in FP8 with fp8_head);
//   - amax 0 / inf / NaN: no zero or infinite scale, the update skipped and counted;
//   - config errors, one message each naming the key;
//   - sessions: bitwise resume of the recipe state, resume across recipes,
//     the memory plan, the log line, and training on the quickstart model
//     within 2% of fp32.
#include <gtest/gtest.h>

#include <numeric>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "config/run_config.hpp"
#include "hf/safetensors.hpp"
#include "loom/comm.hpp"
#include "loom/config.hpp"
#include "loom/cpu_gemm.hpp"
#include "loom/fp8.hpp"
#include "loom/precision.hpp"
#include "loom/registry.hpp"
#include "fp8_recipe_rig.hpp"
#include "session_runs.hpp"
#include "test_util.hpp"
#include "train/session_probe.hpp"

namespace fs = std::filesystem;
using loom::DType;
using loom::Device;
using loom::Tensor;

namespace {

loom::PluginRegistry& registry() {
  static auto* reg = new loom::PluginRegistry({fs::path(LOOM_TEST_PLUGIN_DIR)});  // plugins are never unloaded
  return *reg;
}

loom::ConfigTable precision_table(const std::string& body) {
  loom::ConfigTable t = loom::parse_config_table("[precision]\n" + body, "fp8.toml").table("precision");
  t.mark_used("plugin");  // the core's key, not the recipe's
  return t;
}

std::unique_ptr<loom::Precision> make(const std::string& name, const std::string& body = "",
                                      Device device = Device::cpu, bool deterministic = false) {
  loom::PluginInit init;
  init.config = precision_table(body);
  init.device = device;
  init.deterministic = deterministic;
  return registry().create_as<loom::PluginKind::precision>(name, init);
}

// A recipe with its linears registered, set up alone and given its memory.
struct Rig : loom::test::RecipeRig {
  Rig(const std::string& name, const std::string& body, const std::vector<loom::LinearDesc>& linears)
      : RecipeRig(make(name, body), linears) {}
  // The recipe's scales ("fp8.scale"), [3 * linears], slot 3 * linear + role (x, w, dy).
  std::vector<float> scales() {
    for (const loom::StateTensor& s : p->state_tensors())
      if (s.name == "fp8.scale") return {s.tensor.ptr<float>(), s.tensor.ptr<float>() + s.tensor.numel()};
    ADD_FAILURE() << "no fp8.scale state tensor";
    return {};
  }
  std::vector<double> counters() {
    for (const loom::StateTensor& s : p->state_tensors())
      if (s.name == "fp8.counters") return {s.tensor.ptr<double>(), s.tensor.ptr<double>() + 4};
    ADD_FAILURE() << "no fp8.counters state tensor";
    return {};
  }
};

std::vector<float> randn(size_t n, float scale, std::mt19937& g) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(g) * scale;
  return v;
}

Tensor t2(std::vector<float>& v, int64_t r, int64_t c) { return Tensor(v.data(), DType::f32, Device::cpu, {r, c}); }

float amax_of(const std::vector<float>& v) {
  float m = 0;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

// The value an FP8 GEMM sees: decode(encode(v * s)) / s, element by element.
std::vector<double> qdq(const std::vector<float>& v, float s, loom::fp8::Format f) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i)
    out[i] = static_cast<double>(loom::fp8::decode(loom::fp8::encode(v[i] * s, f), f) / s);
  return out;
}

// max |got - want| / max |want| for y = a b^T (a [m, k], b [n, k]) in float64.
double rel_err_abt(const std::vector<float>& got, const std::vector<double>& a, const std::vector<double>& b, int64_t m,
                   int64_t k, int64_t n) {
  double err = 0, ref = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p) s += a[static_cast<size_t>(i * k + p)] * b[static_cast<size_t>(j * k + p)];
      err = std::max(err, std::fabs(got[static_cast<size_t>(i * n + j)] - s));
      ref = std::max(ref, std::fabs(s));
    }
  return err / ref;
}

constexpr float kE4 = loom::fp8::kE4M3Max, kE5 = loom::fp8::kE5M2Max;

// TE's rule, as the recipe must apply it: (fp8_max / amax) / 2^margin.
float te_scale(float fp8_max, float amax, int margin) { return (fp8_max / amax) / std::ldexp(1.0f, margin); }

// One step of one linear (m x k input, n outputs): forward, backward, end_step.
// Magnitudes per step make the amaxes, and so the history window, move.
struct StepData {
  std::vector<float> x, w, dy, y, dx, dw;
};
StepData run_step(Rig& r, int64_t m, int64_t k, int64_t n, float xmag, float wmag, float dymag, std::mt19937& g) {
  StepData s{randn(m * k, xmag, g), randn(n * k, wmag, g), randn(m * n, dymag, g), std::vector<float>(m * n),
             std::vector<float>(m * k), std::vector<float>(n * k)};
  loom::ExecContext ctx;
  Tensor x = t2(s.x, m, k), w = t2(s.w, n, k), dy = t2(s.dy, m, n), y = t2(s.y, m, n), dx = t2(s.dx, m, k),
         dw = t2(s.dw, n, k);
  r.p->linear_forward(ctx, r.ids[0], x, w, y, nullptr);
  r.p->linear_backward(ctx, r.ids[0], x, w, dy, &dx, dw, false);
  r.p->end_step(ctx);
  return s;
}

// Delayed scaling over 6 steps of one linear against scales computed here: the
// window of the last `len` amaxes (max or most recent), the margin, the hybrid
// formats (E4M3 x and w, E5M2 dy); each step casts with the scales of the
// steps before. Tolerances: scales EXPECT_FLOAT_EQ (one fp32 division, then an
// exact power of two: the same rounding here and in the recipe); GEMMs 1e-5
// relative to a float64 product of the same cast operands (fp32 accumulation
// over k = 24 terms: ~24 * 6e-8).
void check_delayed(const std::string& algo, int len, int margin) {
  const int64_t m = 6, k = 24, n = 10;
  Rig r("fp8_delayed",
        loom::cat("amax_history_len = ", len, "\namax_compute_algo = \"", algo, "\"\nmargin = ", margin, "\n"),
        {{"layer.0.q_proj", k, n, m}});
  std::mt19937 g(42);
  const float mags[6][3] = {{1, 0.1f, 1e-3f}, {4, 0.05f, 2e-3f}, {0.5f, 0.2f, 1e-4f},
                            {2, 0.02f, 5e-3f}, {0.25f, 0.3f, 1e-3f}, {3, 0.1f, 3e-4f}};
  std::vector<std::vector<float>> hist(3);  // amaxes per role, oldest first
  std::vector<float> scale = {1, 1, 1};     // TE starts at 1
  const float maxes[3] = {kE4, kE4, kE5};
  for (int step = 0; step < 6; ++step) {
    StepData s = run_step(r, m, k, n, mags[step][0], mags[step][1], mags[step][2], g);
    // This step's GEMMs used the scales from before it.
    const auto qx = qdq(s.x, scale[0], loom::fp8::Format::e4m3), qw = qdq(s.w, scale[1], loom::fp8::Format::e4m3);
    const auto qdy = qdq(s.dy, scale[2], loom::fp8::Format::e5m2);
    EXPECT_LT(rel_err_abt(s.y, qx, qw, m, k, n), 1e-5) << "forward, step " << step + 1;
    // dx = q(dy) q(w): as a b^T with b = q(w)^T ([k, n]).
    std::vector<double> qwt(static_cast<size_t>(n * k));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < k; ++j) qwt[static_cast<size_t>(j * n + i)] = qw[static_cast<size_t>(i * k + j)];
    EXPECT_LT(rel_err_abt(s.dx, qdy, qwt, m, n, k), 1e-5) << "dgrad, step " << step + 1;
    std::vector<double> qdyt(static_cast<size_t>(m * n)), qxt(static_cast<size_t>(m * k));
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) qdyt[static_cast<size_t>(j * m + i)] = qdy[static_cast<size_t>(i * n + j)];
      for (int64_t j = 0; j < k; ++j) qxt[static_cast<size_t>(j * m + i)] = qx[static_cast<size_t>(i * k + j)];
    }
    EXPECT_LT(rel_err_abt(s.dw, qdyt, qxt, n, m, k), 1e-5) << "wgrad, step " << step + 1;
    // The new scales.
    const float a[3] = {amax_of(s.x), amax_of(s.w), amax_of(s.dy)};
    for (int role = 0; role < 3; ++role) {
      hist[role].push_back(a[role]);
      float window = 0;
      if (algo == "most_recent") window = a[role];
      else
        for (int i = std::max(0, static_cast<int>(hist[role].size()) - len); i < static_cast<int>(hist[role].size()); ++i)
          window = std::max(window, hist[role][static_cast<size_t>(i)]);
      scale[role] = te_scale(maxes[role], window, margin);
    }
    const std::vector<float> got = r.scales();
    ASSERT_EQ(got.size(), 3u);
    for (int role = 0; role < 3; ++role) EXPECT_FLOAT_EQ(got[role], scale[role]) << "role " << role << ", step " << step + 1;
  }
  EXPECT_EQ(r.counters()[2], 0.0) << "no update was skipped";
}

}  // namespace

TEST(Fp8Recipes, DelayedMaxOverHistoryWithMargin) { check_delayed("max", 3, 1); }
TEST(Fp8Recipes, DelayedMostRecent) { check_delayed("most_recent", 3, 0); }
TEST(Fp8Recipes, DelayedHistoryOfOne) { check_delayed("max", 1, 2); }

// Current scaling: every cast takes its scale from its own amax at once, so the
// first step already casts with fp8_max / amax (no step of scale 1).
TEST(Fp8Recipes, CurrentScalingUsesTheTensorsOwnAmax) {
  const int64_t m = 5, k = 16, n = 8;
  Rig r("fp8_current", "format = \"e4m3\"\n", {{"layer.0.up_proj", k, n, m}});
  std::mt19937 g(3);
  StepData s = run_step(r, m, k, n, 7.0f, 0.01f, 1e-6f, g);
  const std::vector<float> sc = r.scales();
  EXPECT_FLOAT_EQ(sc[0], kE4 / amax_of(s.x));
  EXPECT_FLOAT_EQ(sc[1], kE4 / amax_of(s.w));
  EXPECT_FLOAT_EQ(sc[2], kE4 / amax_of(s.dy));  // format "e4m3": dy in E4M3 too
  const auto qx = qdq(s.x, sc[0], loom::fp8::Format::e4m3), qw = qdq(s.w, sc[1], loom::fp8::Format::e4m3);
  EXPECT_LT(rel_err_abt(s.y, qx, qw, m, k, n), 1e-5);
}

// weight_cache = "step": the weight is cast once per optimizer step: a second
// micro-batch reads the first cast even though the tensor changed, and
// end_step drops the cast. ("layer" casts at every call, so it would read the
// changed tensor; the optimizer changes it only after end_step.)
TEST(Fp8Recipes, WeightCastOncePerOptimizerStep) {
  const int64_t m = 4, k = 8, n = 4;
  Rig r("fp8_delayed", "weight_cache = \"step\"\n", {{"layer.0.o_proj", k, n, m}});
  std::mt19937 g(5);
  std::vector<float> x = randn(m * k, 1, g), w = randn(n * k, 0.1f, g), y1(m * n), y2(m * n), y3(m * n);
  loom::ExecContext ctx;
  Tensor tx = t2(x, m, k), tw = t2(w, n, k), ty1 = t2(y1, m, n), ty2 = t2(y2, m, n), ty3 = t2(y3, m, n);
  r.p->linear_forward(ctx, 0, tx, tw, ty1, nullptr);
  std::vector<float> w_old = w;
  for (float& v : w) v *= -3.0f;  // what the optimizer would do only after end_step
  r.p->linear_forward(ctx, 0, tx, tw, ty2, nullptr);
  EXPECT_EQ(y1, y2) << "the second micro-batch must reuse the step's cast weight";
  r.p->end_step(ctx);
  r.p->linear_forward(ctx, 0, tx, tw, ty3, nullptr);
  EXPECT_NE(y1, y3) << "after end_step the new weights must be cast";
}

// A forward without a backward (validation) does not move delayed scales: its
// amaxes never enter the step's buffer, so the update keeps every scale and
// counts it (amax 0), warning once.
TEST(Fp8Recipes, ValidationForwardLeavesScales) {
  const int64_t m = 4, k = 8, n = 4;
  Rig r("fp8_delayed", "amax_history_len = 2\n", {{"layer.0.k_proj", k, n, m}});
  std::mt19937 g(6);
  run_step(r, m, k, n, 1, 0.1f, 1e-3f, g);
  const std::vector<float> before = r.scales();
  std::vector<float> x = randn(m * k, 1000, g), w = randn(n * k, 0.1f, g), y(m * n);
  loom::ExecContext ctx;
  Tensor tx = t2(x, m, k), tw = t2(w, n, k), ty = t2(y, m, n);
  r.p->linear_forward(ctx, 0, tx, tw, ty, nullptr);
  run_step(r, m, k, n, 1, 0.1f, 1e-3f, g);  // a training step: the large x above must not count
  const std::vector<float> after = r.scales();
  EXPECT_GT(after[0], before[0] / 10) << "a validation x of amax ~3000 leaked into the x scale";
}

// The LM head stays in fp32 (bitwise the fp32 GEMM) unless fp8_head = true.
TEST(Fp8Recipes, HeadInFullPrecisionUnlessAsked) {
  const int64_t m = 4, k = 16, n = 32;
  std::mt19937 g(9);
  std::vector<float> x = randn(m * k, 1, g), w = randn(n * k, 0.1f, g), want(m * n);
  loom::cpu::linear_forward(want.data(), n, x.data(), k, w.data(), m, k, n);
  for (bool fp8_head : {false, true}) {
    Rig r("fp8_delayed", fp8_head ? "fp8_head = true\n" : "",
          {{"layer.0.down_proj", k, k, m}, {"lm_head", k, n, m, loom::LinearRole::lm_head}});
    EXPECT_EQ(r.p->saved_activation_bytes(r.ids[1]), fp8_head ? static_cast<size_t>(m * k * 4) : 0u);
    EXPECT_EQ(r.scales().size(), fp8_head ? 6u : 3u);
    std::vector<float> y(m * n);
    loom::ExecContext ctx;
    Tensor tx = t2(x, m, k), tw = t2(w, n, k), ty = t2(y, m, n);
    r.p->linear_forward(ctx, r.ids[1], tx, tw, ty, nullptr);
    if (!fp8_head) {
      EXPECT_EQ(y, want);
    } else {
      EXPECT_NE(y, want);  // cast with scale 1: E4M3 keeps 3 mantissa bits
      EXPECT_LT(rel_err_abt(y, qdq(x, 1, loom::fp8::Format::e4m3), qdq(w, 1, loom::fp8::Format::e4m3), m, k, n), 1e-5);
    }
  }
}

// amax 0, inf or NaN: the scale stays positive and finite (the previous one),
// the update is counted as skipped, a non-finite amax as non-finite.
TEST(Fp8Recipes, AmaxEdgeCasesKeepTheScale) {
  const int64_t m = 4, k = 8, n = 4;
  for (const std::string plugin : {"fp8_delayed", "fp8_current"}) {
    SCOPED_TRACE(plugin);
    // A history of one step, so that an amax of 0 is the whole window (a
    // longer history would rightly keep scaling from the earlier amaxes).
    Rig r(plugin, plugin == "fp8_delayed" ? "amax_history_len = 1\n" : "", {{"layer.0.gate_proj", k, n, m}});
    std::mt19937 g(11);
    run_step(r, m, k, n, 2, 0.1f, 1e-3f, g);
    const std::vector<float> good = r.scales();
    const double skipped0 = r.counters()[2];
    for (float bad : {0.0f, INFINITY, NAN}) {
      std::vector<float> x = bad == 0.0f ? std::vector<float>(m * k, 0.0f) : randn(m * k, 1, g);
      if (bad != 0.0f) x[3] = bad;
      std::vector<float> w = randn(n * k, 0.1f, g), dy = randn(m * n, 1e-3f, g), y(m * n), dx(m * k), dw(n * k);
      loom::ExecContext ctx;
      Tensor tx = t2(x, m, k), tw = t2(w, n, k), tdy = t2(dy, m, n), ty = t2(y, m, n), tdx = t2(dx, m, k),
             tdw = t2(dw, n, k);
      r.p->linear_forward(ctx, 0, tx, tw, ty, nullptr);
      r.p->linear_backward(ctx, 0, tx, tw, tdy, &tdx, tdw, false);
      r.p->end_step(ctx);
      const std::vector<float> sc = r.scales();
      for (float s : sc) {
        EXPECT_TRUE(std::isfinite(s)) << "amax " << bad;
        EXPECT_GT(s, 0.0f) << "amax " << bad;
      }
      EXPECT_EQ(sc[0], good[0]) << "the x scale must be kept for amax " << bad;
      if (bad == 0.0f) {
        for (float v : y) EXPECT_EQ(v, 0.0f);
      }
    }
    const std::vector<double> c = r.counters();
    EXPECT_GE(c[2] - skipped0, 3.0) << "three x updates skipped";
    EXPECT_GE(c[3], 2.0) << "inf and NaN counted as non-finite";
    EXPECT_NE(r.p->log_summary().find("skipped updates"), std::string::npos) << r.p->log_summary();
  }
}

// precision.optimizer_state: AdamW's m and v in fp32 or bf16, apart from the
// master. Every FP8 recipe and bf16 take it; the default follows the master
// (fp32 with an fp32 master, bf16 with master = "bf16"); the CPU keeps fp32
// state only; any other value is refused naming the choices.
TEST(Fp8Recipes, OptimizerStateIsItsOwnKey) {
  using loom::test::expect_error;
  for (const char* plugin : {"fp8_delayed", "fp8_current", "fp8_block"}) {
    SCOPED_TRACE(plugin);
    EXPECT_EQ(make(plugin)->dtypes().optim_state, DType::f32);
    EXPECT_EQ(make(plugin, "optimizer_state = \"fp32\"\n")->dtypes().optim_state, DType::f32);
    expect_error([&] { make(plugin, "optimizer_state = \"bf16\"\n"); },
                 {"fp8.toml", "optimizer_state", "CPU", "optimizer_state = \"fp32\""});
    expect_error([&] { make(plugin, "optimizer_state = \"fp16\"\n"); }, {"fp8.toml", "optimizer_state", "fp32", "bf16"});
#ifdef LOOM_HAVE_CUDA
    struct Case {
      const char* body;
      DType state;
      bool master;
    };
    for (const Case& c : {Case{"", DType::f32, true}, Case{"optimizer_state = \"bf16\"\n", DType::bf16, true},
                          Case{"master = \"bf16\"\n", DType::bf16, false},
                          Case{"master = \"bf16\"\noptimizer_state = \"fp32\"\n", DType::f32, false}}) {
      SCOPED_TRACE(c.body);
      const loom::PrecisionDTypes dt = make(plugin, c.body, Device::cuda)->dtypes();
      EXPECT_EQ(dt.optim_state, c.state);
      EXPECT_EQ(dt.has_master, c.master);
      EXPECT_EQ(dt.param, DType::bf16);
    }
#endif
  }
#ifdef LOOM_HAVE_CUDA
  EXPECT_EQ(make("bf16", "", Device::cuda)->dtypes().optim_state, DType::f32);
  const loom::PrecisionDTypes bf16 = make("bf16", "optimizer_state = \"bf16\"\n", Device::cuda)->dtypes();
  EXPECT_EQ(bf16.optim_state, DType::bf16);
  EXPECT_TRUE(bf16.has_master);
  expect_error([] { make("bf16", "optimizer_state = \"fp8\"\n", Device::cuda); }, {"optimizer_state", "fp32", "bf16"});
#endif
}

// Every bad value: one loom::Error naming the file, the key and what to do.
TEST(Fp8Recipes, ConfigErrors) {
  using loom::test::expect_error;
  expect_error([] { make("fp8_delayed", "format = \"e5m2\"\n"); }, {"fp8.toml", "format", "hybrid", "e4m3"});
  expect_error([] { make("fp8_delayed", "format = 3\n"); }, {"fp8.toml", "format"});
  expect_error([] { make("fp8_delayed", "amax_history_len = 0\n"); }, {"fp8.toml", "amax_history_len"});
  expect_error([] { make("fp8_delayed", "amax_compute_algo = \"mean\"\n"); },
               {"amax_compute_algo", "max", "most_recent"});
  expect_error([] { make("fp8_delayed", "margin = 127\n"); }, {"margin", "126"});
  expect_error([] { make("fp8_delayed", "margin = -1\n"); }, {"margin"});
  expect_error([] { make("fp8_delayed", "fast_accum_fprop = \"yes\"\n"); }, {"fast_accum_fprop"});
  expect_error([] { make("fp8_delayed", "fast_acum_fprop = true\n"); }, {"fast_acum_fprop", "fast_accum_fprop"});
  expect_error([] { make("fp8_delayed", "master = \"fp16\"\n"); }, {"master", "fp32", "bf16"});
  expect_error([] { make("fp8_delayed", "stochastic_rounding = true\n"); },
               {"stochastic_rounding", "master = \"bf16\"", "fp8.toml"});
  expect_error([] { make("fp8_current", "master = \"bf16\"\n"); }, {"master", "CPU", "fp32"});
  for (const char* key : {"amax_history_len = 16", "amax_compute_algo = \"max\"", "margin = 1"})
    expect_error([&] { make("fp8_current", std::string(key) + "\n"); }, {"fp8_current", "fp8_delayed", "fp8.toml"});
  // Device cuda: built with the CUDA backend, the GPU path is constructed
  // (master = "bf16" included; nothing touches the GPU before setup);
  // without it, refused at construction with one message.
  expect_error([] { make("fp8_delayed", "weight_cache = \"micro_batch\"\n"); },
               {"fp8.toml", "weight_cache", "auto", "step", "layer"});
  expect_error([] { make("fp8_current", "weight_cache = 1\n"); }, {"fp8.toml", "weight_cache"});
  // The switches between the recipe's casts and the fused layers' kernels,
  // each one recipe's alone: fused_casts delayed scaling's (current scaling
  // measures a tensor before it can cast it), producer_amax current
  // scaling's (delayed scaling's kernels write FP8 outright; block scaling
  // measures each tile as it casts it). A wrong type names the key; another
  // recipe refuses it, saying why and whose key it is.
  struct Switch {
    const char* key;
    const char* owner;
    std::vector<std::pair<const char*, const char*>> refused;  // recipe, the why its message gives
  };
  const Switch switches[] = {
      {"fused_casts", "fp8_delayed", {{"fp8_current", "measures each tensor"}, {"fp8_block", "1x128 tile"}}},
      {"producer_amax", "fp8_current", {{"fp8_delayed", "fused_casts"}, {"fp8_block", "1x128 tile"}}}};
  for (const Switch& sw : switches) {
    const std::string key = sw.key, owner = sw.owner;
    EXPECT_NO_THROW(make(owner, key + " = false\n"));
    expect_error([&] { make(owner, key + " = \"yes\"\n"); }, {"fp8.toml", key});
    for (const auto& [recipe, why] : sw.refused)
      expect_error([&, r = std::string(recipe)] { make(r, key + " = true\n"); },
                   {"fp8.toml", key, recipe, why, owner});
  }
  // gemm_algo (loom/gemm_algo.hpp): read on every device, refused when
  // "fastest" meets a deterministic run.
  for (const char* plugin : {"fp8_delayed", "fp8_current"}) {
    for (const char* v : {"auto", "heuristic", "fastest"})
      EXPECT_NO_THROW(make(plugin, loom::cat("gemm_algo = \"", v, "\"\n"))) << plugin << " " << v;
    EXPECT_NO_THROW(make(plugin, "gemm_algo = \"auto\"\n", Device::cpu, /*deterministic=*/true));
    expect_error([&] { make(plugin, "gemm_algo = \"tuned\"\n"); }, {"fp8.toml", "gemm_algo", "heuristic", "fastest"});
    expect_error([&] { make(plugin, "gemm_algo = \"fastest\"\n", Device::cpu, /*deterministic=*/true); },
                 {"fp8.toml", "gemm_algo", "run.deterministic = true", "gemm_algo = \"heuristic\""});
  }
  for (const char* plugin : {"fp8_delayed", "fp8_current"}) {
#ifdef LOOM_HAVE_CUDA
    EXPECT_NO_THROW(make(plugin, "", Device::cuda));
    EXPECT_NO_THROW(make(plugin, "master = \"bf16\"\nstochastic_rounding = true\n", Device::cuda));
#else
    expect_error([&] { make(plugin, "", Device::cuda); }, {plugin, "cuda", "no CUDA backend", "run.device = \"cpu\""});
#endif
  }
}

// The workspace each weight_cache plans, on the CPU and (built with CUDA) on
// the GPU path, whose planning needs no GPU (what `loom check` prints as
// precision.workspace): "layer" holds the largest cast weight instead of
// every one; "auto" follows grad_accum. And keeps_wgrad_input: true for the
// FP8 linears of fixed rows, false for the full-precision head and for
// variable_rows linears.
TEST(Fp8Recipes, WeightCachePlansTheWorkspace) {
  const std::vector<loom::LinearDesc> linears = {{"layer.0.qkv_proj", 256, 768, 64},
                                                 {"layer.0.gate_up_proj", 256, 1024, 64},
                                                 {"layer.0.down_proj", 512, 256, 64},
                                                 {"layer.0.expert", 256, 512, 64, loom::LinearRole::hidden, true},
                                                 {"lm_head", 256, 320, 64, loom::LinearRole::lm_head}};
  std::vector<Device> devices = {Device::cpu};
#ifdef LOOM_HAVE_CUDA
  devices.push_back(Device::cuda);
#endif
  for (Device dev : devices) {
    SCOPED_TRACE(loom::device_name(dev));
    auto plan = [&](const std::string& mode, int accum, std::vector<bool>* keeps = nullptr) {
      loom::test::RecipeRig r(make("fp8_delayed", "weight_cache = \"" + mode + "\"\n", dev), linears, dev, accum);
      if (keeps)
        for (int id : r.ids) keeps->push_back(r.p->keeps_wgrad_input(id));
      return r.p->workspace_bytes();
    };
    std::vector<bool> keeps;
    const size_t step = plan("step", 1, &keeps), layer = plan("layer", 4);
    EXPECT_EQ(keeps, (std::vector<bool>{true, true, true, false, false}));
    const size_t elem = dev == Device::cpu ? 4 : 1;  // emulated casts in fp32; FP8 bytes on the GPU (256-aligned here)
    const size_t all = (768 * 256 + 1024 * 256 + 256 * 512 + 512 * 256) * elem, largest = 1024 * 256 * elem;
    // The GPU keeps W and Wᵀ per linear in "step" and one scratch in "layer".
    const size_t copies = dev == Device::cpu ? 1 : 2;
    EXPECT_EQ(step - layer, copies * all - largest);
    EXPECT_EQ(plan("auto", 1), layer);
    EXPECT_EQ(plan("auto", 2), step);
    EXPECT_EQ(plan("step", 3), step);
  }
}

// ---- Sessions ----

namespace {

fs::path temp_dir(const std::string& name) { return loom::test::temp_dir("fp8_" + name); }

std::string small_config(const fs::path& out, const std::string& precision) {
  std::ostringstream s;
  s << "[run]\nname = \"fp8\"\nout_dir = \"" << out.string() << "\"\ndevice = \"cpu\"\nseed = 5\nthreads = 2\n"
    << "log_level = \"warn\"\nplugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nhidden = 64\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nffn_hidden = 160\n"
    << "vocab_size = 96\nmax_seq_len = 64\n"
    << "[train]\nsteps = 10\nmicro_batch = 4\nseq_len = 31\ngrad_accum = 2\nlr = 3e-3\nmin_lr = 3e-4\n"
    << "warmup_steps = 2\nvalidation_every = 3\nvalidation_batches = 2\nlog_every = 5\n"
    << "[checkpoint]\nevery = 0\nresume = \"none\"\n"
    << "[precision]\n" << precision << "\n[attention]\nplugin = \"naive\"\n[sharding]\nplugin = \"none\"\n"
    << "[data]\nplugin = \"synthetic\"\npattern = \"ramp\"\n";
  return s.str();
}

loom::Config parse(const std::string& text, const std::vector<std::string>& ov = {}) {
  return loom::parse_config_string(text, "fp8_e2e.toml", ov);
}

using loom::test::state_bytes;

std::string slurp(const fs::path& p) {
  std::stringstream ss;
  ss << std::ifstream(p).rdbuf();
  return ss.str();
}

}  // namespace

// Save at step 6, resume in a new session: the same losses and, at the end,
// the same scales, amax history and counters, bitwise, as one run of 10 steps
// (history length 4, so the ring wraps; validation every 3 steps and two
// micro-batches per step, so the forward-only passes and the weight reuse are
// part of what must match).
TEST(Fp8Recipes, StateResumesBitwise) {
  for (const std::string plugin : {"fp8_delayed", "fp8_current"}) {
    SCOPED_TRACE(plugin);
    const std::string prec =
        "plugin = \"" + plugin + "\"" + (plugin == "fp8_delayed" ? "\namax_history_len = 4\nmargin = 1" : "");
    fs::path d = temp_dir("resume_" + plugin);
    loom::RunSummary full, first, second;
    std::map<std::string, std::vector<char>> full_state, resumed_state;
    {
      loom::Session s(parse(small_config(d / "full", prec)));
      full = s.train();
      full_state = state_bytes(s);
    }
    const std::vector<std::string> ov = {"checkpoint.every=3", "checkpoint.resume=auto"};
    {
      loom::Session s(parse(small_config(d / "split", prec), ov));
      first = s.train(6);
    }
    {
      loom::Session s(parse(small_config(d / "split", prec), ov));
      second = s.train();
      resumed_state = state_bytes(s);
    }
    ASSERT_EQ(full.steps.size(), 10u);
    ASSERT_EQ(second.first_step, 6);
    ASSERT_EQ(second.steps.size(), 4u);
    for (size_t i = 0; i < 6; ++i) EXPECT_EQ(first.steps[i].loss, full.steps[i].loss) << "step " << i + 1;
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(second.steps[i].loss, full.steps[6 + i].loss) << "step " << 7 + i;
    ASSERT_FALSE(full_state.empty());
    EXPECT_EQ(resumed_state, full_state) << "scales, history and counters must resume bitwise";
    // And the state did move: the scales are not all TE's starting 1.
    const auto& sc = full_state.at("fp8.scale");
    bool moved = false;
    for (size_t i = 0; i < sc.size() / 4; ++i) moved = moved || reinterpret_cast<const float*>(sc.data())[i] != 1.0f;
    EXPECT_TRUE(moved);
    // The checkpoint holds the state as tensors, listed in meta.json.
    const std::string meta = slurp(d / "split" / "checkpoints" / "step_00000009" / "meta.json");
    EXPECT_NE(meta.find("\"precision_tensors\""), std::string::npos);
    EXPECT_NE(meta.find("\"fp8.scale\""), std::string::npos);
    EXPECT_EQ(meta.find("\"precision_state\""), std::string::npos);
  }
}

// A checkpoint of another recipe resumes (the weights by name, the scales
// fresh), both ways: fp32 -> fp8_delayed -> fp32. On the CPU the non-FP8
// recipe is fp32 (bf16 runs on CUDA only; its checkpoints differ in dtypes,
// which the resume converts as for any recipe change).
TEST(Fp8Recipes, ResumeAcrossRecipes) {
  fs::path d = temp_dir("across");
  const std::vector<std::string> ov = {"checkpoint.every=3", "checkpoint.resume=auto", "train.validation_every=0"};
  const std::string cfg = small_config(d / "run", "plugin = \"fp32\"");
  {
    loom::Session s(parse(cfg, ov));
    s.train(3);
  }
  std::vector<std::string> to_fp8 = ov;
  to_fp8.push_back("precision.plugin=fp8_delayed");
  {
    loom::Session s(parse(cfg, to_fp8));
    s.initialise();
    // Fresh scales: every scale TE's starting 1, no step counted.
    for (const loom::StateTensor& t : loom::probe(s).precision().state_tensors()) {
      if (t.name == "fp8.scale")
        for (int64_t i = 0; i < t.tensor.numel(); ++i) ASSERT_EQ(t.tensor.ptr<float>()[i], 1.0f);
      if (t.name == "fp8.counters") ASSERT_EQ(t.tensor.ptr<double>()[1], 0.0);
    }
    loom::RunSummary r = s.train(6);
    ASSERT_EQ(r.first_step, 3);
    for (const auto& st : r.steps) EXPECT_TRUE(std::isfinite(st.loss));
  }
  {
    loom::Session s(parse(cfg, ov));  // back to fp32 from the fp8_delayed checkpoint of step 6
    loom::RunSummary r = s.train(9);
    ASSERT_EQ(r.first_step, 6);
    for (const auto& st : r.steps) EXPECT_TRUE(std::isfinite(st.loss));
  }
  // Through the command line, for the log: the scales start fresh, said once.
  fs::path d2 = temp_dir("across_cli");
  std::ofstream(d2 / "c.toml") << small_config(d2 / "run", "plugin = \"fp32\"");
  const std::string base = std::string(LOOM_CLI) + " train " + (d2 / "c.toml").string() +
                           " --set run.log_level=info --set checkpoint.every=2 --set checkpoint.resume=auto";
  ASSERT_EQ(std::system((base + " --set train.steps=2 > " + (d2 / "a.txt").string() + " 2>&1").c_str()), 0);
  ASSERT_EQ(std::system((base + " --set train.steps=5 --set precision.plugin=fp8_delayed > " + (d2 / "b.txt").string() +
                         " 2>&1").c_str()),
            0)
      << slurp(d2 / "b.txt");
  const std::string log = slurp(d2 / "b.txt");
  EXPECT_NE(log.find("written with precision \"fp32\""), std::string::npos) << log;
  EXPECT_NE(log.find("scales start fresh"), std::string::npos) << log;
  // The log line on log steps (log_every = 5).
  EXPECT_NE(log.find("precision: fp8_delayed scales"), std::string::npos) << log;
  EXPECT_NE(log.find("skipped updates"), std::string::npos) << log;
}

// The memory plan (what `loom check` prints) counts the recipe's saved
// activations: the cast x of every FP8 linear (2 layers x q, k, v, o, gate,
// up, down, x [N, in] in fp32; the head stays in fp32 and saves nothing). And
// since the recipe keeps x itself (keeps_wgrad_input), the blocks do not keep
// the fp32 inputs read only by those linears' wgrad: per layer ln1 [N, h],
// ln2 [N, h] and the SwiGLU output [N, f], replaced by one shared scratch
// [N, max(h, f)] ("scratch.linear_input"). So the activations of fp8_delayed
// are fp32's plus the saved x minus L * N * (2h + f) * 4 plus N * f * 4, for
// both layer variants.
TEST(Fp8Recipes, MemoryPlanCountsSavedActivations) {
  for (const std::string layers : {"native", "fused"}) {
    SCOPED_TRACE(layers);
    fs::path d = temp_dir("plan_" + layers);
    const std::vector<std::string> ov = {"model.layers=" + layers};
    loom::Session fp8(parse(small_config(d / "a", "plugin = \"fp8_delayed\""), ov));
    loom::Session fp32(parse(small_config(d / "b", "plugin = \"fp32\""), ov));
    // The test-only recipe answering keeps_wgrad_input = false: the blocks keep every input, as before.
    std::string keep = "plugin = \"fp8_delayed_bf16_x\"";
    loom::Session kept(parse(small_config(d / "c", keep),
                             {"model.layers=" + layers, "run.plugin_path=[\"" + std::string(LOOM_TEST_PLUGIN_DIR) +
                                                            "\", \"" + std::string(LOOM_TEST_FP8_PLUGIN_DIR) + "\"]"}));
    const int64_t N = 4 * 31, h = 64, f = 160, L = 2;
    // native: q, k, v, o and gate, up read [N, h], down [N, f]; fused: qkv, o, gate_up [N, h], down [N, f].
    const int64_t hs = layers == "native" ? 6 : 3;
    const size_t per_layer = static_cast<size_t>((hs * N * h + N * f) * 4);
    size_t saved = 0;
    bool scratch = false;
    for (const loom::ArenaBlock& b : loom::probe(fp8).memory_plan().blocks()) {
      if (b.name == "precision.saved_activations") saved = b.bytes;
      if (b.name == "scratch.linear_input") {
        scratch = true;
        EXPECT_EQ(b.bytes, static_cast<size_t>(N * std::max(h, f) * 4));
      }
      EXPECT_NE(b.name, "ln1.0");
      EXPECT_NE(b.name, "ln2.1");
      EXPECT_NE(b.name, "swi.0");
    }
    EXPECT_TRUE(scratch);
    EXPECT_EQ(saved, 2 * per_layer);
    const size_t a8 = loom::probe(fp8).memory_plan().category_bytes(loom::MemCategory::activations);
    const size_t a8_kept = loom::probe(kept).memory_plan().category_bytes(loom::MemCategory::activations);
    const size_t a32 = loom::probe(fp32).memory_plan().category_bytes(loom::MemCategory::activations);
    // Every block size here is a multiple of the arena alignment but the saved activations' total.
    EXPECT_GE(a8_kept, a32 + saved);
    EXPECT_LE(a8_kept, a32 + saved + loom::ArenaPlan::kAlign);
    const size_t dropped = static_cast<size_t>(L * N * (2 * h + f) * 4), added = static_cast<size_t>(N * f * 4);
    EXPECT_EQ(a8, a8_kept - dropped + added) << "fp8 " << a8 << ", keeping x " << a8_kept;
  }
}

// Training losses are bitwise those of the recipe that lets the blocks keep
// every linear input (the FP8 wgrad never read it), native and fused layers,
// with and without recompute = "full".
TEST(Fp8Recipes, DroppingTheBlocksLinearInputsKeepsTheLossesBitwise) {
  const std::string dirs =
      "run.plugin_path=[\"" + std::string(LOOM_TEST_PLUGIN_DIR) + "\", \"" + LOOM_TEST_FP8_PLUGIN_DIR + "\"]";
  for (const std::string layers : {"native", "fused"})
    for (const std::string recompute : {"none", "full"}) {
      SCOPED_TRACE(layers + " recompute " + recompute);
      fs::path d = temp_dir("keeps_x_" + layers + recompute);
      const std::vector<std::string> ov = {"model.layers=" + layers, "model.recompute=" + recompute, dirs,
                                           "train.steps=4", "train.validation_every=2"};
      loom::Session a(parse(small_config(d / "a", "plugin = \"fp8_delayed\""), ov));
      loom::Session b(parse(small_config(d / "b", "plugin = \"fp8_delayed_bf16_x\""), ov));
      loom::test::expect_same_losses(a.train(), b.train(), 4);
      EXPECT_EQ(state_bytes(a), state_bytes(b));
    }
}

// weight_cache = "layer" casts every weight again per call into one scratch,
// "step" once per step into a copy per linear: the same scales, the same
// bits, so the losses, validation losses and the FP8 state (scales, history,
// counters) are bitwise equal, under both scalings, with two micro-batches
// per step (the small config's grad_accum = 2) and with one ("auto"). And the
// planned workspace holds one weight (the largest) instead of all.
TEST(Fp8Recipes, WeightCacheLayerMatchesStepBitwise) {
  for (const std::string plugin : {"fp8_delayed", "fp8_current"})
    for (const std::string accum : {"1", "2"}) {
      SCOPED_TRACE(plugin + " grad_accum " + accum);
      fs::path d = temp_dir("wcache_" + plugin + accum);
      const std::vector<std::string> ov = {"train.grad_accum=" + accum, "train.steps=5", "train.validation_every=2"};
      std::map<std::string, size_t> ws = loom::test::weight_cache_modes_match(
          [&](const std::string& mode) {
            return parse(small_config(d / mode, "plugin = \"" + plugin + "\"\nweight_cache = \"" + mode + "\""), ov);
          },
          5);
      // Native layers: per layer q, o [64, 64], k, v [32, 64], gate, up [160, 64], down [64, 160].
      const size_t all = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 160 * 64) * 4, largest = 160 * 64 * 4;
      EXPECT_EQ(ws["step"] - ws["layer"], all - largest);
      EXPECT_EQ(ws["auto"], accum == "1" ? ws["layer"] : ws["step"]);
    }
}

// Emulated FP8 on the quickstart model trains like fp32, on the fortune corpus,
// 300 steps, micro-batch 8 (the quickstart's own is 16; 8 keeps CI on two cores
// to a few minutes).
//
// One run's final validation loss is a poor witness. Training is chaotic: any
// change of rounding moves the end point about as far as FP8 does. Measured
// with this test's settings:
//
//   seed          fp32     fp8_delayed        fp8_current
//   11           2.5150    2.5200 (+0.20%)    2.5184 (+0.13%)
//   22           2.6171    2.6455 (+1.09%)    2.5694 (-1.82%)
//   33           2.5890    2.6181 (+1.12%)    2.5903 (+0.05%)
//   mean         2.5737    +0.81%             -0.56%
//
// fp32 alone spans 4% over the seeds. The single-seed test this replaces put
// fp8_delayed at +1.37% on an Intel machine and +2.27% on an AMD one, for the
// same seed, when the CPU GEMMs were OpenBLAS's: a 2% bound on one run sat
// inside that spread.
//
// Why the bounds below hold on any x86-64 processor:
//   - The CPU path's arithmetic is the same bits on every x86-64 processor
//     (Loom's fixed-order fma GEMMs, chunk-ordered reductions: docs/
//     ARCHITECTURE.md, "Numerics"; CpuGemm.RecordedBitsOfAFixedProblem and
//     TrainE2E.LossBitsAreTheSameOnEveryProcessor hold it). So this test
//     computes exactly the table above everywhere, with any thread count.
//   - The bounds are far from the measured values, so a future change of
//     rounding (a kernel reordered), which acts like another seed, does not
//     cross them by chance. The mean over three seeds, each with its own
//     initial weights and data order, must be within 2% of fp32's mean. The
//     single-seed gaps have a standard deviation of 0.5% (delayed) and 1.1%
//     (current), so the mean of three has 0.25% and 0.64%: the bound is 4.8
//     and 2.3 of those above the measured means. Each seed's FP8 run must also
//     learn, and be within 5% of its fp32 twin (largest measured: 1.82%).
//   - What the bounds catch: a wrong scale, a saturating format or stale
//     recipe state cost far more than 2% (the hostile-input tests show a stale
//     dy scale cutting the gradient norm by 16% in one step).
//
// LOOM_FP8_CONVERGENCE_MICRO_BATCH and LOOM_FP8_CONVERGENCE_STEPS change the
// batch and the step count (the table then no longer applies);
// LOOM_FP8_CONVERGENCE_THREADS the threads (the table still applies).
TEST(Fp8Recipes, QuickstartTrainsLikeFp32AcrossSeeds) {
  const fs::path corpus = "/usr/share/games/fortunes";
  ASSERT_TRUE(fs::exists(corpus)) << "fortunes package not installed (scripts/setup.sh installs it)";
  auto env_int = [](const char* name, int def) { return std::getenv(name) ? std::atoi(std::getenv(name)) : def; };
  const int steps = env_int("LOOM_FP8_CONVERGENCE_STEPS", 300);
  const int micro_batch = env_int("LOOM_FP8_CONVERGENCE_MICRO_BATCH", 8);
  // Threads change no bit of the CPU path (TrainE2E.LossBitsAreTheSameOnEveryProcessor
  // runs 1 and 2): a machine with more cores may use them.
  const int threads = env_int("LOOM_FP8_CONVERGENCE_THREADS", 2);
  fs::path d = temp_dir("quickstart_mb" + std::to_string(micro_batch));
  const std::string cmd = std::string(LOOM_CLI) + " prepare text " + (d / "data").string() + " " + corpus.string() +
                          " > " + (d / "prepare.log").string() + " 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "loom prepare text failed; see " << (d / "prepare.log");
  auto run = [&](const std::string& plugin, int seed) {
    const std::string out = plugin + "_" + std::to_string(seed);
    std::vector<std::string> ov = {
        "run.out_dir=\"" + (d / out).string() + "\"",
        "run.plugin_path=[\"" + std::string(LOOM_TEST_PLUGIN_DIR) + "\"]", "run.log_level=\"warn\"",
        "data.train=\"" + (d / "data" / "train_*.bin").string() + "\"",
        "data.val=\"" + (d / "data" / "val.bin").string() + "\"", "train.steps=" + std::to_string(steps),
        "train.validation_every=" + std::to_string(steps), "train.validation_batches=8", "checkpoint.every=0",
        "checkpoint.resume=none", "run.threads=" + std::to_string(threads), "precision.plugin=" + plugin,
        "train.micro_batch=" + std::to_string(micro_batch), "run.seed=" + std::to_string(seed)};
    loom::Session s(loom::load_config(fs::path(LOOM_SOURCE_DIR) / "configs" / "quickstart.toml", ov));
    loom::RunSummary r = s.train();
    EXPECT_EQ(r.val_losses.size(), 2u) << out;
    return r.val_losses.empty() ? std::nan("") : r.val_losses.back().second;
  };
  const std::vector<int> seeds = {11, 22, 33};
  const std::vector<std::string> recipes = {"fp32", "fp8_delayed", "fp8_current"};
  std::map<std::string, std::vector<double>> val;
  for (const std::string& plugin : recipes)
    for (int seed : seeds) val[plugin].push_back(run(plugin, seed));
  auto mean = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / v.size(); };
  const double ref = mean(val["fp32"]);
  std::printf("quickstart model, micro_batch %d, %d steps, validation loss by seed", micro_batch, steps);
  for (int seed : seeds) std::printf(" %d", seed);
  std::printf(":\n");
  for (const std::string& plugin : recipes) {
    std::printf("  %-12s", plugin.c_str());
    for (size_t i = 0; i < seeds.size(); ++i) {
      const double v = val[plugin][i], f = val["fp32"][i];
      std::printf("  %.4f (%+.2f%%)", v, 100.0 * (v - f) / f);
      EXPECT_LT(v, 5.55 - 1.5) << plugin << " seed " << seeds[i] << " did not learn";
      if (plugin != "fp32")
        EXPECT_LT(std::fabs(v - f) / f, 0.05) << plugin << " seed " << seeds[i] << ": " << v << " against fp32 " << f;
    }
    const double m = mean(val[plugin]);
    std::printf("  mean %.4f (%+.2f%%)\n", m, 100.0 * (m - ref) / ref);
    if (plugin != "fp32")
      EXPECT_LT(std::fabs(m - ref) / ref, 0.02) << plugin << ": mean validation loss " << m << ", fp32's " << ref;
  }
}

// Checkpoints of format 2 to 4 recorded the recipe state as an opaque hex
// string, "precision_state", which no recipe filled: an empty one resumes,
// one holding bytes is refused, naming the field and what to do. (The
// COMPLETE marker is rewritten in its legacy form, which does not certify
// meta.json, as those looms wrote it.)
TEST(Fp8Recipes, OldOpaquePrecisionStateIsReadOnlyWhenEmpty) {
  fs::path d = temp_dir("old_state");
  const std::vector<std::string> ov = {"checkpoint.every=2", "checkpoint.resume=auto", "train.validation_every=0"};
  const std::string cfg = small_config(d / "run", "plugin = \"fp8_delayed\"");
  {
    loom::Session s(parse(cfg, ov));
    s.train(2);
  }
  const fs::path step = d / "run" / "checkpoints" / "step_00000002";
  const std::string fresh = slurp(step / "meta.json");
  auto rewrite = [&](const std::string& state) {
    nlohmann::json meta = nlohmann::json::parse(fresh);
    meta["version"] = 4;
    meta.erase("precision_tensors");
    meta["precision_state"] = state;
    std::ofstream(step / "meta.json", std::ios::trunc) << meta.dump(2);
    std::ofstream(step / "COMPLETE", std::ios::trunc) << "{\"step\": 2}\n";
  };
  rewrite("");
  {
    loom::Session s(parse(cfg, ov));
    s.initialise();
    EXPECT_EQ(s.step(), 2);
  }
  rewrite("0a0b0c");
  loom::test::expect_error(
      [&] {
        loom::Session s(parse(cfg, ov));
        s.initialise();
      },
      {"step_00000002", "format version 4", "\"precision_state\"", "3 bytes", "checkpoint.resume = \"none\""});
}

// A checkpoint of the bf16 recipe (bf16 params, fp32 master) resumes under
// fp8_delayed: the fp32 params come from the master copy exactly, the scales
// start fresh. The bf16 recipe runs on CUDA only, so its checkpoint is made
// here from an fp32 one, as the bf16 recipe writes it (params rounded to
// bf16, the fp32 values as the master copy, meta.json saying bf16). The other
// way, fp8_delayed -> bf16, needs a GPU; fp8_delayed -> fp32 is
// ResumeAcrossRecipes.
TEST(Fp8Recipes, Bf16CheckpointResumesUnderFp8Delayed) {
  fs::path d = temp_dir("from_bf16");
  const std::vector<std::string> ov = {"checkpoint.every=2", "checkpoint.resume=auto", "train.validation_every=0"};
  {
    loom::Session s(parse(small_config(d / "fp32", "plugin = \"fp32\""), ov));
    s.train(2);
  }
  const fs::path src = d / "fp32" / "checkpoints" / "step_00000002";
  const fs::path root = d / "bf16" / "checkpoints";
  fs::create_directories(root);
  loom::ckpt::CheckpointReader r(src.string(), 0);
  std::vector<std::vector<char>> keep;  // tensor memory until write_shard
  loom::ckpt::CheckpointWriter w(root.string(), 2, 0);
  std::map<std::string, std::vector<float>> masters;
  for (const std::string& name : r.names()) {
    const loom::ckpt::TensorRecord& rec = r.info(name);
    ASSERT_EQ(rec.dtype, DType::f32) << name;
    int64_t n = 1;
    for (int64_t x : rec.shape) n *= x;
    std::vector<float> v(static_cast<size_t>(n));
    Tensor t(v.data(), DType::f32, Device::cpu, {n});
    r.read(name, t);
    if (name.rfind("params.", 0) == 0) {
      const std::string unit = name.substr(7);
      std::vector<char> b(static_cast<size_t>(n) * 2);
      auto* h = reinterpret_cast<uint16_t*>(b.data());
      for (int64_t i = 0; i < n; ++i) h[i] = loom::hf::f32_to_bf16(v[static_cast<size_t>(i)]);
      keep.push_back(std::move(b));
      w.add(name, Tensor(keep.back().data(), DType::bf16, Device::cpu, {n}));
      masters[unit] = v;
      std::vector<char> m(reinterpret_cast<char*>(v.data()), reinterpret_cast<char*>(v.data() + n));
      keep.push_back(std::move(m));
      w.add("master." + unit, Tensor(keep.back().data(), DType::f32, Device::cpu, {n}));
    } else {
      keep.emplace_back(reinterpret_cast<char*>(v.data()), reinterpret_cast<char*>(v.data() + n));
      w.add(name, Tensor(keep.back().data(), DType::f32, Device::cpu, {n}));
    }
  }
  const uint32_t crc = w.write_shard();
  nlohmann::json meta = nlohmann::json::parse(slurp(src / "meta.json"));
  meta["precision"] = "bf16";
  meta["dtypes"]["params"] = "bf16";
  meta["dtypes"]["activation"] = "bf16";
  meta["dtypes"]["master"] = true;
  meta["precision_tensors"] = nlohmann::json::array();
  meta["shard_header_crc32"] = {crc};
  loom::ckpt::CheckpointWriter::write_meta(root.string(), 2, meta.dump(2));
  loom::ckpt::CheckpointWriter::mark_complete(root.string(), 2);

  std::vector<std::string> ov8 = ov;
  ov8.push_back("checkpoint.dir=\"" + root.string() + "\"");
  loom::Session s(parse(small_config(d / "fp8", "plugin = \"fp8_delayed\""), ov8));
  s.initialise();
  ASSERT_EQ(s.step(), 2);
  for (const loom::StateTensor& t : loom::probe(s).precision().state_tensors()) {
    if (t.name == "fp8.scale")
      for (int64_t i = 0; i < t.tensor.numel(); ++i) ASSERT_EQ(t.tensor.ptr<float>()[i], 1.0f) << "fresh scales";
    if (t.name == "fp8.counters") EXPECT_EQ(t.tensor.ptr<double>()[1], 0.0);
  }
  // The fp32 params are the master copy, bit for bit (not the bf16 rounding).
  for (const auto& u : loom::probe(s).units()) {
    const auto it = masters.find(u.info->name);
    ASSERT_NE(it, masters.end()) << u.info->name;
    const float* p = u.params.ptr<const float>();
    for (size_t i = 0; i < it->second.size(); ++i) ASSERT_EQ(p[i], it->second[i]) << u.info->name << " " << i;
  }
  loom::RunSummary run = s.train(4);
  ASSERT_EQ(run.steps.size(), 2u);
  for (const auto& st : run.steps) EXPECT_TRUE(std::isfinite(st.loss));
}

// Resuming the same recipe with a setting that sizes its state changed (here
// the amax history length) is refused, naming the state tensor and what to do.
TEST(Fp8Recipes, StateOfAnotherLayoutIsRefused) {
  fs::path d = temp_dir("layout");
  const std::vector<std::string> ov = {"checkpoint.every=2", "checkpoint.resume=auto", "train.validation_every=0"};
  {
    loom::Session s(parse(small_config(d / "run", "plugin = \"fp8_delayed\"\namax_history_len = 4"), ov));
    s.train(2);
  }
  loom::test::expect_error(
      [&] {
        loom::Session s(parse(small_config(d / "run", "plugin = \"fp8_delayed\"\namax_history_len = 8"), ov));
        s.initialise();
      },
      {"step_00000002", "fp8.amax_history", "[4,", "[8,", "checkpoint.resume = \"none\""});
}
