// Every sharding strategy against the single-process reference, run by mpirun
// on 2 and 4 ranks (oversubscribed, CPU fp32, MPI communicator).
//
// For each strategy: 20 steps with gradient accumulation 2 on every rank must
// give the losses of one process that sees the same global batch (grad_accum
// 2 x world) within 1e-5 relative per step. The tolerance: the only difference
// is the order of fp32 summation of the gradients (a ring reduce versus one
// accumulation buffer), ~1e-7 relative per step, well below 1e-5 over 20 steps.
//
// Each step must move exactly the volume the ZeRO paper gives (in bytes of
// the padded fp32 units, with the ring factor (p-1)/p that every ring
// collective carries), within 1% (the loss and norm scalars add a few bytes);
// and each rank's memory plan must equal the ZeRO formulas plus padding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <sstream>

#include "comm/launch.hpp"
#include "comm/mpi_communicator.hpp"
#include "config/run_config.hpp"
#include "loom/error.hpp"
#include "loom/ops/backend.hpp"
#include "session_runs.hpp"
#include "train/session_probe.hpp"

namespace {

using loom::CollectiveKind;
std::unique_ptr<loom::Communicator> g_world;

// LOOM_SHARDING_TEST_DEVICE=cuda runs the same checks on GPUs (one per rank,
// NCCL carrying the tensors): scripts/gpu_check.sh does so on multi-GPU hosts.
std::string test_device() {
  const char* d = std::getenv("LOOM_SHARDING_TEST_DEVICE");
  return d ? d : "cpu";
}

constexpr int kSteps = 20;
constexpr int kAccum = 2;

loom::Config make_config(const std::string& strategy, std::vector<std::string> overrides = {}) {
  std::ostringstream t;
  t << "[run]\nname = \"shard\"\nout_dir = \"" << LOOM_BINARY_DIR << "/tests/mpi_runs/shard\"\n"
    << "device = \"" << test_device() << "\"\nseed = 11\nthreads = 1\nlog_level = \"warn\"\n"
    << "plugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nhidden = 64\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nffn_hidden = 160\n"
    << "vocab_size = 250\nmax_seq_len = 32\ntied_embeddings = false\n"
    << "[train]\nsteps = " << kSteps << "\nmicro_batch = 2\nseq_len = 32\ngrad_accum = " << kAccum
    << "\nlr = 3e-3\nwarmup_steps = 2\n"
    << "[checkpoint]\nevery = 0\nresume = \"none\"\n"
    << "[precision]\nplugin = \"fp32\"\n[attention]\nplugin = \"naive\"\n"
    << "[sharding]\nplugin = \"" << strategy << "\"\n[data]\nplugin = \"synthetic\"\n";
  return loom::parse_config_string(t.str(), "sharding_test.toml", overrides);
}

struct Run {
  std::vector<double> losses;
  std::vector<double> aux;     // MoE: the load-balancing losses (empty for dense models)
  std::vector<double> norms;   // the global gradient norm before clipping
  loom::CommBytes step_bytes;  // bytes moved by the first step
};

// eval_at > 0: an evaluation pass after that many steps (it must not disturb training).
// prepare: run after the weights are initialised (a test's own weights).
Run train(loom::Session& s, int eval_at = 0, const std::function<void(loom::Session&)>& prepare = {}) {
  s.initialise();
  if (prepare) prepare(s);
  Run r;
  for (int i = 0; i < kSteps; ++i) {
    if (eval_at > 0 && i == eval_at) EXPECT_TRUE(std::isfinite(s.evaluate()));
    const loom::CommBytes before = s.comm().bytes_moved();
    s.train_step();
    const loom::StepLog log = s.read_step_logs().at(0);
    r.losses.push_back(log.loss);
    r.norms.push_back(log.grad_norm);
    if (log.has_aux) r.aux.push_back(log.aux_loss);
    if (i == 0)
      for (size_t k = 0; k < before.bytes.size(); ++k)
        r.step_bytes.bytes[k] = s.comm().bytes_moved().bytes[k] - before.bytes[k];
  }
  return r;
}

// The single-process run with the same global batch: the data sources hand
// rank r of p micro-batch m the samples one process sees as micro-batch m*p + r.
// `model` holds the case's model.* overrides (tied embeddings, experts). With
// experts the aux loss of a micro-batch is over its local tokens and scaled by
// 1 / (grad_accum x world), so the sharded run matches this reference too.
// prepare (named by prepare_key in the cache) changes the initial weights.
const Run& reference(const std::vector<std::string>& model, const std::function<void(loom::Session&)>& prepare = {},
                     const std::string& prepare_key = "") {
  static std::map<std::vector<std::string>, Run> refs;
  std::vector<std::string> key = model;
  key.push_back(prepare_key);
  auto it = refs.find(key);
  if (it != refs.end()) return it->second;
  const int p = g_world->size();
  std::vector<std::string> ov = model;
  ov.push_back("train.grad_accum=" + std::to_string(kAccum * p));
  loom::Session s(make_config("none", ov), loom::SessionOptions{true});
  return refs[key] = train(s, 0, prepare);
}

double ring(int p) { return p > 1 ? static_cast<double>(p - 1) / p : 0.0; }

struct Volume {
  double all_reduce = 0, reduce_scatter = 0, all_gather = 0;
};

// The ZeRO paper's per-step traffic for this session's layout (fp32 units):
// ddp 2Ψ (all-reduce); zero1 Ψ reduce-scatter + Ψ all-gather; zero2 the
// reduce-scatter once per micro-batch; zero3 per micro-batch Ψ gathered for
// forward, Ψ for backward but the head (the backward starts with the unit the
// forward ended with, still gathered) and the embedding (its backward reads no
// parameter), Ψ reduce-scattered; hybrid_shard the zero3 volume
// inside its group plus an all-reduce of the shard across groups.
Volume expected_volume(loom::Session& s, const std::string& strategy) {
  double psi_padded = 0, psi = 0, chunk = 0, experts = 0;
  int group = 1, ep = 1;
  const double head_padded = 4.0 * static_cast<double>(loom::probe(s).units().back().layout.padded_numel);
  const double embedding_padded = 4.0 * static_cast<double>(loom::probe(s).units().front().layout.padded_numel);
  for (const auto& u : loom::probe(s).units()) {
    if (u.info->expert_group > 1) {  // expert parallelism: the rank's experts, added up over their replicas
      experts += 4.0 * static_cast<double>(u.layout.optim_numel);
      ep = u.info->expert_group;
      continue;
    }
    psi_padded += 4.0 * static_cast<double>(u.layout.padded_numel);
    psi += 4.0 * static_cast<double>(u.info->numel);
    chunk += 4.0 * static_cast<double>(u.layout.optim_numel);
    group = static_cast<int>(u.layout.padded_numel / u.layout.optim_numel);
  }
  const int world = s.world(), replicas = world / group;
  const double f = ring(group);
  Volume v;
  if (strategy == "ddp") {
    v.all_reduce = 2 * ring(world) * psi;
  } else if (strategy == "zero1") {
    v.reduce_scatter = f * psi_padded;
    v.all_gather = f * psi_padded;
  } else if (strategy == "zero2") {
    v.reduce_scatter = kAccum * f * psi_padded;
    v.all_gather = f * psi_padded;
  } else {  // zero3, full_shard, hybrid_shard (reshard after forward)
    v.all_gather = kAccum * f * (2 * psi_padded - head_padded - embedding_padded);
    v.reduce_scatter = kAccum * f * psi_padded;
    v.all_reduce = 2 * ring(replicas) * chunk;
  }
  // Expert parallelism: each rank's experts gradient is all-reduced over the
  // world / ep ranks holding the same experts; nothing else moves for them.
  v.all_reduce += 2 * ring(world / ep) * experts;
  // The mean loss (and, for sharded optimizer state, the gradient norm) are
  // all-reduced as 8-byte scalars: a few bytes beside the units.
  return v;
}

void expect_volume(double got, double want, const std::string& what) {
  if (want == 0) {
    EXPECT_LT(got, 64.0) << what;  // only the scalars
    return;
  }
  EXPECT_NEAR(got, want, 0.01 * want) << what << ": moved " << got << " bytes, expected " << want;
}

struct Case {
  std::string strategy;
  std::vector<std::string> overrides;
  int min_world = 2;
  double tolerance = 1e-5;  // relative, per step
  bool cuda_only = false;
};

bool skip_device() { return test_device() == "cuda" && !loom::cuda_available(); }

void check_strategy(const Case& c) {
  if (skip_device()) GTEST_SKIP() << "LOOM_SHARDING_TEST_DEVICE=cuda but no CUDA device is visible";
  if (g_world->size() < c.min_world) GTEST_SKIP() << "needs " << c.min_world << " ranks";
  if (c.cuda_only && test_device() != "cuda") GTEST_SKIP() << "runs with LOOM_SHARDING_TEST_DEVICE=cuda only";
  std::vector<std::string> ov = c.overrides;
  const bool tied = std::find(ov.begin(), ov.end(), "model.tied_embeddings=true") != ov.end();
  std::vector<std::string> model_ov;
  for (const auto& o : ov)
    if (o.rfind("model.", 0) == 0) model_ov.push_back(o);
  const Run& ref_run = reference(model_ov);
  const std::vector<double>& ref = ref_run.losses;
  loom::Session s(make_config(c.strategy, ov));
  // Every run evaluates after step 7: a forward-only pass in the middle of
  // training (zero3 regathers for it) must leave the next steps unchanged.
  const Run r = train(s, 7);
  ASSERT_EQ(r.losses.size(), ref.size());
  const uint64_t a2a = r.step_bytes.bytes[static_cast<size_t>(CollectiveKind::all_to_all)];
  int64_t ep = 1;
  for (const auto& o : ov)
    if (o.rfind("sharding.expert_parallel=", 0) == 0) ep = std::stoll(o.substr(25));
  if (ep == 1) {
    EXPECT_EQ(a2a, 0u) << "all_to_all without expert parallelism";
  } else {
    // Expert parallelism (blocks/expert_parallel.hpp): per layer and
    // micro-batch, 8·El·(P−1) bytes of counts, then at most N·k rows sent
    // twice (the rows, their gradients) and at most (P−1)·N·min(k, El) rows
    // received and sent back twice.
    const loom::ModelSpec& m = s.spec();
    const int64_t P = ep, El = m.num_experts / P, N = 2 * 32, k = m.top_k, L = m.num_layers;
    const uint64_t counts = static_cast<uint64_t>(L * kAccum * 8 * El * (P - 1));
    const uint64_t most = counts + static_cast<uint64_t>(L * kAccum * 2 * m.hidden * 4 *
                                                          (N * k + (P - 1) * N * std::min(k, El)));
    EXPECT_GT(a2a, counts) << "rows must travel between the experts' owners";
    EXPECT_LE(a2a, most);
  }
  double worst = 0;
  // Where the run parts from one process: the first step whose loss differs
  // by more than rounding noise of a few steps (1e-7), and the worst gradient
  // norm difference (printed below, so a multi-GPU log says when and how much).
  size_t first_apart = 0;
  double worst_norm = 0;
  for (size_t i = 0; i < std::min(r.norms.size(), ref_run.norms.size()); ++i)
    worst_norm = std::max(worst_norm, std::fabs(r.norms[i] - ref_run.norms[i]) / ref_run.norms[i]);
  for (size_t i = 0; i < ref.size(); ++i) {
    const double rel = std::fabs(r.losses[i] - ref[i]) / std::fabs(ref[i]);
    if (first_apart == 0 && rel > 1e-7) first_apart = i + 1;
    worst = std::max(worst, rel);
    EXPECT_LE(rel, c.tolerance) << c.strategy << " step " << i + 1 << ": " << r.losses[i] << " vs " << ref[i];
  }
  ASSERT_EQ(r.aux.size(), ref_run.aux.size());
  for (size_t i = 0; i < ref_run.aux.size(); ++i) {
    const double rel = std::fabs(r.aux[i] - ref_run.aux[i]) / std::fabs(ref_run.aux[i]);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, c.tolerance) << c.strategy << " step " << i + 1 << " aux: " << r.aux[i] << " vs " << ref_run.aux[i];
  }
  if (ep > 1) {
    // The gradient's scale: AdamW is nearly blind to a constant factor on the
    // experts' gradients (and clipping may not act), the global norm is not.
    // A wrong factor (a missing 1/world, a double sum) moves the norm by far
    // more than 1e-3. On 4 GPUs (docs/PERFORMANCE-LOG.md, 2026-11-27) the MoE
    // runs drifted beyond rounding whether or not the experts were split:
    // MoeDdp, MoeZero1/2/3 and MoeHybridTwoGroupsOfTwo, and the expert-parallel
    // MoeExpertParallel4Ddp and MoeExpertParallel2HybridTwoGroupsOfTwo, all
    // ended 7.64e-6 from one process in loss, the last two 3.7e-5 in the
    // step-20 norm; the EP = 2 cases under ddp/zero1/zero2/zero3 and
    // MoeExpertParallel4Zero3 stayed within 3e-8, every dense case within
    // 6.4e-9. The likely cause is top-k routing: sums in another order than
    // one process's (more than two addends) change a last bit, and a token
    // near a tie goes to another expert. So on GPUs the norm is held to 1e-4,
    // which still catches any wrong factor; on the CPU, to the case's own
    // tolerance (1.5e-8 measured on 4 ranks).
    const double norm_tol = test_device() == "cuda" ? std::max(c.tolerance, 1e-4) : c.tolerance;
    ASSERT_EQ(r.norms.size(), ref_run.norms.size());
    for (size_t i = 0; i < r.norms.size(); ++i)
      EXPECT_LE(std::fabs(r.norms[i] - ref_run.norms[i]) / ref_run.norms[i], norm_tol)
          << c.strategy << " step " << i + 1 << " grad norm: " << r.norms[i] << " vs " << ref_run.norms[i];
  }
  const bool hybrid_replicated = c.strategy == "hybrid_shard" &&
                                 std::find(ov.begin(), ov.end(), "sharding.reshard_after_forward=false") != ov.end();
  const bool bf16_wire = std::find(ov.begin(), ov.end(), "sharding.reduce_dtype=\"bf16\"") != ov.end();
  if (bf16_wire) return;  // half the bytes on the wire; the losses are what this case checks
  // Tied embeddings change the volume (the embedding stays gathered from its
  // forward to its backward) and the grads plan (its whole gradient is kept):
  // only the losses are compared for them.
  if (!tied && !hybrid_replicated &&
      std::find(ov.begin(), ov.end(), "sharding.reshard_after_forward=false") == ov.end()) {
    const Volume v = expected_volume(s, c.strategy == "full_shard" ? "zero3" : c.strategy);
    const auto& b = r.step_bytes.bytes;
    expect_volume(static_cast<double>(b[static_cast<size_t>(CollectiveKind::all_reduce)]), v.all_reduce,
                  c.strategy + " all_reduce");
    expect_volume(static_cast<double>(b[static_cast<size_t>(CollectiveKind::reduce_scatter)]), v.reduce_scatter,
                  c.strategy + " reduce_scatter");
    expect_volume(static_cast<double>(b[static_cast<size_t>(CollectiveKind::all_gather)]), v.all_gather,
                  c.strategy + " all_gather");
  }

