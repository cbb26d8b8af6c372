#include "train/train_state.hpp"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <utility>

#include "comm/plan_communicator.hpp"
#include "hf/safetensors.hpp"
#include "loom/error.hpp"
#include "train/memory_budget.hpp"

namespace loom {
namespace {

std::string human_count(double n) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2);
  if (n >= 1e9) os << n / 1e9 << "B";
  else if (n >= 1e6) os << n / 1e6 << "M";
  else if (n >= 1e3) os << n / 1e3 << "K";
  else os << n;
  return os.str();
}

// GiB from 1 GiB up, MiB below (a small model's plan would read 0.00 GiB).
std::string gib(double b) {
  std::ostringstream m;
  if (b >= 1024.0 * 1024.0 * 1024.0) m << std::fixed << std::setprecision(2) << b / (1024.0 * 1024.0 * 1024.0) << " GiB";
  else m << std::fixed << std::setprecision(1) << b / (1024.0 * 1024.0) << " MiB";
  return m.str();
}

// The FP8 weight gathers of a recipe that supplies none
// (Precision::gather_codec returned null): no weight qualifies, and why_none()
// says so for the strategy that was asked for them.
class NoFp8Gathers final : public GatherCodec {
 public:
  explicit NoFp8Gathers(std::string why) : why_(std::move(why)) {}
  int fp8_weights() const override { return 0; }
  std::string why_none() const override { return why_; }
  void plan(int /*group*/, int /*position*/, const std::vector<int64_t>& /*chunk*/) override {}
  int64_t wire_chunk_bytes(int unit) const override { refuse(cat("wire_chunk_bytes(", unit, ")")); }
  void encode(const ExecContext& /*ctx*/, Communicator& /*group*/, const std::vector<UnitState>& /*units*/,
              std::vector<Tensor>& /*wire*/) override {
    refuse("encode()");
  }
  void decode(const ExecContext& /*ctx*/, int unit, const Tensor& /*wire*/, Tensor& /*params*/) override {
    refuse(cat("decode(", unit, ")"));
  }

 private:
  [[noreturn]] void refuse(const std::string& call) const {
    throw Error(cat("FP8 gathers: ", call, " called, but there are none: ", why_));
  }
  std::string why_;
};

}  // namespace

void upload_f32(Backend& be, Tensor& dst, const float* src) {
  const size_t n = static_cast<size_t>(dst.numel());
  if (dst.dtype == DType::f32) return be.upload(dst, src, n * 4);
  LOOM_CHECK(dst.dtype == DType::bf16, "parameters stored as ", dtype_name(dst.dtype), " cannot be initialised");
  std::vector<uint16_t> tmp(n);
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) tmp[i] = hf::f32_to_bf16(src[i]);
  be.upload(dst, tmp.data(), n * 2);
}

std::vector<float> download_f32(Backend& be, const Tensor& src) {
  const size_t n = static_cast<size_t>(src.numel());
  std::vector<float> out(n);
  if (src.dtype == DType::f32) {
    be.download(out.data(), src, n * 4);
    return out;
  }
  LOOM_CHECK(src.dtype == DType::bf16, "cannot read ", dtype_name(src.dtype), " tensors as fp32");
  std::vector<uint16_t> tmp(n);
  be.download(tmp.data(), src, n * 2);
  for (size_t i = 0; i < n; ++i) out[i] = hf::bf16_to_f32(tmp[i]);
  return out;
}

