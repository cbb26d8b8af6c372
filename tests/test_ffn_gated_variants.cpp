// model.ffn = "geglu" and "reglu" (blocks/ffn_geglu.cpp, blocks/ffn_reglu.cpp):
// block variants that are each their own file and one row of the factory's
// table (blocks/block_table.cpp). For each, its gradient against central
// differences of the loss, its recompute paths against keeping everything,
// and what it shares with and changes from the dense block.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <utility>
#include <sstream>
#include <string>
#include <vector>

#include "config/run_config.hpp"
#include "loom/model.hpp"
#include "reliability_util.hpp"
#include "test_util.hpp"
#include "train/session_probe.hpp"

namespace fs = std::filesystem;

namespace {

constexpr int64_t kB = 2, kS = 24, kN = kB * kS, kV = 64;

std::string config(const fs::path& out, const std::string& ffn) {
  std::ostringstream s;
  s << "[run]\nout_dir = \"" << out.string() << "\"\ndevice = \"cpu\"\nseed = 5\nthreads = 2\n"
    << "plugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nhidden = 32\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nffn_hidden = 56\n"
    << "vocab_size = " << kV << "\nmax_seq_len = 32\nffn = \"" << ffn << "\"\ninit_std = 0.2\n"
    << "[train]\nsteps = 20\nmicro_batch = " << kB << "\nseq_len = " << kS << "\nlr = 1e-2\nwarmup_steps = 0\n"
    << "[checkpoint]\nevery = 0\nresume = \"none\"\n"
    << "[precision]\nplugin = \"fp32\"\n[attention]\nplugin = \"naive\"\n[sharding]\nplugin = \"none\"\n"
    << "[data]\nplugin = \"synthetic\"\npattern = \"ramp\"\n";
  return s.str();
}

loom::Config parse(const fs::path& out, const std::string& ffn, const std::vector<std::string>& overrides = {}) {
  return loom::parse_config_string(config(out, ffn), ffn + ".toml", overrides);
}

// A gated variant under test: its name, and the central differences' tolerance
// (a fraction of the directional derivative |g|; each is justified where the
// test states it).
struct Variant {
  const char* name;
  double fd_step;       // the central differences' step along the unit direction
  double fd_tolerance;  // of |g|
};

class GatedFfnVariant : public ::testing::TestWithParam<Variant> {};

// A random batch (a fixed seed per call site: the class of inputs, not one hand-picked example).
void load_random_batch(loom::Session& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> tok(0, kV - 1);
  std::vector<int32_t> in(kN), tg(kN);
  for (int64_t i = 0; i < kN; ++i) {
    in[static_cast<size_t>(i)] = tok(rng);
    tg[static_cast<size_t>(i)] = tok(rng);
  }
  loom::probe(s).load_batch(in.data(), tg.data());
}

// The mean loss of the loaded batch, its gradients left in place.
double loss_and_grads(loom::Session& s) {
  loom::SessionProbe p(s);
  p.zero_grads();
  p.forward(true, 1.0f / static_cast<float>(kN));
  p.backward();
  return p.batch_loss();
}

const std::vector<std::string>& ffn_params() {
  static const std::vector<std::string> names = {
      "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
      "model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.gate_proj.weight",
      "model.layers.0.post_attention_layernorm.weight", "model.embed_tokens.weight"};
  return names;
}

}  // namespace