  if (ep > 1) {
    // Expert parallelism: every layer's experts in a unit of their own, of
    // which this rank holds exactly its 1/ep (params, grads, optimizer state).
    int experts_units = 0;
    for (const auto& u : loom::probe(s).units())
      if (u.info->expert_group > 1) {
        ++experts_units;
        EXPECT_EQ(u.info->expert_group, ep);
        EXPECT_EQ(u.layout.param_numel * ep, u.info->numel) << u.info->name;
        EXPECT_EQ(u.layout.grad_numel * ep, u.info->numel) << u.info->name;
        EXPECT_EQ(u.layout.optim_numel * ep, u.info->numel) << u.info->name;
        EXPECT_EQ(u.layout.optim_begin, (s.rank() % ep) * u.layout.optim_numel) << u.info->name;
      }
    EXPECT_EQ(experts_units, s.spec().num_layers);
  }
  // Memory: the plan per rank against the ZeRO formulas (with expert
  // parallelism: for the strategy's units, plus 1/ep of the experts' params,
  // grads and optimizer state); the difference is
  // only padding (each unit rounded up to a multiple of the group) and the
  // arena's 256-byte alignment of each block.
  const loom::TrainState::MemoryFormula f = loom::probe(s).memory_formula();
  const loom::ArenaPlan& plan = loom::probe(s).memory_plan();
  double pad = 0;
  for (const auto& u : loom::probe(s).units()) pad += static_cast<double>(u.layout.padded_numel - u.info->numel);
  const double align = static_cast<double>(loom::ArenaPlan::kAlign) * 3.0 * static_cast<double>(loom::probe(s).units().size());
  const double params = static_cast<double>(plan.category_bytes(loom::MemCategory::params));
  const double grads = static_cast<double>(plan.category_bytes(loom::MemCategory::grads));
  const double optim = static_cast<double>(plan.category_bytes(loom::MemCategory::optimizer) +
                                           plan.category_bytes(loom::MemCategory::master));
  const bool kept_gathered = std::find(ov.begin(), ov.end(), "sharding.reshard_after_forward=false") != ov.end();
  if (tied) return;
  if (!kept_gathered) {
    EXPECT_GE(params, f.params);
    EXPECT_LE(params, f.params + 4 * pad + align) << c.strategy << " params";
  }
  EXPECT_GE(grads, f.grads);
  EXPECT_LE(grads, f.grads + 8 * pad + align) << c.strategy << " grads";
  EXPECT_GE(optim, f.optimizer);
  EXPECT_LE(optim, f.optimizer + 8 * pad + align) << c.strategy << " optimizer";
  EXPECT_EQ(s.arena_bytes(), plan.total_bytes());
  if (g_world->rank() == 0)
    std::printf("[ %s %s ] worst rel loss diff %.2e (first above 1e-7: %s), grad norm %.2e; step bytes AR %llu RS %llu "
                "AG %llu; plan params %.0f grads %.0f optim %.0f (formula %.0f / %.0f / %.0f)\n",
                c.strategy.c_str(), ov.empty() ? "" : ov.front().c_str(), worst,
                first_apart == 0 ? "none" : ("step " + std::to_string(first_apart)).c_str(), worst_norm,
                static_cast<unsigned long long>(r.step_bytes.bytes[0]),
                static_cast<unsigned long long>(r.step_bytes.bytes[1]),
                static_cast<unsigned long long>(r.step_bytes.bytes[2]), params, grads, optim, f.params, f.grads,
                f.optimizer);
}