TrainState::TrainState(const Config& cfg, Runtime& rt, Model& model) : cfg_(cfg), rt_(rt), model_(model) {
  const PrecisionDTypes& dt = rt_.dtypes;
  ops_ = std::make_unique<BackendOptimizerOps>(*rt_.backend, dt.stochastic_rounding, cfg_.run.seed);
  env_.ctx = rt_.backend->ctx();
  env_.world = rt_.comm.get();
  env_.ops = ops_.get();
  env_.host = rt_.host;
  env_.local_world = rt_.launch.local_world;
  env_.param_dtype = dt.param;
  env_.grad_dtype = dt.grad;
  env_.grad_accum = cfg_.train.grad_accum;
  // Expert parallelism: groups of expert_parallel consecutive ranks
  // (blocks/expert_parallel.hpp), checked before any buffer exists.
  const int64_t ep = cfg_.expert_parallel;
  if (ep > 1) {
    const int world = rt_.world();
    if (world % ep != 0)
      throw Error(cat("sharding.expert_parallel = ", ep, " does not divide the ", world, " ranks of this run: the ",
                      "experts are split over groups of expert_parallel consecutive ranks; start a multiple of ", ep,
                      " ranks or set sharding.expert_parallel to a divisor of ", world));
    // A planned run's stand-in cannot split by color (it knows no other
    // rank): its expert group is a stand-in of the group's size.
    expert_group_ = rt_.planned ? make_plan_communicator(static_cast<int>(ep), rt_.comm->device_tensors())
                                : rt_.comm->split(rt_.rank() / static_cast<int>(ep), rt_.rank());
  }
  BlockEnv be;
  be.B = cfg_.train.micro_batch;
  be.S = cfg_.train.seq_len;
  be.N = be.B * be.S;
  be.recompute = parse_recompute(cfg_.model.recompute);
  be.act = dt.activation;
  be.precision = rt_.precision.get();
  be.attention = rt_.attention.get();
  be.backend = rt_.backend.get();
  be.expert_group = expert_group_.get();
  be.head_chunk = head_chunk_tokens(model_.layers(), cfg_.model.head_chunk, be.N, model_.spec().vocab_size, be.act);
  be.document_attention = cfg_.train.reset_attention_mask;
  be.document_positions = cfg_.train.reset_position_ids;
  model_.plan(be, plan_);
  // Every linear is registered. The recipe supplies its FP8 weight gathers
  // (the weights it casts per tensor from their current amax) from where
  // each decoder linear's weight sits, or none; the strategy asks them in
  // plan() and scratch().
  GatherCodecSetup gather;
  gather.units = model_.units();
  gather.weights = model_.linear_weights();
  gather.param_dtype = dt.param;
  gather.device = rt_.backend->device();
  codec_ = rt_.precision->gather_codec(gather);
  if (!codec_)
    codec_ = std::make_unique<NoFp8Gathers>(
        cat("precision.plugin = \"", cfg_.precision.plugin,
            "\" casts no decoder weight to FP8 per tensor from its current amax (fp8_current does; delayed "
            "scaling's scales come from past amaxes, which a gather of FP8 codes cannot measure)"));
  env_.codec = codec_.get();
  const std::vector<UnitInfo>& infos = model_.units();
  layouts_ = rt_.sharding->plan(env_, infos);
  // Its state (amaxes and scales) only where the strategy gathers through it.
  codec_bytes_ = codec_->state_bytes();
  if (codec_bytes_ > 0) codec_blk_ = plan_.add("sharding.fp8_gather.scales", MemCategory::comm, codec_bytes_);
  LOOM_CHECK(layouts_.size() == infos.size(), "sharding plugin returned ", layouts_.size(), " layouts for ",
             infos.size(), " units");
  // The recipe learns its data-parallel group (FP8 amaxes are reduced over
  // it) and whether the strategy keeps the parameters sharded (what the
  // FP8 recipes' weight_cache = "auto" decides with), then says what memory
  // it needs.
  PrecisionSetup setup;
  setup.data_parallel = rt_.comm.get();
  setup.deterministic = cfg_.run.deterministic;
  setup.device = rt_.backend->device();
  setup.grad_accum = static_cast<int>(cfg_.train.grad_accum);
  // (An expert-parallel unit's experts are this rank's own, never gathered.)
  for (size_t i = 0; i < infos.size(); ++i)
    setup.params_sharded = setup.params_sharded || (layouts_[i].params_sharded && infos[i].expert_group == 1);
  rt_.precision->setup(setup);

  const size_t pb = dtype_size(dt.param), gb = dtype_size(dt.grad), ob = dtype_size(dt.optim_state);
  for (size_t i = 0; i < infos.size(); ++i) {
    const UnitLayout& l = layouts_[i];
    const std::string& n = infos[i].name;
    LOOM_CHECK(l.padded_numel >= infos[i].numel && l.optim_numel >= 0 && l.optim_begin >= 0 &&
                   l.optim_begin + l.optim_numel <= l.padded_numel && l.replicas >= 1 && l.replica >= 0 &&
                   l.replica < l.replicas && l.param_numel == (l.params_sharded ? l.optim_numel : l.padded_numel),
               "sharding.plugin = \"", cfg_.sharding.plugin, "\" planned an inconsistent layout for unit ", n);
    if (infos[i].expert_group > 1) {
      // Expert parallelism: this rank's experts, whole (ffn_moe.cpp reads them in place).
      const int64_t P = infos[i].expert_group, chunk = infos[i].numel / P;
      if (!(l.params_sharded && l.param_numel == chunk && l.optim_numel == chunk && l.grad_numel == chunk &&
            l.optim_begin == (rt_.rank() % P) * chunk))
        throw Error(cat("sharding.plugin = \"", cfg_.sharding.plugin, "\" does not support sharding.expert_parallel = ",
                        P, ": it did not give rank ", rt_.rank(), " the whole range of its experts in unit ", n,
                        "; use ddp, zero1, zero2, zero3 (full_shard) or hybrid_shard, or sharding.expert_parallel = 1"));
    }
    UnitBlocks b{};
    b.params = plan_.add("params." + n, MemCategory::params, static_cast<size_t>(l.param_numel) * pb);
    b.grads = plan_.add("grads." + n, MemCategory::grads, static_cast<size_t>(l.grad_numel) * gb);
    b.grad_shard = plan_.add("grad_shard." + n, MemCategory::grads, static_cast<size_t>(l.grad_shard_numel) * 4);
    b.has_master = dt.has_master;
    if (b.has_master) b.master = plan_.add("master." + n, MemCategory::master, static_cast<size_t>(l.optim_numel) * 4);
    b.m = plan_.add("adam_m." + n, MemCategory::optimizer, static_cast<size_t>(l.optim_numel) * ob);
    b.v = plan_.add("adam_v." + n, MemCategory::optimizer, static_cast<size_t>(l.optim_numel) * ob);
    unit_blocks_.push_back(b);
  }
  scratch_req_ = rt_.sharding->scratch(env_);
  for (const ShardingBuffer& r : scratch_req_)
    scratch_blocks_.push_back(
        plan_.add("sharding." + r.name, r.category, static_cast<size_t>(r.numel) * dtype_size(r.dtype)));

  // What the recipe keeps from each linear's forward for its backward counts
  // as activations (one copy per linear, whatever model.recompute says;
  // under "selective" the FP8 recipes keep none: LinearDesc::input_in_backward).
  precision_saved_bytes_ = 0;
  for (int id : model_.linear_ids()) precision_saved_bytes_ += rt_.precision->saved_activation_bytes(id);
  precision_saved_ = plan_.add("precision.saved_activations", MemCategory::activations, precision_saved_bytes_);
  precision_ws_bytes_ = rt_.precision->workspace_bytes();
  precision_ws_ = plan_.add("precision.workspace", MemCategory::workspace, precision_ws_bytes_);
  // One row per step between two reads of the step log: log_every in
  // training, at least 16 for drivers that read less often (loom bench).
  // A log step is read one step later (Session::read_step_logs_but_newest),
  // so up to log_every + 1 steps are unread at once. At most kMaxStepLogRows:
  // a longer log_every (train.log_every = 1000000 to log rarely) would
  // otherwise size the ring, and the pinned token slots that follow it, by
  // the key; when the ring fills, Session::train_step reads it early (one
  // synchronisation per kMaxStepLogRows steps, nothing lost).
  scalar_log_rows_ = std::clamp<int64_t>(cfg_.train.log_every + 1, 16, kMaxStepLogRows);
  scalars_blk_ = plan_.add("step.scalars", MemCategory::other, 2 * kStepScalars * sizeof(double));
  scalar_log_blk_ =
      plan_.add("step.log", MemCategory::other, static_cast<size_t>(scalar_log_rows_) * kStepScalars * sizeof(double));
  eval_sum_blk_ = plan_.add("eval.sum", MemCategory::other, sizeof(double));
}

