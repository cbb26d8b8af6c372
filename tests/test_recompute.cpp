// model.recompute = "selective" (loom/block.hpp): the norms' and SwiGLU's
// outputs are computed again in the backward instead of being kept, and the
// FP8 recipes, handed the linears' x again (LinearDesc::input_in_backward),
// keep no FP8 copies of them. Each switch is held to two things: the same
// training bits as without it (the recomputed tensors are the same op on the
// same inputs, so on the CPU every loss, every parameter and the FP8 state
// are bitwise equal), and the plan's bytes moving by exactly what the switch
// predicts. The CUDA recipes' plans are checked here too, planned for a GPU
// this machine need not have (train/plan_device.hpp): their memory is a
// function of the shapes alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "config/run_config.hpp"
#include "session_runs.hpp"
#include "test_util.hpp"
#include "train/memory_budget.hpp"
#include "train/session_probe.hpp"

namespace fs = std::filesystem;

namespace {

constexpr int64_t kH = 64, kF = 160, kL = 2, kN = 4 * 31;  // the CPU model below, and its tokens per micro-batch

// A CPU run of a small Llama (GQA 4/2) with every linear's dims unequal, two
// micro-batches a step and an evaluation, so that recomputation in the
// backward of every micro-batch and the forward-only passes are all
// exercised. One thread: the runs are tiny, and a second thread spinning on a
// busy CI machine made each run ten times slower.
std::string cpu_config(const fs::path& out, const std::string& precision) {
  std::ostringstream s;
  s << "[run]\nname = \"recompute\"\nout_dir = \"" << out.string() << "\"\ndevice = \"cpu\"\nseed = 7\nthreads = 1\n"
    << "log_level = \"warn\"\nplugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nhidden = " << kH << "\nnum_layers = " << kL << "\nnum_heads = 4\nnum_kv_heads = 2\nffn_hidden = " << kF
    << "\nvocab_size = 96\nmax_seq_len = 64\n"
    << "[train]\nsteps = 3\nmicro_batch = 4\nseq_len = 31\ngrad_accum = 2\nlr = 3e-3\nmin_lr = 3e-4\n"
    << "warmup_steps = 1\nvalidation_every = 3\nvalidation_batches = 2\nlog_every = 1\n"
    << "[checkpoint]\nevery = 0\nresume = \"none\"\n"
    << "[precision]\nplugin = \"" << precision << "\"\n[attention]\nplugin = \"naive\"\n[sharding]\nplugin = \"none\"\n"
    << "[data]\nplugin = \"synthetic\"\npattern = \"ramp\"\n";
  return s.str();
}

loom::Config parse(const std::string& text, const std::vector<std::string>& ov = {}) {
  return loom::parse_config_string(text, "recompute.toml", ov);
}

size_t block(const loom::ArenaPlan& plan, const std::string& name) {
  for (const loom::ArenaBlock& b : plan.blocks())
    if (b.name == name) return b.bytes;
  return 0;
}

bool has_block(const loom::ArenaPlan& plan, const std::string& prefix) {
  return std::any_of(plan.blocks().begin(), plan.blocks().end(),
                     [&](const loom::ArenaBlock& b) { return b.name.rfind(prefix, 0) == 0; });
}

size_t aligned(size_t bytes) { return (bytes + loom::ArenaPlan::kAlign - 1) / loom::ArenaPlan::kAlign * loom::ArenaPlan::kAlign; }

// Every parameter of the model, by name, as fp32 values.
std::map<std::string, std::vector<float>> parameters(loom::Session& s) {
  std::map<std::string, std::vector<float>> out;
  for (const loom::UnitState& u : loom::probe(s).units())
    for (const loom::ParamInfo& p : u.info->params) out[p.name] = loom::probe(s).read_param(p.name);
  return out;
}

}  // namespace