TEST(Sharding, Ddp) { check_strategy({"ddp", {}}); }
// A mixture of experts (model.ffn = "moe") under every kind of strategy: LM and aux losses as one process.
const std::vector<std::string> kMoe = {"model.ffn=\"moe\"", "model.num_experts=4", "model.top_k=2"};
TEST(Sharding, MoeDdp) { check_strategy({"ddp", kMoe}); }
TEST(Sharding, MoeZero1) { check_strategy({"zero1", kMoe}); }
TEST(Sharding, MoeZero2) { check_strategy({"zero2", kMoe}); }
TEST(Sharding, MoeZero3) { check_strategy({"zero3", kMoe}); }
TEST(Sharding, MoeHybridTwoGroupsOfTwo) { check_strategy({"hybrid_shard", [] {
  auto v = kMoe;
  v.push_back("sharding.shard_group_size=2");
  return v;
}(), 4}); }
// Expert parallelism: the experts of each MoE layer split over groups of 2 or
// 4 ranks, each rank holding and running only its share of them; the rest of
// the model under each strategy.
const std::vector<std::string> kMoeEp2 = [] {
  auto v = kMoe;
  v.push_back("sharding.expert_parallel=2");
  return v;
}();
const std::vector<std::string> kMoeEp4 = [] {
  auto v = kMoe;
  v.push_back("sharding.expert_parallel=4");
  return v;
}();
TEST(Sharding, MoeExpertParallel2Ddp) { check_strategy({"ddp", kMoeEp2}); }
TEST(Sharding, MoeExpertParallel2Zero3) { check_strategy({"zero3", kMoeEp2}); }
TEST(Sharding, MoeExpertParallel2Zero1) { check_strategy({"zero1", kMoeEp2}); }
TEST(Sharding, MoeExpertParallel2Zero2) { check_strategy({"zero2", kMoeEp2}); }
TEST(Sharding, MoeExpertParallel2HybridTwoGroupsOfTwo) { check_strategy({"hybrid_shard", [] {
  auto v = kMoeEp2;
  v.push_back("sharding.shard_group_size=2");
  return v;
}(), 4}); }
TEST(Sharding, MoeExpertParallel4Ddp) { check_strategy({"ddp", kMoeEp4, 4}); }
TEST(Sharding, MoeExpertParallel4Zero3) { check_strategy({"zero3", kMoeEp4, 4}); }
TEST(Sharding, MoeExpertParallel2FullRecompute) { check_strategy({"zero3", [] {
  auto v = kMoeEp2;
  v.push_back("model.recompute=\"full\"");
  return v;
}()}); }