void TrainState::allocate() {
  Backend& be = *rt_.backend;
  arena_.allocate(plan_, be.device());
  model_.bind(arena_);
  if (codec_bytes_ > 0) codec_->bind(arena_.ptr(codec_blk_));
  rt_.precision->set_workspace(arena_.ptr(precision_ws_), precision_ws_bytes_);
  if (precision_saved_bytes_ > 0)
    rt_.precision->set_saved_activations(arena_.ptr(precision_saved_), precision_saved_bytes_);
  const Tensor both = arena_.tensor(scalars_blk_, DType::f64, {2 * kStepScalars});
  scalars_[0] = view(both, 0, {kStepScalars});
  scalars_[1] = view(both, kStepScalars, {kStepScalars});
  parity_ = 0;
  scalar_log_ = arena_.tensor(scalar_log_blk_, DType::f64, {scalar_log_rows_ * kStepScalars});
  eval_sum_ = arena_.tensor(eval_sum_blk_, DType::f64, {1});
  ops_->bind(scalars_[0], 1.0f, static_cast<float>(cfg_.train.grad_clip));
  const PrecisionDTypes& dt = rt_.dtypes;
  const std::vector<UnitInfo>& infos = model_.units();
  units_.clear();
  own_grads_.clear();
  for (size_t i = 0; i < infos.size(); ++i) {
    const UnitLayout& l = layouts_[i];
    const UnitBlocks& b = unit_blocks_[i];
    UnitState u;
    u.index = static_cast<int>(i);
    u.info = &infos[i];
    u.layout = l;
    Tensor p = arena_.tensor(b.params, dt.param, {l.param_numel});
    (l.params_sharded ? u.param_shard : u.params) = p;
    if (l.grad_numel > 0) u.grads = arena_.tensor(b.grads, dt.grad, {l.grad_numel});
    if (l.grad_shard_numel > 0) u.grad_shard = arena_.tensor(b.grad_shard, DType::f32, {l.grad_shard_numel});
    if (b.has_master) u.master = arena_.tensor(b.master, DType::f32, {l.optim_numel});
    u.adam_m = arena_.tensor(b.m, dt.optim_state, {l.optim_numel});
    u.adam_v = arena_.tensor(b.v, dt.optim_state, {l.optim_numel});
    // Padding and optimizer state start at zero (AdamW's m and v, and the
    // padded tail every gather and reduce carries).
    for (Tensor* t : {&p, &u.grads, &u.grad_shard, &u.master, &u.adam_m, &u.adam_v})
      if (t->data) be.zero(*t);
    units_.push_back(u);
    own_grads_.push_back(u.grads);
  }
  scratch_.clear();
  for (size_t i = 0; i < scratch_req_.size(); ++i) {
    scratch_.push_back(arena_.tensor(scratch_blocks_[i], scratch_req_[i].dtype, {scratch_req_[i].numel}));
    be.zero(scratch_.back());
  }
  for (Tensor* t : {&scalars_[0], &scalars_[1], &scalar_log_, &eval_sum_}) be.zero(*t);
}

int TrainState::next_scalars() {
  parity_ ^= 1;
  ops_->bind(scalars_[parity_], 1.0f, static_cast<float>(cfg_.train.grad_clip));
  return parity_;
}

void TrainState::zero_grads() {
  for (Tensor& g : own_grads_)
    if (g.data) rt_.backend->zero(g);
}