// Training with selective recompute computes the same bits as without it, for
// the fp32 reference and the emulated FP8 recipes, native and fused layers:
// every training and validation loss, every parameter after the last step,
// and the FP8 scaling state. (fp8_delayed's recast in the backward is
// fp8_current's code with the other scaling's scale: one layer variant.)
TEST(Recompute, SelectiveTrainsBitwiseAsNone) {
  for (const std::string precision : {"fp32", "fp8_current", "fp8_delayed"})
    for (const std::string layers : {"native", "fused"}) {
      if (precision == "fp8_delayed" && layers == "native") continue;
      SCOPED_TRACE(precision + " " + layers);
      const fs::path d = loom::test::temp_dir("recompute_bits_" + precision + layers);
      loom::Session none(parse(cpu_config(d / "none", precision), {"model.layers=" + layers}));
      loom::Session sel(parse(cpu_config(d / "sel", precision), {"model.layers=" + layers, "model.recompute=selective"}));
      loom::test::expect_same_losses(none.train(), sel.train(), 3);
      EXPECT_EQ(parameters(none), parameters(sel));
      EXPECT_EQ(loom::test::state_bytes(none), loom::test::state_bytes(sel));
    }
}

// What selective drops from the plan, exactly. fp32 (whose linears read the
// x the blocks keep): per layer the two norms' outputs [N, h] and SwiGLU's
// [N, f], replaced by one transient [N, max(h, f)] shared by every layer. The
// emulated FP8 recipes already keep their own copy of those inputs (so the
// blocks keep them as transients); under selective they keep none — every
// FP8 linear's cast x, 4 bytes an element on the CPU, leaves the saved
// activations — and cast x again in the backward into a scratch of the
// largest x (the down projection's [N, f]) in their workspace.
TEST(Recompute, SelectivePlansWhatItDrops) {
  for (const std::string layers : {"native", "fused"}) {
    SCOPED_TRACE(layers);
    const fs::path d = loom::test::temp_dir("recompute_plan_" + layers);
    const std::vector<std::string> none_ov = {"model.layers=" + layers},
                                   sel_ov = {"model.layers=" + layers, "model.recompute=selective"};
    {
      loom::Session none(parse(cpu_config(d / "a", "fp32"), none_ov));
      loom::Session sel(parse(cpu_config(d / "b", "fp32"), sel_ov));
      const size_t a_none = loom::probe(none).memory_plan().category_bytes(loom::MemCategory::activations);
      const size_t a_sel = loom::probe(sel).memory_plan().category_bytes(loom::MemCategory::activations);
      const size_t per_layer = aligned(kN * kH * 4) * 2 + aligned(kN * kF * 4);
      EXPECT_EQ(a_none - a_sel, kL * per_layer - aligned(kN * std::max(kH, kF) * 4));
      EXPECT_EQ(block(loom::probe(sel).memory_plan(), "scratch.linear_input"), static_cast<size_t>(kN * std::max(kH, kF) * 4));
      for (const char* gone : {"ln1.", "ln2.", "swi."}) {
        EXPECT_TRUE(has_block(loom::probe(none).memory_plan(), gone)) << gone;
        EXPECT_FALSE(has_block(loom::probe(sel).memory_plan(), gone)) << gone;
      }
      EXPECT_TRUE(has_block(loom::probe(sel).memory_plan(), "gate_up.") || has_block(loom::probe(sel).memory_plan(), "gate."))
          << "the GEMM outputs stay";
      EXPECT_EQ(loom::probe(none).memory_plan().category_bytes(loom::MemCategory::workspace),
                loom::probe(sel).memory_plan().category_bytes(loom::MemCategory::workspace));
    }
    for (const std::string precision : {"fp8_delayed", "fp8_current"}) {
      SCOPED_TRACE(precision);
      loom::Session none(parse(cpu_config(d / ("c" + precision), precision), none_ov));
      loom::Session sel(parse(cpu_config(d / ("d" + precision), precision), sel_ov));
      // native: q, k, v, o, gate and up read [N, h] (q_dim = h here), down [N, f]; fused: qkv, o, gate_up, down.
      const int64_t reads_h = layers == "native" ? 6 : 3;
      EXPECT_EQ(block(loom::probe(none).memory_plan(), "precision.saved_activations"),
                static_cast<size_t>(kL * (reads_h * kN * kH + kN * kF) * 4));
      EXPECT_EQ(block(loom::probe(sel).memory_plan(), "precision.saved_activations"), 0u);
      EXPECT_EQ(block(loom::probe(sel).memory_plan(), "precision.workspace") - block(loom::probe(none).memory_plan(), "precision.workspace"),
                static_cast<size_t>(kN * std::max(kH, kF) * 4));
      // The blocks' own buffers: the same transients either way (the recipe
      // kept x under none, the backward recomputes it under selective).
      EXPECT_EQ(loom::probe(none).memory_plan().category_bytes(loom::MemCategory::activations) -
                    aligned(block(loom::probe(none).memory_plan(), "precision.saved_activations")),
                loom::probe(sel).memory_plan().category_bytes(loom::MemCategory::activations) -
                    aligned(block(loom::probe(sel).memory_plan(), "precision.saved_activations")));
    }
  }
}