// The whole model's gradient against central differences of the loss along
// the gradient's direction (restricted to the variant's layers' matrices, a
// norm gain before them and the embedding under them), on random batches:
// the directional derivative is then |g| (about 3 here). fp32 bounds the
// comparison: with step 2e-3 along a unit direction the rounding of the loss
// (~4.2, ~6e-8 relative, twice) gives ~1.3e-4 absolute (~5e-5 of |g|).
//   GeGLU: the curvature's term (eps^2/6 of the third derivative) is about
//   as much (measured: 1.2e-3 of |g| at step 1e-2, 7e-5 at 2e-3, as eps^2):
//   tolerance 1e-3 of |g|. A wrong activation derivative (the tanh term's
//   3a z^2 dropped moves it by ~1e-2 of |g|; SiLU's in place of GELU's, gate
//   and up swapped, by more) fails it.
//   ReGLU: m = relu(g) u is bilinear in (g, u) where g > 0 and zero where not,
//   so away from g = 0 the loss is as smooth as the rest of the model; but a
//   step moves gate pre-activations across zero (5,376 of them: N x
//   ffn_hidden x 2 layers), and a central difference across a kink is off by
//   the kink's slope change times the step. Measured at step 2e-3: 1.9e-3,
//   1.8e-4 and 1.8e-4 of |g| on the three batches (1.1e-3 at step 1e-3: the
//   kinks, not the rounding). Tolerance 5e-3 of |g|. A wrong derivative is
//   off by ~45%: relu'(g) taken as 1 in dg, or du = dm g without the relu,
//   each measured at 0.43-0.47 of |g|.
TEST_P(GatedFfnVariant, GradientMatchesFiniteDifferences) {
  const std::string ffn = GetParam().name;
  loom::Session s(parse(loom::test::temp_dir(ffn + "_fd") / "run", ffn));
  s.initialise();
  loom::SessionProbe p(s);
  for (uint32_t trial = 0; trial < 3; ++trial) {
    load_random_batch(s, 100 + trial);
    loss_and_grads(s);
    std::vector<std::vector<float>> w0, g;
    double norm2 = 0;
    for (const std::string& n : ffn_params()) {
      w0.push_back(p.read_param(n));
      g.push_back(p.read_param(n, true));
      for (float x : g.back()) norm2 += static_cast<double>(x) * x;
    }
    const double norm = std::sqrt(norm2);  // the directional derivative along g / |g|
    ASSERT_GT(norm, 1e-2);
    const double eps = GetParam().fd_step;
    auto shifted = [&](double sign) {
      for (size_t i = 0; i < w0.size(); ++i) {
        std::vector<float> w = w0[i];
        for (size_t j = 0; j < w.size(); ++j) w[j] += static_cast<float>(sign * eps * g[i][j] / norm);
        p.write_param(ffn_params()[i], w.data());
      }
      return loss_and_grads(s);
    };
    const double fd = (shifted(+1) - shifted(-1)) / (2 * eps);
    for (size_t i = 0; i < w0.size(); ++i) p.write_param(ffn_params()[i], w0[i].data());
    EXPECT_NEAR(fd, norm, GetParam().fd_tolerance * norm) << ffn << " trial " << trial;
    std::printf("[%s fd] trial %u: analytic %.6f, central difference %.6f (rel %.2e)\n", ffn.c_str(), trial, norm,
                fd, std::abs(fd - norm) / norm);
  }
}

// Recomputing the activation (selective) or the whole layer (full) gives the
// gradients of keeping everything, bit for bit: the same ops on the same
// values, only when they run differs.
TEST_P(GatedFfnVariant, RecomputeGivesTheSameGradients) {
  const std::string ffn = GetParam().name;
  const fs::path d = loom::test::temp_dir(ffn + "_recompute");
  auto grads = [&](const std::string& recompute) {
    loom::Session s(parse(d / recompute, ffn, {"model.recompute=\"" + recompute + "\""}));
    s.initialise();
    load_random_batch(s, 42);
    const double loss = loss_and_grads(s);
    std::vector<std::vector<float>> out;
    for (const std::string& n : ffn_params()) out.push_back(loom::probe(s).read_param(n, true));
    return std::make_pair(loss, out);
  };
  const auto none = grads("none");
  for (const std::string r : {"selective", "full"}) {
    const auto other = grads(r);
    EXPECT_EQ(other.first, none.first) << r;
    for (size_t i = 0; i < none.second.size(); ++i) EXPECT_EQ(other.second[i], none.second[i]) << r << " " << ffn_params()[i];
  }
}