TrainState::MemoryFormula TrainState::memory_formula() const {
  // ZeRO (Rajbhandari et al. 2020), per rank, with p the shard group: params
  // P*Psi/p at stage 3, grads G*Psi/p from stage 2, optimizer state K*Psi/p
  // from stage 1, where P and G are the param and grad bytes per element and K
  // the master + m + v bytes. Sharded gradients are kept as fp32 shards
  // (reduce_dtype), so G = 4 there, and stage 1 keeps whole gradients plus
  // that shard. The stage and p are read off the layout the strategy planned
  // for its largest unit (a plugin of any name), not off the plugin's name.
  const PrecisionDTypes& dt = rt_.dtypes;
  const std::vector<UnitInfo>& infos = model_.units();
  // Expert parallelism: the experts units are held 1/P per rank (params,
  // grads and optimizer state alike), whatever the strategy; the formulas
  // below are for the other parameters.
  double psi_e = 0, ep = 1;
  for (const UnitInfo& u : infos)
    if (u.expert_group > 1) {
      psi_e += static_cast<double>(u.numel);
      ep = static_cast<double>(u.expert_group);
    }
  const double psi = static_cast<double>(model_.spec().total_params()) - psi_e;
  const double P = static_cast<double>(dtype_size(dt.param));
  const double G = static_cast<double>(dtype_size(dt.grad));
  const double K = (dt.has_master ? 4.0 : 0.0) + 2.0 * static_cast<double>(dtype_size(dt.optim_state));
  MemoryFormula f;
  if (layouts_.empty()) return f;
  // A unit another one reads (a tied embedding) may be kept whole on purpose: skip it.
  const UnitLayout* big = nullptr;
  for (size_t i = 0; i < layouts_.size(); ++i) {
    const bool read_by_another = std::any_of(infos.begin(), infos.end(), [&](const UnitInfo& u) {
      return u.uses_params_of == static_cast<int>(i);
    });
    if (!read_by_another && infos[i].expert_group == 1 && (!big || layouts_[i].padded_numel > big->padded_numel))
      big = &layouts_[i];
  }
  if (!big) big = &layouts_[0];
  const double p = big->optim_numel > 0 ? static_cast<double>(big->padded_numel) / static_cast<double>(big->optim_numel) : 1.0;
  const bool z1 = big->optim_numel < big->padded_numel;
  const bool z2 = z1 && big->grad_numel == 0;
  const bool z3 = big->params_sharded;
  f.params = P * psi / (z3 ? p : 1.0) + P * psi_e / ep;
  f.grads = (z2 ? 4.0 * psi / p : G * psi + (z1 ? 4.0 * psi / p : 0.0)) + G * psi_e / ep;
  f.optimizer = K * psi / (z1 ? p : 1.0) + K * psi_e / ep;
  return f;
}

std::string TrainState::describe() const {
  const ModelSpec& spec = model_.spec();
  const PrecisionDTypes& dt = rt_.dtypes;
  std::ostringstream os;
  const double N = static_cast<double>(spec.total_params());
  os << "model: " << human_count(N) << " parameters (" << spec.total_params() << "): hidden " << spec.hidden
     << ", layers " << spec.num_layers << " (" << model_.layers() << "), heads " << spec.num_heads << "/"
     << spec.num_kv_heads << " kv, ffn " << spec.ffn_hidden << ", vocab " << spec.vocab_size
     << (spec.tied_embeddings ? ", tied embeddings" : "") << "\n";
  if (spec.moe()) {
    os << "experts: " << spec.num_experts << " per layer, top " << spec.top_k << " per token (router_aux_loss_coef "
       << spec.router_aux_loss_coef << ", router_jitter_noise " << spec.router_jitter_noise << "); parameters "
       << human_count(static_cast<double>(spec.active_params())) << " active of " << human_count(N) << " total ("
       << spec.active_params() << " / " << spec.total_params() << ")\n";
    os << "flops per token: " << human_count(spec.flops_per_token(cfg_.train.seq_len))
       << " active (6N + 12LhS, N = " << human_count(static_cast<double>(spec.matmul_params()))
       << " matmul weights a token uses: the router and top " << spec.top_k << " experts; MFU counts these), "
       << human_count(spec.total_flops_per_token(cfg_.train.seq_len)) << " if every expert ran (N = "
       << human_count(static_cast<double>(spec.total_matmul_params())) << ")\n";
  } else {
    os << "flops per token: " << human_count(spec.flops_per_token(cfg_.train.seq_len)) << " (6N + 12LhS, N = "
       << human_count(static_cast<double>(spec.matmul_params())) << " matmul weights; MFU counts these), "
       << human_count(spec.causal_flops_per_token(cfg_.train.seq_len))
       << " with causal attention (6N + 6LhS: NeMo's model TFLOP/s)\n";
  }
  os << "plugins: precision " << cfg_.precision.plugin << ", attention " << cfg_.attention.plugin << ", sharding "
     << cfg_.sharding.plugin << ", data " << cfg_.data.plugin << "; device " << cfg_.run.device << ", ranks "
     << rt_.world() << "\n";
  os << "batch: " << cfg_.train.micro_batch << " x " << cfg_.train.seq_len << " tokens per micro-step, grad_accum "
     << cfg_.train.grad_accum << " -> "
     << cfg_.train.micro_batch * cfg_.train.seq_len * cfg_.train.grad_accum * rt_.world() << " tokens per step";
  if (model_.env().head_chunk < model_.env().N)
    os << "; LM head in chunks of " << model_.env().head_chunk << " tokens";
  os << "\n";
  // A layout that shards anything: print the ZeRO formulas beside the plan.
  const bool sharded = std::any_of(layouts_.begin(), layouts_.end(), [](const UnitLayout& l) {
    return l.optim_numel < l.padded_numel || l.params_sharded || l.replicas > 1;
  });
  if (rt_.world() > 1 || sharded) {
    const MemoryFormula f = memory_formula();
    os << "ranks: " << rt_.world() << (rt_.launch.launcher.empty() ? "" : " (" + rt_.launch.launcher + ")")
       << ", this is rank " << rt_.rank() << "; ZeRO formulas per rank for " << cfg_.sharding.plugin << ": params "
       << gib(f.params) << ", grads " << gib(f.grads) << ", optimizer state " << gib(f.optimizer)
       << " (the plan below adds padding and the strategy's comm buffers)\n";
  }
  os << "memory plan per rank (" << dtype_name(dt.param) << " params, " << dtype_name(dt.grad) << " grads, "
     << dtype_name(dt.optim_state) << " optimizer state, " << dtype_name(dt.activation) << " activations, recompute "
     << cfg_.model.recompute << "):\n"
     << plan_.summary();
  if (rt_.backend->device() == Device::cuda) {
    const OutsideArena o = outside_arena_estimate(rt_.world(), rt_.launch.local_world, rt_.launched());
    os << "beyond the arena, estimated: CUDA context, kernels and library handles " << gib(static_cast<double>(o.context))
       << ", MPI and NCCL " << gib(static_cast<double>(o.launcher + o.nccl)) << "\n";
    os << "per rank in all: " << gib(static_cast<double>(planned_device_bytes()));
    if (rt_.planned_device) {
      const double total = static_cast<double>(rt_.planned_device->total);
      const double in_all = static_cast<double>(planned_device_bytes());
      os << " of " << gib(total) << " on " << rt_.planned_device->name
         << (in_all <= total ? cat(": fits, ", gib(total - in_all), " to spare")
                             : cat(": DOES NOT FIT, ", gib(in_all - total), " short"));
    }
    os << "\n";
  }
  return os.str();
}