// Every router weight zero: every token's probabilities tie, so it picks
// experts 0..k−1 (ties go to the lower index) at step 1. Those live on the
// first rank(s) of each group; the other ranks' experts get no rows at all,
// and the all_to_all bytes of step 1 are exact: per layer and micro-batch a
// rank g of a group of P sends 8·El·(P−1) bytes of counts, then h·b bytes per
// row twice (rows and their gradients) for the N rows of each chosen expert
// another rank owns, and twice for the rows it receives: N·(P−1) for each
// chosen expert it owns. The run must still match one process.
void check_zero_router(const std::string& strategy, int64_t ep) {
  if (skip_device()) GTEST_SKIP() << "no CUDA device";
  if (g_world->size() < ep) GTEST_SKIP() << "needs " << ep << " ranks";
  auto zero_router = [](loom::Session& s) {
    for (int64_t l = 0; l < s.spec().num_layers; ++l) {
      const std::string name = "model.layers." + std::to_string(l) + ".block_sparse_moe.gate.weight";
      std::vector<float> z(static_cast<size_t>(s.spec().num_experts * s.spec().hidden), 0.f);
      loom::probe(s).write_param(name, z.data());
    }
  };
  const Run& ref = reference(kMoe, zero_router, "zero_router");
  std::vector<std::string> ov = kMoe;
  ov.push_back("sharding.expert_parallel=" + std::to_string(ep));
  loom::Session s(make_config(strategy, ov));
  const Run r = train(s, 0, zero_router);
  ASSERT_EQ(r.losses.size(), ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_LE(std::fabs(r.losses[i] - ref.losses[i]) / std::fabs(ref.losses[i]), 1e-5) << "step " << i + 1;
    EXPECT_LE(std::fabs(r.aux[i] - ref.aux[i]) / std::fabs(ref.aux[i]), 1e-5) << "step " << i + 1 << " aux";
    EXPECT_LE(std::fabs(r.norms[i] - ref.norms[i]) / ref.norms[i], 1e-5) << "step " << i + 1 << " grad norm";
  }
  const loom::ModelSpec& m = s.spec();
  const int64_t P = ep, El = m.num_experts / P, N = 2 * 32, k = m.top_k, L = m.num_layers;
  const int64_t g = s.rank() % P;
  int64_t rows = 0;
  for (int64_t e = 0; e < k; ++e) rows += e / El == g ? N * (P - 1) : N;
  const uint64_t want = static_cast<uint64_t>(L * kAccum * (8 * El * (P - 1) + 2 * m.hidden * 4 * rows));
  EXPECT_EQ(r.step_bytes.bytes[static_cast<size_t>(CollectiveKind::all_to_all)], want) << "rank " << s.rank();
}
TEST(Sharding, MoeExpertParallel2IdleExpertsDdp) { check_zero_router("ddp", 2); }
TEST(Sharding, MoeExpertParallel2IdleExpertsZero3) { check_zero_router("zero3", 2); }
TEST(Sharding, MoeExpertParallel4IdleExpertsDdp) { check_zero_router("ddp", 4); }