#ifdef LOOM_HAVE_CUDA
namespace {

// A CUDA run of a small Llama whose dims suit the FP8 GEMMs (multiples of 16),
// planned for an H100 (`loom check --gpu h100`): nothing touches a device.
constexpr int64_t kGh = 128, kGf = 352, kGL = 2, kGN = 2 * 64, kGqd = 128, kGkv = 64;

std::string gpu_config(const std::string& precision, const std::string& sharding) {
  std::ostringstream s;
  s << "[run]\nname = \"planned\"\nout_dir = \"" << loom::test::temp_dir("recompute_gpu").string()
    << "\"\ndevice = \"cuda\"\nseed = 7\nlog_level = \"warn\"\nplugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nlayers = \"fused\"\nhidden = " << kGh << "\nnum_layers = " << kGL
    << "\nnum_heads = 4\nnum_kv_heads = 2\nffn_hidden = " << kGf << "\nvocab_size = 512\nmax_seq_len = 64\n"
    << "[train]\nsteps = 4\nmicro_batch = 2\nseq_len = 64\ngrad_accum = 4\n"
    << "[checkpoint]\nevery = 0\nresume = \"none\"\n"
    << "[precision]\nplugin = \"" << precision << "\"\n[attention]\nplugin = \"cudnn\"\n[sharding]\nplugin = \""
    << sharding << "\"\n[data]\nplugin = \"synthetic\"\n";
  return s.str();
}

std::unique_ptr<loom::Session> planned(const std::string& precision, const std::string& sharding, int world,
                                       const std::vector<std::string>& ov = {}) {
  loom::SessionOptions o;
  o.plan_world = world;
  o.plan_device = loom::named_gpu("h100");
  return std::make_unique<loom::Session>(parse(gpu_config(precision, sharding), ov), o);
}

size_t round256(int64_t n) { return aligned(static_cast<size_t>(n)); }

}  // namespace