size_t TrainState::outside_arena_bytes() const {
  if (rt_.backend->device() != Device::cuda) return 0;
  return outside_arena_estimate(rt_.world(), rt_.launch.local_world, rt_.launched()).total();
}

std::string TrainState::plan_breakdown() const {
  // A block's name with every number that follows a '.' (a layer, a unit)
  // replaced by '*': the blocks of every layer fall into one row.
  auto pattern = [](const std::string& n) {
    std::string out;
    for (size_t i = 0; i < n.size();) {
      if (n[i] == '.' && i + 1 < n.size() && std::isdigit(static_cast<unsigned char>(n[i + 1]))) {
        size_t j = i + 1;
        while (j < n.size() && std::isdigit(static_cast<unsigned char>(n[j]))) ++j;
        if (j == n.size() || n[j] == '.') {
          out += ".*";
          i = j;
          continue;
        }
      }
      out += n[i++];
    }
    return out;
  };
  struct Row {
    std::string name;
    MemCategory cat;
    size_t bytes = 0, count = 0, each = 0;
    bool equal = true;
  };
  std::vector<Row> rows;
  for (const ArenaBlock& b : plan_.blocks()) {
    const size_t padded = (b.bytes + ArenaPlan::kAlign - 1) / ArenaPlan::kAlign * ArenaPlan::kAlign;
    const std::string key = pattern(b.name);
    auto it = std::find_if(rows.begin(), rows.end(), [&](const Row& r) { return r.name == key && r.cat == b.category; });
    if (it == rows.end()) {
      rows.push_back({key, b.category, 0, 0, padded, true});
      it = rows.end() - 1;
    }
    it->equal = it->equal && it->each == padded;
    it->bytes += padded;
    ++it->count;
  }
  std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.bytes > b.bytes; });
  std::ostringstream os;
  os << "memory plan part by part (per rank, largest first; '*' is a layer's or a unit's number):\n";
  for (const Row& r : rows) {
    if (r.bytes == 0) continue;
    os << "  " << std::left << std::setw(40) << r.name << std::setw(12) << mem_category_name(r.cat) << std::right
       << std::setw(12) << gib(static_cast<double>(r.bytes));
    if (r.count > 1)
      os << "  (" << r.count << (r.equal ? cat(" x ", gib(static_cast<double>(r.each))) : std::string(" blocks")) << ")";
    os << "\n";
  }
  return os.str();
}

std::string TrainState::memory_report() const {
  std::ostringstream os;
  auto g = [](size_t b) { return gib(static_cast<double>(b)); };
  os << "memory on rank " << rt_.rank() << ": planned " << g(plan_.total_bytes()) << " (params "
     << g(plan_.category_bytes(MemCategory::params)) << ", grads " << g(plan_.category_bytes(MemCategory::grads))
     << ", optimizer "
     << g(plan_.category_bytes(MemCategory::optimizer) + plan_.category_bytes(MemCategory::master))
     << ", activations " << g(plan_.category_bytes(MemCategory::activations)) << ", comm "
     << g(plan_.category_bytes(MemCategory::comm)) << "), arena allocated " << g(arena_.bytes());
  if (rt_.backend->device() == Device::cuda) {
    os << ", device in use " << g(rt_.backend->device_memory_used()) << " (the plan with what lies beyond the arena, "
       << "estimated: " << g(planned_device_bytes()) << ")";
  } else {
    std::ifstream st("/proc/self/status");
    for (std::string line; std::getline(st, line);)
      if (line.rfind("VmRSS:", 0) == 0) {
        std::istringstream is(line.substr(6));
        size_t kb = 0;
        is >> kb;
        os << ", process RSS " << g(kb * 1024);
      }
  }
  return os.str();
}