// Checkpoints keep every expert under its global name whatever
// expert_parallel is: a run saved at step 10 under one N resumes under
// another and its steps 11..20 are those of one process (1e-5, as above).
void check_resume(int64_t save_ep, int64_t resume_ep) {
  if (skip_device()) GTEST_SKIP() << "no CUDA device";
  const int w = g_world->size();
  if (w % std::max(save_ep, resume_ep) != 0) GTEST_SKIP() << "needs a multiple of " << std::max(save_ep, resume_ep)
                                                          << " ranks";
  const Run& ref = reference(kMoe);
  const std::string dir = std::string(LOOM_BINARY_DIR) + "/tests/mpi_runs/ep_resume_" + std::to_string(save_ep) +
                          "_" + std::to_string(resume_ep) + "_np" + std::to_string(w);
  if (g_world->rank() == 0) std::filesystem::remove_all(dir);
  g_world->barrier();
  auto overrides = [&](int64_t ep) {
    std::vector<std::string> v = kMoe;
    for (std::string o : {"sharding.expert_parallel=" + std::to_string(ep), "run.out_dir=\"" + dir + "\"",
                          std::string("checkpoint.every=10"), std::string("checkpoint.resume=\"auto\""),
                          std::string("train.log_every=1")})
      v.push_back(o);
    return v;
  };
  loom::RunSummary first, second;
  {
    loom::Session s(make_config("ddp", overrides(save_ep)));
    first = s.train(10);
  }
  {
    loom::Session s(make_config("zero3", overrides(resume_ep)));
    second = s.train();
  }
  ASSERT_EQ(first.steps.size(), 10u);
  ASSERT_EQ(second.steps.size(), 10u);
  for (size_t i = 0; i < 20; ++i) {
    const loom::StepLog& got = i < 10 ? first.steps[i] : second.steps[i - 10];
    EXPECT_LE(std::fabs(got.loss - ref.losses[i]) / ref.losses[i], 1e-5) << "step " << i + 1;
    EXPECT_LE(std::fabs(got.aux_loss - ref.aux[i]) / ref.aux[i], 1e-5) << "step " << i + 1 << " aux";
  }
}
TEST(Sharding, MoeResumeExpertParallel2As1) { check_resume(2, 1); }
TEST(Sharding, MoeResumeExpertParallel1As2) { check_resume(1, 2); }
TEST(Sharding, MoeResumeExpertParallel2As4) { check_resume(2, 4); }
TEST(Sharding, MoeResumeExpertParallel4As2) { check_resume(4, 2); }