// The dense layout (the same HF names, shapes and roles: checkpoints and
// initialisation are shared), another function: from the same initial
// weights, the variant, SwiGLU and every other gated variant give different
// losses; and the run learns.
TEST_P(GatedFfnVariant, SharesTheDenseLayoutButComputesAnotherFunction) {
  const std::string ffn = GetParam().name;
  loom::ModelSpec spec;
  spec.hidden = 32;
  spec.num_layers = 2;
  spec.num_heads = 4;
  spec.num_kv_heads = 2;
  spec.ffn_hidden = 56;
  spec.vocab_size = kV;
  const loom::Model dense(spec, "native", "dense"), variant(spec, "native", ffn);
  ASSERT_EQ(dense.units().size(), variant.units().size());
  for (size_t u = 0; u < dense.units().size(); ++u) {
    ASSERT_EQ(dense.units()[u].params.size(), variant.units()[u].params.size());
    for (size_t i = 0; i < dense.units()[u].params.size(); ++i) {
      EXPECT_EQ(dense.units()[u].params[i].name, variant.units()[u].params[i].name);
      EXPECT_EQ(dense.units()[u].params[i].shape, variant.units()[u].params[i].shape);
      EXPECT_EQ(dense.units()[u].params[i].role, variant.units()[u].params[i].role);
    }
  }
  const fs::path d = loom::test::temp_dir(ffn + "_vs_others");
  auto first_loss = [&](const std::string& other) {
    loom::Session s(parse(d / other, ffn, {"model.ffn=\"" + other + "\""}));
    s.initialise();
    load_random_batch(s, 9);
    return loss_and_grads(s);
  };
  const double mine = first_loss(ffn);
  for (const std::string other : {"dense", "geglu", "reglu"}) {
    if (other == ffn) continue;
    const double theirs = first_loss(other);
    EXPECT_GT(std::abs(mine - theirs), 1e-3) << ffn << " " << mine << ", " << other << " " << theirs;
  }

  loom::Session s(parse(d / "train", ffn));
  const loom::RunSummary r = s.train();
  ASSERT_EQ(r.steps.size(), 20u);
  EXPECT_LT(r.steps.back().loss, r.steps.front().loss - 0.5);
}

// On a device the host activation is refused when the run is planned,
// before any GPU work, naming the key, the value and what to use: `loom
// check` of a CUDA workload (bf16 recipe, cuDNN) planned for an H100 it
// cannot see, so no GPU is needed. The CUDA recipes are built only with CUDA.
#ifdef LOOM_HAVE_CUDA
TEST_P(GatedFfnVariant, RefusesACudaRunWhenPlanned) {
  const std::string ffn = GetParam().name;
  const std::string cfg = (fs::path(LOOM_SOURCE_DIR) / "configs" / "bench" / "llama-125m.toml").string();
  const loom::test::ProcResult r = loom::test::run_shell(std::string(LOOM_CLI) + " check " + cfg +
                                                         " --gpu h100 --no-scan --set 'model.ffn=\"" + ffn + "\"'");
  EXPECT_NE(r.code, 0) << r.out;
  for (const std::string part : {"model.ffn = \"" + ffn + "\" computes its activation on the host",
                                 std::string("a CUDA device and bf16 activations"),
                                 std::string("Use model.ffn = \"dense\" (SwiGLU) there")})
    EXPECT_NE(r.out.find(part), std::string::npos) << "missing '" << part << "' in: " << r.out;
}
#endif

INSTANTIATE_TEST_SUITE_P(Gated, GatedFfnVariant,
                         ::testing::Values(Variant{"geglu", 2e-3, 1e-3}, Variant{"reglu", 2e-3, 5e-3}),
                         [](const ::testing::TestParamInfo<Variant>& i) { return std::string(i.param.name); });

// The factory's table names them: a misspelling is refused with the key, the
// registered variants and the nearest one.
TEST(FfnVariants, MisspellingIsRefusedNamingTheVariants) {
  for (const auto& [typo, nearest] : {std::pair<std::string, std::string>{"gegl", "geglu"}, {"relgu", "reglu"}})
    loom::test::expect_error(
        [&] { parse(loom::test::temp_dir("ffn_typo") / "run", "dense", {"model.ffn=\"" + typo + "\""}); },
        {"model.ffn = \"" + typo + "\" is not one of: dense, native, fused, moe, geglu, reglu",
         "(did you mean \"" + nearest + "\"?)"});
}