namespace {

// Memory the process needs beyond the arena. On the host: token staging
// (<= 64 MiB), BLAS and library buffers. On a GPU the CUDA context and the
// libraries' handles exist already when free memory is measured, but NCCL
// connects at its first collective: its buffers, and a small margin for what
// libraries allocate lazily at the first step. A GPU the run is only planned
// for (loom check --gpu) holds none of it yet: all of the estimate.
double memory_outside_plan(const Runtime& rt, double plan) {
  if (rt.backend->device() != Device::cuda) return std::max(128.0 * (1 << 20), plan / 16.0);
  const OutsideArena o = outside_arena_estimate(rt.world(), rt.launch.local_world, rt.launched());
  if (rt.planned_device) return static_cast<double>(o.total());
  return 128.0 * (1 << 20) + static_cast<double>(o.nccl);
}

// What the run's arena may take: the GPU's free memory, or the host's.
MemoryBudget arena_budget(const Runtime& rt) {
  if (rt.backend->device() != Device::cuda) return host_memory_budget();
  MemoryBudget budget;
  if (rt.planned_device) {
    budget.available = rt.planned_device->total;
    budget.source = cat("the GPU planned for, ", rt.planned_device->name, ", has ",
                        human_bytes(static_cast<double>(budget.available)));
    return budget;
  }
  budget.available = rt.backend->device_memory_free();
  budget.source = cat("device ", rt.backend->device_index(), " (", rt.backend->device_name(), ") has ",
                      human_bytes(static_cast<double>(budget.available)), " free");
  return budget;
}

// How a run spreads its weights, gradients and optimizer state over its
// ranks, for the advice below.
struct StateSpread {
  int world = 1;                // ranks of the run
  int shards = 1;               // ranks that split one copy of the optimizer state (1: each holds all of it)
  bool params_sharded = false;  // the resident parameters are a shard too (zero3)
  // The early check's floor, planned as if zero3 split everything over all
  // ranks whatever the strategy: more ranks then need zero3 too.
  bool floor = false;
};

// What to change when the plan does not fit: the levers that can change this
// config's parts, the larger part's first. A lever already at its end (a
// micro-batch of 1, a strategy that already shards everything) is not
// offered. `state` and `acts` are this rank's.
std::string fit_advice(const Config& cfg, const ModelSpec& spec, const PrecisionDTypes& dt, bool gpu,
                       const StateSpread& spread, double acts, double state) {
  auto join = [](const std::vector<std::string>& v) {
    std::string out;
    for (size_t i = 0; i < v.size(); ++i) out += cat(i == 0 ? "" : ", or ", v[i]);
    return out;
  };
  std::vector<std::string> act;
  if (cfg.train.micro_batch > 1) act.push_back(cat("lower train.micro_batch (", cfg.train.micro_batch, ")"));
  act.push_back(cat("lower train.seq_len (", cfg.train.seq_len, ")"));
  if (cfg.model.recompute == "none")
    act.push_back("set model.recompute = \"selective\" (the norms' and SwiGLU's outputs recomputed, little compute) "
                  "or \"full\"");
  else if (cfg.model.recompute != "full")
    act.push_back("set model.recompute = \"full\"");

  std::vector<std::string> st;
  const std::string& sharding = cfg.sharding.plugin;
  if (spread.floor || (spread.params_sharded && spread.shards >= spread.world)) {
    // The state's share falls as 1/ranks, the rest (activations, workspaces,
    // the gathered units, what lies beyond the arena) does not: `loom check`
    // plans other counts, and after this message names the fewest that fit.
    // On the host, ranks on one machine share its memory: more of them do not help there.
    if (gpu)
      st.push_back(cat("more ranks (this is a 1/", spread.world, " share",
                       spread.floor ? ", as a strategy that shards everything holds it: sharding.plugin = \"zero3\"" : "",
                       "; `loom check CONFIG --world-size N` with --gpu or --device-memory plans N)"));
  } else if (spread.shards <= 1) {
    st.push_back(cat("the state sharded over several ranks (sharding.plugin = \"zero3\" under mpirun -np N / srun; "
                     "\"zero2\" and \"zero1\" shard less of it)",
                     spread.world == 1 ? "" : cat(", where sharding.plugin = \"", sharding, "\" keeps a whole copy on each rank")));
  } else if (!spread.params_sharded) {
    st.push_back(cat("the parameters sharded too (sharding.plugin = \"zero3\"; \"", sharding,
                     "\" keeps them whole on each rank)"));
  } else {
    st.push_back(cat("larger shard groups (each group of ", spread.shards, " of the ", spread.world,
                     " ranks holds a whole copy of the state: sharding.shard_group_size)"));
  }
  // The recipe's levers, where it takes their keys (the keys it read: the
  // core does not match plugin names).
  const std::vector<std::string> recipe_keys = cfg.precision.table.read_keys();
  auto takes = [&](const char* key) { return std::find(recipe_keys.begin(), recipe_keys.end(), key) != recipe_keys.end(); };
  if (gpu && dt.param == DType::f32) {
    st.push_back("bf16 weights (precision.plugin = \"bf16\")");
  } else if (gpu && dt.has_master) {
    if (dt.optim_state == DType::f32 && takes("optimizer_state"))
      st.push_back("AdamW's m and v in bf16, the master staying fp32 (precision.optimizer_state = \"bf16\")");
    st.push_back(takes("master") ? std::string("no fp32 master copy, and the AdamW state in bf16 (precision.master = \"bf16\")")
                                 : std::string("a recipe without an fp32 master copy (such as precision.plugin = \"bf16_pure\")"));
  }
  st.push_back(cat("a smaller model (model.hidden = ", spec.hidden, ", model.num_layers = ", spec.num_layers,
                   ", model.vocab_size = ", spec.vocab_size, ", model.ffn_hidden = ", spec.ffn_hidden,
                   spec.moe() ? cat(", model.num_experts = ", spec.num_experts) : std::string(), ")"));
  const std::string for_acts = cat("the activations (", human_bytes(acts), "): ", join(act));
  const std::string for_state = cat("the weights, gradients and optimizer state (", human_bytes(state), "): ", join(st));
  return acts >= state ? cat("shrink ", for_acts, "; or ", for_state) : cat("shrink ", for_state, "; or ", for_acts);
}

}  // namespace