// A group size that does not divide the world is refused before any work.
TEST(Sharding, ExpertParallelMustDivideWorld) {
  if (skip_device()) GTEST_SKIP() << "no CUDA device";
  try {
    loom::Session s(make_config("ddp", {"model.ffn=\"moe\"", "model.num_experts=6", "model.top_k=2",
                                        "sharding.expert_parallel=3"}));
    FAIL() << "accepted expert_parallel = 3 on " << g_world->size() << " ranks";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("sharding.expert_parallel = 3 does not divide the"), std::string::npos)
        << e.what();
  }
}
// No strategy needs its gradients zeroed between steps (the first
// micro-batch writes them, Sharding::zeroes_grads): gradients filled with NaN
// before every step change no bit of the run (tests/session_runs.hpp).
void check_stale_gradients(const std::string& strategy, const std::vector<std::string>& ov) {
  if (skip_device()) GTEST_SKIP() << "no CUDA device";
  loom::test::stale_gradients_are_overwritten(make_config(strategy, ov), 8);
}
TEST(Sharding, StaleGradientsAreOverwrittenDdp) { check_stale_gradients("ddp", {}); }
TEST(Sharding, StaleGradientsAreOverwrittenZero1) { check_stale_gradients("zero1", {}); }
TEST(Sharding, StaleGradientsAreOverwrittenZero2Tied) { check_stale_gradients("zero2", {"model.tied_embeddings=true"}); }
TEST(Sharding, StaleGradientsAreOverwrittenZero3) { check_stale_gradients("zero3", {}); }
TEST(Sharding, StaleGradientsAreOverwrittenZero3Tied) { check_stale_gradients("zero3", {"model.tied_embeddings=true"}); }
TEST(Sharding, StaleGradientsAreOverwrittenHybrid) { check_stale_gradients("hybrid_shard", {}); }
// zero3 lends each MoE layer a fresh buffer while its experts unit (expert
// parallelism) accumulates over the step: the layer's buffer is cleared, not written.
TEST(Sharding, StaleGradientsAreOverwrittenMoeExpertParallel2Zero3) {
  if (g_world->size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  check_stale_gradients("zero3", kMoeEp2);
}
TEST(Sharding, StaleGradientsAreOverwrittenMoeExpertParallel2) {
  if (g_world->size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  std::vector<std::string> ov = kMoe;
  ov.push_back("sharding.expert_parallel=2");
  check_stale_gradients("ddp", ov);
}

TEST(Sharding, Zero1) { check_strategy({"zero1", {}}); }
TEST(Sharding, Zero2) { check_strategy({"zero2", {}}); }
TEST(Sharding, Zero3) { check_strategy({"zero3", {}}); }
TEST(Sharding, FullShardIsZero3) { check_strategy({"full_shard", {}}); }
TEST(Sharding, Zero3NoPrefetch) { check_strategy({"zero3", {"sharding.prefetch=0"}}); }
TEST(Sharding, Zero3DeepPrefetch) { check_strategy({"zero3", {"sharding.prefetch=3"}}); }
TEST(Sharding, Zero3KeepGathered) { check_strategy({"zero3", {"sharding.reshard_after_forward=false"}}); }
TEST(Sharding, HybridOneGroup) { check_strategy({"hybrid_shard", {}}); }  // default group: the node (all ranks here)
TEST(Sharding, HybridReplicasOfOne) { check_strategy({"hybrid_shard", {"sharding.shard_group_size=1"}}); }
TEST(Sharding, HybridTwoGroupsOfTwo) { check_strategy({"hybrid_shard", {"sharding.shard_group_size=2"}, 4}); }
TEST(Sharding, HybridTwoGroupsKeepGathered) {
  check_strategy({"hybrid_shard", {"sharding.shard_group_size=2", "sharding.reshard_after_forward=false"}, 4});
}
TEST(Sharding, ZeroOneWithGradClipOff) { check_strategy({"zero1", {"train.grad_clip=0"}}); }
// Gradients reduced in bf16 on the wire (GPU only): each reduction rounds the
// gradient to 8 significant bits (rel. error <= 2^-9 per element), so the
// losses drift from the fp32 reference by up to ~1e-3 over 20 steps; 5e-3.
TEST(Sharding, DdpBf16Reduce) { check_strategy({"ddp", {"sharding.reduce_dtype=\"bf16\""}, 2, 5e-3, true}); }
TEST(Sharding, Zero2Bf16Reduce) { check_strategy({"zero2", {"sharding.reduce_dtype=\"bf16\""}, 2, 5e-3, true}); }
TEST(Sharding, Zero3Bf16Reduce) { check_strategy({"zero3", {"sharding.reduce_dtype=\"bf16\""}, 2, 5e-3, true}); }
// The head of a tied model reads the embedding's params and adds to its grads.
TEST(Sharding, TiedDdp) { check_strategy({"ddp", {"model.tied_embeddings=true"}}); }
TEST(Sharding, TiedZero1) { check_strategy({"zero1", {"model.tied_embeddings=true"}}); }
TEST(Sharding, TiedZero2) { check_strategy({"zero2", {"model.tied_embeddings=true"}}); }
TEST(Sharding, TiedZero3) { check_strategy({"zero3", {"model.tied_embeddings=true"}}); }
TEST(Sharding, TiedZero3KeepGathered) {
  check_strategy({"zero3", {"model.tied_embeddings=true", "sharding.reshard_after_forward=false"}});
}
TEST(Sharding, TiedHybridTwoGroupsOfTwo) {
  check_strategy({"hybrid_shard", {"model.tied_embeddings=true", "sharding.shard_group_size=2"}, 4});
}

// Every replica starts from the same weights: the initialisation is a pure
// function of (seed, parameter), so ranks agree without a broadcast.
TEST(Sharding, ReplicasStartIdentical) {
  if (skip_device()) GTEST_SKIP() << "no CUDA device";
  loom::Session s(make_config("ddp"));
  s.initialise();
  double sum = 0;
  for (const auto& u : loom::probe(s).units())
    for (const auto& p : u.info->params)
      for (float x : loom::probe(s).read_param(p.name)) sum += static_cast<double>(x) * (1.0 + 1e-3 * static_cast<double>(p.offset % 97));
  std::vector<double> all(static_cast<size_t>(g_world->size()));
  loom::Tensor in(&sum, loom::DType::f64, loom::Device::cpu, {1});
  loom::Tensor out(all.data(), loom::DType::f64, loom::Device::cpu, {static_cast<int64_t>(all.size())});
  g_world->all_gather(loom::ExecContext{}, in, out);
  for (double a : all) EXPECT_EQ(a, all[0]);
}

// A group size that does not divide the world is refused before any memory is touched.
TEST(Sharding, GroupSizeMustDivideWorld) {
  if (skip_device()) GTEST_SKIP() << "no CUDA device";
  const int w = g_world->size();
  try {
    loom::Session s(make_config("hybrid_shard", {"sharding.shard_group_size=" + std::to_string(w + 1)}));
    FAIL() << "accepted a shard group larger than the world";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("shard_group_size"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("does not divide the world size"), std::string::npos) << e.what();
  }
}

TEST(Sharding, NoneRefusesSeveralRanks) {
  if (skip_device()) GTEST_SKIP() << "no CUDA device";
  try {
    loom::Session s(make_config("none"));
    FAIL() << "sharding none accepted " << g_world->size() << " ranks";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("runs on one rank"), std::string::npos) << e.what();
  }
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int rc = 1;
  try {
    g_world = loom::make_mpi_communicator(60.0);
    rc = RUN_ALL_TESTS();
    g_world->barrier();
    g_world.reset();
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "test_sharding: %s\n", e.what());
    loom::abort_all(2);
  }
  return rc;
}