// The CUDA FP8 recipe keeps xᵀ of every FP8 linear in FP8 (one byte an
// element, each slot 256-byte aligned) until the backward; under selective it
// keeps none (its x scratch, the largest x, is planned either way), and the
// bf16 recipe's blocks drop ln1, ln2 and SwiGLU's output in bf16.
TEST(Recompute, SelectiveOnTheGpuPlan) {
  {
    auto none = planned("fp8_current", "ddp", 4);
    auto sel = planned("fp8_current", "ddp", 4, {"model.recompute=selective"});
    // fused: qkv, gate_up read [N, h], o [N, q_dim], down [N, f].
    const size_t per_layer = 2 * round256(kGN * kGh) + round256(kGN * kGqd) + round256(kGN * kGf);
    EXPECT_EQ(block(loom::probe(*none).memory_plan(), "precision.saved_activations"), kGL * per_layer);
    EXPECT_EQ(block(loom::probe(*sel).memory_plan(), "precision.saved_activations"), 0u);
    EXPECT_EQ(block(loom::probe(*none).memory_plan(), "precision.workspace"), block(loom::probe(*sel).memory_plan(), "precision.workspace"));
  }
  {
    auto none = planned("bf16", "ddp", 4);
    auto sel = planned("bf16", "ddp", 4, {"model.recompute=selective"});
    const size_t a_none = loom::probe(*none).memory_plan().category_bytes(loom::MemCategory::activations);
    const size_t a_sel = loom::probe(*sel).memory_plan().category_bytes(loom::MemCategory::activations);
    EXPECT_EQ(a_none - a_sel, kGL * (2 * round256(kGN * kGh * 2) + round256(kGN * kGf * 2)) -
                                  round256(kGN * std::max(kGh, kGf) * 2));
  }
}

// precision.weight_cache = "auto": under zero3 (parameters sharded, gathered
// for every use) the FP8 recipe casts each weight per GEMM into one scratch
// of the largest; under ddp with grad_accum > 1 it keeps W and Wᵀ of every
// FP8 linear for the step. The difference is exactly those copies but the
// scratch; "layer" under ddp plans what "auto" plans under zero3.
TEST(Recompute, WeightCacheAutoCastsPerGemmWhenParametersAreSharded) {
  auto ws = [](const std::string& sharding, const std::vector<std::string>& ov) {
    return block(loom::probe(*planned("fp8_current", sharding, 4, ov)).memory_plan(), "precision.workspace");
  };
  const size_t step = ws("ddp", {}), zero3 = ws("zero3", {}), layer = ws("ddp", {"precision.weight_cache=\"layer\""});
  const int64_t qkv = (kGqd + 2 * kGkv) * kGh, o = kGh * kGqd, gu = 2 * kGf * kGh, down = kGh * kGf;
  const size_t all = kGL * 2 * (round256(qkv) + round256(o) + round256(gu) + round256(down));
  EXPECT_EQ(step - zero3, all - round256(std::max({qkv, o, gu, down})));
  EXPECT_EQ(zero3, layer);
  EXPECT_EQ(ws("zero3", {"precision.weight_cache=\"step\""}), step) << "an explicit \"step\" is kept";
}

// The shipped node workloads fit an 80 GB H100 on 4 ranks with room to the
// issue's 76 GiB, as planned (what `loom check --gpu h100 --world-size 4`
// prints as "per rank in all"), and that figure is the arena's plan plus
// what lies beyond it (train/memory_budget.hpp).
TEST(Recompute, NodeWorkloadsFitAnH100OnFourRanks) {
  for (const std::string name : {"llama3-8b-8k", "llama3-8b-8k-fp8"}) {
    SCOPED_TRACE(name);
    loom::SessionOptions o;
    o.plan_world = 4;
    o.plan_device = loom::named_gpu("h100");
    loom::Session s(loom::load_config(fs::path(LOOM_SOURCE_DIR) / "configs" / "bench" / (name + ".toml"),
                                      {"run.log_level=\"warn\""}),
                    o);
    const double gib = 1024.0 * 1024.0 * 1024.0;
    const double in_all = static_cast<double>(loom::probe(s).state().planned_device_bytes()) / gib;
    EXPECT_LE(in_all, 76.0);
    EXPECT_EQ(loom::probe(s).state().planned_device_bytes(),
              loom::probe(s).memory_plan().total_bytes() + loom::outside_arena_estimate(4, 4, true).total());
    EXPECT_NO_THROW(s.check_memory_fits());
    std::printf("[node plan] %s on 4x H100: %.2f GiB per rank in all (arena %.2f GiB)\n", name.c_str(), in_all,
                static_cast<double>(loom::probe(s).memory_plan().total_bytes()) / gib);
  }
}
#endif