PlanFloor plan_floor(const Config& cfg, const ModelSpec& spec, const PrecisionDTypes& dt, int world) {
  using LD = long double;
  PlanFloor f;
  // The blocks' declarations and activations, from their variants' floors
  // (loom/block.hpp BlockFloor), nothing built.
  FloorEnv fe;
  fe.spec = &spec;
  fe.tokens = static_cast<LD>(cfg.train.micro_batch) * static_cast<LD>(cfg.train.seq_len);
  fe.expert_parallel = cfg.expert_parallel;
  const BlockFloor m = model_floor(spec, cfg.model.layers, cfg.model.ffn, fe, cfg.model.head_chunk);
  // Weights, gradients and optimizer state: no strategy holds less of them
  // per rank than an equal share of every parameter (ZeRO-3 over all ranks).
  f.params = m.params;
  f.bytes_per_param = static_cast<LD>(dtype_size(dt.param) + dtype_size(dt.grad) + (dt.has_master ? 4 : 0) +
                                      2 * dtype_size(dt.optim_state));
  f.state = f.params * f.bytes_per_param / static_cast<LD>(std::max(1, world));
  // Activations every plan holds (model_floor) and the tokens.
  f.activations = static_cast<LD>(dtype_size(dt.activation)) * m.activations + 8 * fe.tokens;
  f.plan = f.state + f.activations;
  // Host memory that the description of the parameters takes before any plan
  // exists (a name, a shape and an offset per tensor, and the blocks that
  // declare them: about 400 bytes a tensor, counted as 384): with thousands
  // of layers of hundreds of experts that alone is gigabytes.
  f.tensors = m.tensors;
  f.description = 384 * static_cast<LD>(f.tensors);
  return f;
}

void check_memory_can_fit(const Config& cfg, const ModelSpec& spec, const Runtime& rt) {
  using LD = long double;
  const bool gpu = rt.backend->device() == Device::cuda;
  const PlanFloor f = plan_floor(cfg, spec, rt.dtypes, rt.world());
  const LD world = static_cast<LD>(std::max(1, rt.world()));
  const LD params = f.params, per_param = f.bytes_per_param, state = f.state, acts = f.activations, plan = f.plan,
           book = f.description;
  const int64_t tensors = f.tensors;
  const int sharing = std::max(1, rt.launch.local_world);  // ranks on one machine share its host memory
  const MemoryBudget budget = arena_budget(rt);
  const MemoryBudget host = gpu ? host_memory_budget() : budget;
  const LD extra = static_cast<LD>(memory_outside_plan(rt, static_cast<double>(plan)));
  const LD need = gpu ? plan + extra : (plan + extra + book) * sharing;
  const LD host_need = gpu ? book * sharing : need;
  // Beyond 1 EiB nothing can hold it, whatever the budget says (or when none is known).
  const bool absurd = plan > static_cast<LD>(uint64_t{1} << 60);
  const bool device_short = budget.known() && need > static_cast<LD>(budget.available);
  const bool host_short = host.known() && host_need > static_cast<LD>(host.available);
  if (!absurd && !device_short && !host_short) return;
  if (gpu && host_short && !device_short && !absurd)
    throw MemoryPlanError(cat("the model cannot be described on the host: its ", tensors, " parameter tensors take at least ",
                    human_bytes(static_cast<double>(book)), " of host memory before anything is planned",
                    sharing > 1 ? cat(", times ", sharing, " ranks on this machine") : std::string(), ", but only ",
                    human_bytes(static_cast<double>(host.available)), " is available: ", host.source,
                    ". Nothing was built. Lower model.num_layers (", spec.num_layers, ")",
                    spec.moe() ? cat(" or model.num_experts (", spec.num_experts, ")") : std::string(),
                    // loom check --world-size N without --gpus-per-node plans all N ranks on one machine.
                    rt.launch.under_launcher_planned && sharing == rt.world() && sharing > 1
                        ? cat(", or say how many of the ", sharing, " ranks share a machine (loom check --gpus-per-node G)")
                        : std::string()));
  const std::string per_rank = world > 1 ? cat(" (an equal share of ", rt.world(), " ranks)") : std::string();
  throw MemoryPlanError(cat(
      "the memory plan cannot fit: before anything is planned in detail, this config needs at least ",
      human_bytes(static_cast<double>(need)), " (the weights, gradients and optimizer state ",
      human_bytes(static_cast<double>(state)), per_rank, ": ", human_count(static_cast<double>(params)),
      " parameters x ", static_cast<double>(per_param), " bytes; the activations ", human_bytes(static_cast<double>(acts)),
      gpu ? std::string()
          : cat("; describing the ", tensors, " parameter tensors ", human_bytes(static_cast<double>(book))),
      "; plus ", human_bytes(static_cast<double>(extra)), " outside the plan",
      !gpu && sharing > 1 ? cat(", times ", sharing, " ranks on this machine") : std::string(), "), but ",
      device_short ? cat("only ", human_bytes(static_cast<double>(budget.available)), " is available: ", budget.source)
                   : std::string("no machine holds more than 1 EiB"),
      ". Nothing was built. To fit: ", fit_advice(cfg, spec, rt.dtypes, gpu, StateSpread{rt.world(), rt.world(), true, true},
                                           static_cast<double>(acts), static_cast<double>(state)),
      ". 'loom check' prints the whole plan of a config that fits"));
}

