// The FP8 recipes across ranks, run by mpirun on 2 and 4 ranks (CPU, MPI,
// emulated FP8): every rank ends every step with the same delayed scales and
// amax history, bitwise, because end_step max-reduces the one amax buffer
// over the data-parallel group — once per step — before the update. The ranks
// see different data, so their local amaxes differ (checked: without the
// reduction their scales would too). Current scaling takes x and dy scales
// from each rank's own tensors; its weight scales (the weights are replicated)
// agree.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "comm/mpi_communicator.hpp"
#include "config/run_config.hpp"
#include "loom/error.hpp"
#include "precision/common/fp8_scaling.hpp"
#include "train/session_probe.hpp"

namespace {

std::unique_ptr<loom::Communicator> g_world;

// LOOM_FP8_MPI_DEVICE=cuda runs every case on GPUs (NCCL, one GPU per rank:
// scripts/gpu_check.sh fp8-gathers): the FP8 gathers, and the delayed
// recipe's one amax all-reduce a step, its scales read back from the device.
std::string device() {
  const char* d = std::getenv("LOOM_FP8_MPI_DEVICE");
  return d && *d ? d : "cpu";
}

loom::Config make_config(const std::string& precision, const std::string& strategy,
                         const std::string& sharding_keys = "", const std::string& model_keys = "", int hidden = 64,
                         const std::string& run_keys = "") {
  std::ostringstream t;
  t << "[run]\nname = \"fp8mpi\"\nout_dir = \"" << LOOM_BINARY_DIR << "/tests/mpi_runs/fp8\"\n"
    << "device = \"" << device() << "\"\nseed = 13\nthreads = 1\nlog_level = \"warn\"\n" << run_keys << "\n"
    << "plugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nhidden = " << hidden << "\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nffn_hidden = 160\n"
    << "vocab_size = 250\nmax_seq_len = 32\n" << model_keys << "\n"
    << "[train]\nsteps = 6\nmicro_batch = 2\nseq_len = 32\ngrad_accum = 2\nlr = 3e-3\nwarmup_steps = 2\n"
    << "[checkpoint]\nevery = 0\nresume = \"none\"\n"
    << "[precision]\n" << precision << "\n[attention]\nplugin = \"naive\"\n"
    << "[sharding]\nplugin = \"" << strategy << "\"\n" << sharding_keys << "\n[data]\nplugin = \"synthetic\"\n";
  return loom::parse_config_string(t.str(), "fp8_mpi.toml", {});
}

std::vector<float> state_of(loom::Session& s, const std::string& name) {
  for (const loom::StateTensor& t : loom::probe(s).precision().state_tensors())
    if (t.name == name) {
      // On a GPU the state lives in device memory: the backend's download
      // waits for the step that wrote it.
      std::vector<float> v(static_cast<size_t>(t.tensor.numel()));
      loom::probe(s).backend().download(v.data(), t.tensor, v.size() * sizeof(float));
      return v;
    }
  ADD_FAILURE() << "no state tensor " << name;
  return {};
}

// Every rank's copy of v, rank-major.
std::vector<float> gather(std::vector<float> v) {
  const int p = g_world->size();
  std::vector<float> all(v.size() * static_cast<size_t>(p));
  loom::Tensor in(v.data(), loom::DType::f32, loom::Device::cpu, {static_cast<int64_t>(v.size())});
  loom::Tensor out(all.data(), loom::DType::f32, loom::Device::cpu, {static_cast<int64_t>(all.size())});
  g_world->all_gather(loom::ExecContext{}, in, out);
  return all;
}

// Whether every rank holds the same elements at `index` (every index when empty), bitwise.
bool same_on_every_rank(const std::vector<float>& all, size_t n, const std::vector<size_t>& index = {}) {
  const int p = g_world->size();
  for (int r = 1; r < p; ++r)
    for (size_t i = 0; i < n; ++i) {
      if (!index.empty() && std::find(index.begin(), index.end(), i) == index.end()) continue;
      if (std::memcmp(&all[i], &all[static_cast<size_t>(r) * n + i], sizeof(float)) != 0) return false;
    }
  return true;
}

// All-reduce bytes per step of the same run under fp32 (the strategy's own traffic).
uint64_t fp32_all_reduce_bytes(const std::string& strategy) {
  loom::Session s(make_config("plugin = \"fp32\"", strategy));
  s.initialise();
  const auto k = static_cast<size_t>(loom::CollectiveKind::all_reduce);
  const uint64_t before = s.comm().bytes_moved().bytes[k];
  s.train_step();
  (void)s.read_step_logs();
  return s.comm().bytes_moved().bytes[k] - before;
}

void check_delayed(const std::string& strategy) {
  const uint64_t base = fp32_all_reduce_bytes(strategy);
  loom::Session s(make_config("plugin = \"fp8_delayed\"\namax_history_len = 3", strategy));
  s.initialise();
  for (int step = 1; step <= 6; ++step) {
    const loom::CommBytes before = s.comm().bytes_moved();
    s.train_step();
    (void)s.read_step_logs();
    const std::vector<float> scales = state_of(s, "fp8.scale"), hist = state_of(s, "fp8.amax_history");
    ASSERT_FALSE(scales.empty());
    EXPECT_TRUE(same_on_every_rank(gather(scales), scales.size())) << "scales differ across ranks after step " << step;
    EXPECT_TRUE(same_on_every_rank(gather(hist), hist.size())) << "amax history differs after step " << step;
    // The recipe adds exactly one all-reduce per step to the strategy's
    // traffic: one float per tensor, at the ring volume 2 (p - 1) / p per rank
    // (two would double it; one per micro-batch would too).
    const double p = g_world->size();
    const double amax_bytes = 2.0 * (p - 1) / p * 4.0 * static_cast<double>(scales.size());
    const auto k = static_cast<size_t>(loom::CollectiveKind::all_reduce);
    const double added = static_cast<double>(s.comm().bytes_moved().bytes[k] - before.bytes[k]) - static_cast<double>(base);
    EXPECT_NEAR(added, amax_bytes, 1.0) << "step " << step;
  }
  // The scales moved from TE's starting 1, and differ between tensors.
  const std::vector<float> scales = state_of(s, "fp8.scale");
  EXPECT_NE(*std::min_element(scales.begin(), scales.end()), *std::max_element(scales.begin(), scales.end()));
}

struct GatherRun {
  std::vector<double> losses;
  uint64_t gather_bytes = 0;  // all_gather bytes this rank sent over the steps
  double expected_ratio = 0;  // FP8 gathers against fp32 ones, from the model's parameters
  size_t codec_state = 0;     // the memory plan's "sharding.fp8_gather.scales" bytes (the codec's state)
  // Per unit: has FP8 weights (a decoder layer's matrices), and holds an
  // encoded wire shard in the plan ("sharding.fp8_wire.<unit>").
  std::vector<bool> has_fp8, has_wire;
};

GatherRun run_gathers(const std::string& strategy, const std::string& keys, const std::string& model_keys,
                      const std::string& precision = "plugin = \"fp8_current\"", int hidden = 64,
                      const std::string& run_keys = "") {
  loom::Session s(make_config(precision, strategy, keys, model_keys, hidden, run_keys));
  s.initialise();
  const auto k = static_cast<size_t>(loom::CollectiveKind::all_gather);
  const uint64_t before = s.comm().bytes_moved().bytes[k];
  GatherRun r;
  for (int step = 1; step <= 6; ++step) {
    s.train_step();
    for (const loom::StepLog& l : s.read_step_logs()) r.losses.push_back(l.loss);
  }
  r.gather_bytes = s.comm().bytes_moved().bytes[k] - before;
  const auto& all_units = loom::probe(s).units();
  r.has_wire.assign(all_units.size(), false);
  for (const loom::ArenaBlock& b : loom::probe(s).memory_plan().blocks()) {
    if (b.name == "sharding.fp8_gather.scales") r.codec_state += b.bytes;
    const std::string wire = "sharding.fp8_wire.";
    if (b.name.rfind(wire, 0) == 0) r.has_wire.at(std::stoul(b.name.substr(wire.size()))) = true;
  }
  for (const loom::UnitState& u : all_units)
    r.has_fp8.push_back(u.info->name.rfind("layer.", 0) == 0);  // its matrices; norm gains travel apart
  // Every unit is gathered as often in either run: FP8 weights (the decoder
  // layers' matrices) 1 byte an element, everything else the parameters'
  // own size (4 bytes on the CPU, whose parameters are fp32; 2 on a GPU,
  // where they are bf16). Resharding after forward: twice a micro-batch
  // (forward, backward), but the last unit (the head) once, as the backward
  // starts with its forward's gather, and the untied embedding once; else once.
  const bool reshard = keys.find("reshard_after_forward = false") == std::string::npos;
  double fp8 = 0, all = 0, elt = 0;
  const auto& units = loom::probe(s).units();
  for (const loom::UnitState& u : units) {
    // The untied embedding too: its backward reads no parameter (ParamRole::embedding).
    const bool embedding = std::all_of(u.info->params.begin(), u.info->params.end(),
                                       [](const loom::ParamInfo& p) { return p.role == loom::ParamRole::embedding; });
    const double times = reshard && &u != &units.back() && !embedding ? 2.0 : 1.0;
    // zero3 keeps the owned range resident and gathers the rest into scratch.
    const loom::Tensor& held = u.param_shard.data != nullptr ? u.param_shard : u.params;
    if (held.data == nullptr) ADD_FAILURE() << "unit " << u.info->name << " holds no parameters";
    const double e = static_cast<double>(loom::dtype_size(held.dtype));
    if (elt != 0 && e != elt) ADD_FAILURE() << "units hold parameters of different sizes (" << elt << ", " << e << ")";
    elt = e;
    for (const loom::ParamInfo& p : u.info->params) {
      const bool layer = u.info->name.rfind("layer.", 0) == 0;
      const bool matrix = p.role == loom::ParamRole::matrix || p.role == loom::ParamRole::output_projection;
      all += times * static_cast<double>(p.numel);
      if (layer && matrix) fp8 += times * static_cast<double>(p.numel);
    }
  }
  r.expected_ratio = (fp8 + elt * (all - fp8)) / (elt * all);
  return r;
}

// gather_dtype = "fp8" against gathering the parameters, same run
// otherwise. The weights travel as the very codes fp8_current's cast makes
// (the amax max-reduced over the shard group, the same scale), so the GEMMs
// see the same FP8 operands; the recipe re-measures the decoded weight, whose
// amax can differ from the original in its last bit, so the inverse scale the
// GEMM applies can too: the losses agree to float rounding, 1e-5 relative
// (a wrong scale, segment or rank order would move them by 1e-2 and more).
// Traffic: an FP8 weight element is 1 byte against the parameter's 4 (CPU,
// fp32) or 2 (GPU, bf16); norm gains, the embedding and the head travel as
// parameters: the ratio the parameters predict,
// within 1% (the head's and embedding's chunks are padded to 16 bytes and to
// the largest rank's; the layers' norm gains travel once per step instead). Native and fused layers (the fused [q; k; v] and [gate;
// up] weights are one scale each), and shard boundaries that cut weights.
void check_fp8_gathers(const std::string& strategy, const std::string& keys) {
  for (const char* layers : {"native", "fused"}) {
    SCOPED_TRACE(std::string(strategy) + " " + keys + ", layers " + layers);
    const std::string mk = std::string("layers = \"") + layers + "\"";
    const GatherRun ref = run_gathers(strategy, keys, mk);
    const GatherRun fp8 = run_gathers(strategy, keys + "\ngather_dtype = \"fp8\"", mk);
    ASSERT_EQ(ref.losses.size(), 6u);
    ASSERT_EQ(fp8.losses.size(), 6u);
    // The recipe's codec asks for its amaxes, scales and inverse scales (3
    // floats per FP8 weight, GatherCodec::state_bytes; then the decoder
    // layers' norm gains, which travel once per step) only when the strategy
    // gathers through it; the core plans them in the arena.
    EXPECT_EQ(ref.codec_state, 0u);
    EXPECT_GE(fp8.codec_state, 3 * sizeof(float));
    // Only the units with FP8 weights travel through the codec's wire; the
    // others (the embedding, the head and final norm) are gathered as their
    // parameters (GatherCodecPlainUnits): no encoded shard, no wire copy.
    ASSERT_EQ(fp8.has_wire.size(), fp8.has_fp8.size());
    for (size_t u = 0; u < fp8.has_fp8.size(); ++u) {
      EXPECT_EQ(fp8.has_wire[u], fp8.has_fp8[u]) << "unit " << u;
      EXPECT_FALSE(ref.has_wire[u]) << "unit " << u;
    }
    // On the GPU the activations are bf16: a last-bit difference of the
    // weight's inverse scale can flip the rounding of a GEMM output, which
    // the later steps carry on; 1e-3 relative there (a wrong scale or segment
    // still moves the losses by 1e-2 and more).
    const double tol = device() == "cuda" ? 1e-3 : 1e-5;
    double worst = 0;
    for (size_t i = 0; i < ref.losses.size(); ++i) {
      EXPECT_NEAR(fp8.losses[i], ref.losses[i], tol * std::fabs(ref.losses[i])) << "step " << i + 1;
      worst = std::max(worst, std::fabs(fp8.losses[i] - ref.losses[i]) / std::fabs(ref.losses[i]));
    }
    if (g_world->rank() == 0)
      std::printf("[fp8 gathers] %s %s, %s layers, %s: losses %.6f -> %.6f, worst step %.2e relative\n",
                  strategy.c_str(), keys.c_str(), layers, device().c_str(), ref.losses.front(), ref.losses.back(),
                  worst);
    if (g_world->size() == 1) continue;  // one rank moves nothing
    ASSERT_GT(ref.gather_bytes, 0u);
    const double ratio = static_cast<double>(fp8.gather_bytes) / static_cast<double>(ref.gather_bytes);
    EXPECT_NEAR(ratio, fp8.expected_ratio, 0.01);
    if (g_world->rank() == 0)
      std::printf("[fp8 gathers] %s %s, %s layers: all_gather %llu -> %llu bytes per rank over 6 steps (%.3fx, "
                  "parameters predict %.3fx)\n",
                  strategy.c_str(), keys.c_str(), layers, static_cast<unsigned long long>(ref.gather_bytes),
                  static_cast<unsigned long long>(fp8.gather_bytes), ratio, fp8.expected_ratio);
  }
}

// precision.gathered_codes (CUDA): the FP8 GEMMs read the gathered codes
// in place of the weight decoded to bf16 and cast again. The codec measures
// the same bf16 weight (max-reduced over the shard group), scales it with the
// same function and encodes it with the same cast as the recipe's own cast of
// the gathered bf16 parameters, so the run is bitwise the run that gathers
// the parameters. Hidden 128: every weight starts a multiple of 256 bytes
// into its unit, as in real models, so every FP8 weight is read as codes.
// Deterministic kernels (cuBLASLt's heuristic algorithm, not the fastest by
// timing), so that equal inputs give equal bits.
void check_gathered_codes(const std::string& strategy, const std::string& keys) {
  for (const char* layers : {"native", "fused"}) {
    SCOPED_TRACE(std::string(strategy) + " " + keys + ", layers " + layers);
    const std::string mk = std::string("layers = \"") + layers + "\"";
    const std::string direct = "plugin = \"fp8_current\"\ngathered_codes = true";
    const std::string det = "deterministic = true";
    const GatherRun ref = run_gathers(strategy, keys, mk, "plugin = \"fp8_current\"", 128, det);
    const GatherRun codes = run_gathers(strategy, keys + "\ngather_dtype = \"fp8\"", mk, direct, 128, det);
    const GatherRun decoded = run_gathers(strategy, keys + "\ngather_dtype = \"fp8\"", mk,
                                          "plugin = \"fp8_current\"\ngathered_codes = false", 128, det);
    ASSERT_EQ(ref.losses.size(), 6u);
    ASSERT_EQ(codes.losses.size(), 6u);
    ASSERT_EQ(decoded.losses.size(), 6u);
    int differ = 0;
    for (size_t i = 0; i < ref.losses.size(); ++i) {
      EXPECT_EQ(codes.losses[i], ref.losses[i]) << "step " << i + 1 << ": codes read in place against parameters gathered";
      differ += decoded.losses[i] != ref.losses[i];
    }
    if (g_world->rank() == 0)
      std::printf("[fp8 gathers] %s %s, %s layers: losses %.9f -> %.9f; codes in place bitwise the parameter "
                  "gathers'; decoded and cast again: %d of 6 steps differ in some bit\n",
                  strategy.c_str(), keys.c_str(), layers, ref.losses.front(), ref.losses.back(), differ);
  }
}

// A refused combination: the message names the key and what to do.
void expect_refused(const std::string& precision, const std::string& strategy, const std::string& keys,
                    const std::vector<std::string>& parts) {
  try {
    loom::Session s(make_config(precision, strategy, keys));
    s.initialise();
    ADD_FAILURE() << strategy << " with " << keys << " under " << precision << " was not refused";
  } catch (const loom::Error& e) {
    const std::string m = e.what();
    for (const std::string& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "missing '" << p << "' in: " << m;
  }
}

}  // namespace

TEST(Fp8Mpi, Fp8GathersMatchParamGathersUnderZero3) { check_fp8_gathers("zero3", ""); }
TEST(Fp8Mpi, Fp8GathersMatchParamGathersWithoutReshard) { check_fp8_gathers("zero3", "reshard_after_forward = false"); }
TEST(Fp8Mpi, Fp8GathersMatchParamGathersUnderHybridShard) {
  // Groups of 2 (two groups on 4 ranks); one group of one on a single GPU.
  check_fp8_gathers("hybrid_shard", g_world->size() >= 2 ? "shard_group_size = 2" : "shard_group_size = 1");
}

TEST(Fp8Mpi, GatheredCodesAreTheParameterGathersBitwise) {
  if (device() != "cuda")
    GTEST_SKIP() << "the GEMMs read gathered codes on CUDA only: run with LOOM_FP8_MPI_DEVICE=cuda on GPUs "
                    "(scripts/gpu_check.sh fp8-gathers)";
  check_gathered_codes("zero3", "");
  check_gathered_codes("hybrid_shard", g_world->size() >= 2 ? "shard_group_size = 2" : "shard_group_size = 1");
}

TEST(Fp8Mpi, Fp8GathersRefuseWhatTheyCannotReproduce) {
  // Delayed scaling casts with a scale from past amaxes; bf16 casts nothing.
  expect_refused("plugin = \"fp8_delayed\"", "zero3", "gather_dtype = \"fp8\"",
                 {"sharding.gather_dtype", "fp8_delayed", "fp8_current", "gather_dtype = \"param\""});
  expect_refused("plugin = \"fp32\"", "zero3", "gather_dtype = \"fp8\"", {"sharding.gather_dtype", "\"fp32\""});
  // The key of the recipe that gathers codes, under one that gathers none.
  expect_refused("plugin = \"fp8_delayed\"\ngathered_codes = true", "zero3", "",
                 {"precision.gathered_codes", "fp8_delayed", "fp8_current", "remove it"});
  // Strategies that never gather parameters before compute.
  expect_refused("plugin = \"fp8_current\"", "ddp", "gather_dtype = \"fp8\"",
                 {"gather_dtype", "zero3, full_shard, hybrid_shard", "remove the key"});
  expect_refused("plugin = \"fp8_current\"", "zero3", "gather_dtype = \"fp16\"", {"gather_dtype", "fp16", "param"});
}

TEST(Fp8Mpi, DelayedScalesAgreeUnderDdp) { check_delayed("ddp"); }
TEST(Fp8Mpi, DelayedScalesAgreeUnderZero3) { check_delayed("zero3"); }

// Current scaling: the weight scales agree (replicated weights); the x scales
// come from each rank's own data and do differ, which is also what shows that
// the ranks' local amaxes differ, so the agreement above is the reduction's.
TEST(Fp8Mpi, CurrentScalesFollowEachRanksData) {
  if (g_world->size() < 2)
    GTEST_SKIP() << "one rank has no other rank's data to differ from: run under mpirun -np 2 or more "
                    "(ctest's mpi_fp8_np2 and mpi_fp8_np4)";
  loom::Session s(make_config("plugin = \"fp8_current\"", "ddp"));
  s.initialise();
  for (int step = 1; step <= 3; ++step) {
    s.train_step();
    (void)s.read_step_logs();
  }
  const std::vector<float> scales = state_of(s, "fp8.scale");
  const std::vector<float> all = gather(scales);
  std::vector<size_t> w, x;
  for (size_t i = 0; i < scales.size(); ++i) {
    if (i % loom::fp8::kRolesPerLinear == static_cast<size_t>(loom::fp8::Role::w)) w.push_back(i);
    if (i % loom::fp8::kRolesPerLinear == static_cast<size_t>(loom::fp8::Role::x)) x.push_back(i);
  }
  EXPECT_TRUE(same_on_every_rank(all, scales.size(), w)) << "weight scales must agree";
  EXPECT_FALSE(same_on_every_rank(all, scales.size(), x)) << "x scales come from each rank's own batch";
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int rc = 1;
  try {
    g_world = loom::make_mpi_communicator(60.0);
    rc = RUN_ALL_TESTS();
    g_world->barrier();
    g_world.reset();
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "test_fp8_mpi: %s\n", e.what());
    loom::abort_all(2);
  }
  return rc;
}