void TrainState::check_memory_fits() const {
  const bool gpu = rt_.backend->device() == Device::cuda;
  const double plan = static_cast<double>(plan_.total_bytes());
  const double extra = memory_outside_plan(rt_, plan);
  // Ranks on one machine share its host memory (and its cgroup); each has its own GPU.
  const int sharing = gpu ? 1 : std::max(1, rt_.launch.local_world);
  const MemoryBudget budget = arena_budget(rt_);
  const double need = (plan + extra) * sharing;
  if (!budget.known() || need <= static_cast<double>(budget.available)) return;

  auto cat_bytes = [&](MemCategory c) { return static_cast<double>(plan_.category_bytes(c)); };
  const double acts = cat_bytes(MemCategory::activations);
  const double state = cat_bytes(MemCategory::params) + cat_bytes(MemCategory::grads) +
                       cat_bytes(MemCategory::optimizer) + cat_bytes(MemCategory::master);
  StateSpread spread{rt_.world(), 1, false, false};
  for (const UnitLayout& l : layouts_) {
    if (l.optim_numel > 0) spread.shards = std::max(spread.shards, static_cast<int>(l.padded_numel / l.optim_numel));
    spread.params_sharded = spread.params_sharded || l.params_sharded;
  }
  const std::string fix = fit_advice(cfg_, model_.spec(), rt_.dtypes, gpu, spread, acts, state);
  throw MemoryPlanError(cat("the memory plan does not fit: this run needs about ", human_bytes(need), " (the plan: ",
                  human_bytes(plan), " per rank — params ", human_bytes(cat_bytes(MemCategory::params)), ", grads ",
                  human_bytes(cat_bytes(MemCategory::grads)), ", optimizer ",
                  human_bytes(cat_bytes(MemCategory::optimizer) + cat_bytes(MemCategory::master)), ", activations ",
                  human_bytes(acts), ", workspace and comm ",
                  human_bytes(cat_bytes(MemCategory::workspace) + cat_bytes(MemCategory::comm) +
                              cat_bytes(MemCategory::other)),
                  " — plus ", human_bytes(extra), " outside it",
                  sharing > 1 ? cat(", times ", sharing, " ranks on this machine") : std::string(), "), but only ",
                  human_bytes(static_cast<double>(budget.available)), " is available: ", budget.source,
                  ". Nothing was allocated. To fit: ", fix, ". 'loom check' prints the whole plan"));
}

const ParamInfo& TrainState::find_param(const std::string& hf_name, int* unit) const {
  const std::vector<UnitInfo>& infos = model_.units();
  for (size_t u = 0; u < infos.size(); ++u)
    for (const ParamInfo& p : infos[u].params)
      if (p.name == hf_name) {
        *unit = static_cast<int>(u);
        return p;
      }
  throw Error(cat("no parameter named '", hf_name, "' in this model"));
}

std::vector<float> TrainState::read_tensor(const Tensor& t) const { return download_f32(*rt_.backend, t); }

std::vector<float> TrainState::read_param(const std::string& hf_name, bool grad) const {
  int u = 0;
  const ParamInfo& p = find_param(hf_name, &u);
  const UnitState& unit = units_[static_cast<size_t>(u)];
  LOOM_CHECK(!unit.layout.params_sharded && (!grad || unit.layout.grad_numel > 0), "read_param('", hf_name,
             "'): sharding.plugin = \"", cfg_.sharding.plugin, "\" keeps only a shard of it on this rank");
  const Tensor& flat = grad ? unit.grads : unit.params;
  return download_f32(*rt_.backend, view(flat, p.offset, {p.numel}));
}

void TrainState::write_param(const std::string& hf_name, const float* src) {
  int u = 0;
  const ParamInfo& p = find_param(hf_name, &u);
  UnitState& unit = units_[static_cast<size_t>(u)];
  Backend& be = *rt_.backend;
  // The owned range [optim_begin, optim_begin + optim_numel): what the master
  // copy holds in fp32, and what a sharded params buffer holds.
  const int64_t lo = std::max(p.offset, unit.layout.optim_begin);
  const int64_t hi = std::min(p.offset + p.numel, unit.layout.optim_begin + unit.layout.optim_numel);
  if (unit.layout.params_sharded) {
    if (lo < hi) {
      Tensor dst = view(unit.param_shard, lo - unit.layout.optim_begin, {hi - lo});
      upload_f32(be, dst, src + (lo - p.offset));
    }
  } else {
    Tensor dst = view(unit.params, p.offset, {p.numel});
    upload_f32(be, dst, src);
  }
  if (unit.master.data && lo < hi) {
    Tensor m = view(unit.master, lo - unit.layout.optim_begin, {hi - lo});
    upload_f32(be, m, src + (lo - p.offset));
  }
}

}  // namespace loom
