#include "train/session.hpp"

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "comm/launch.hpp"
#include "comm/mpi_communicator.hpp"
#ifdef LOOM_HAVE_NCCL
#include "comm/nccl_communicator.hpp"
#endif
#include "hf/hf_llama.hpp"
#include "hf/safetensors.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"

namespace fs = std::filesystem;

namespace loom {
namespace {

// fp32 host data into a tensor of any storage dtype (bf16 rounds to nearest even).
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
  LOOM_CHECK(src.dtype == DType::bf16, "cannot read ", dtype_name(src.dtype), " parameters as fp32");
  std::vector<uint16_t> tmp(n);
  be.download(tmp.data(), src, n * 2);
  for (size_t i = 0; i < n; ++i) out[i] = hf::bf16_to_f32(tmp[i]);
  return out;
}

// A normal sample from SplitMix64 + Box-Muller: the same numbers on every
// platform and standard library, and a pure function of (seed, stream, index)
// so initialisation does not depend on how parameters are laid out or sharded.
uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}
double uniform01(uint64_t bits) { return (static_cast<double>(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
void fill_normal(float* out, int64_t n, uint64_t seed, uint64_t stream, double stddev) {
  const uint64_t base = splitmix64(seed ^ splitmix64(stream));
  // Each pair of outputs depends only on its index: parallel and still the same numbers.
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; i += 2) {
    double u1 = uniform01(splitmix64(base + 2 * static_cast<uint64_t>(i)));
    double u2 = uniform01(splitmix64(base + 2 * static_cast<uint64_t>(i) + 1));
    double r = std::sqrt(-2.0 * std::log(u1)), t = 2.0 * M_PI * u2;
    out[i] = static_cast<float>(stddev * r * std::cos(t));
    if (i + 1 < n) out[i + 1] = static_cast<float>(stddev * r * std::sin(t));
  }
}

std::string human_count(double n) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2);
  if (n >= 1e9) os << n / 1e9 << "B";
  else if (n >= 1e6) os << n / 1e6 << "M";
  else if (n >= 1e3) os << n / 1e3 << "K";
  else os << n;
  return os.str();
}

}  // namespace

Session::Session(Config cfg, SessionOptions opts) : cfg_(std::move(cfg)) {
  set_log_level(cfg_.run.log_level);
  spec_ = cfg_.model.spec;
  const std::string& init = cfg_.model.init;
  if (init.rfind("hf:", 0) == 0) {
    // The HF folder's config.json defines the architecture.
    ModelSpec hf = hf::read_hf_llama_config(init.substr(3));
    hf.max_seq_len = std::max(hf.max_seq_len, cfg_.train.seq_len);
    spec_ = hf;
  }
  // Rank, world and node-local rank: from MPI when started by mpirun / srun,
  // otherwise this is the only rank and MPI is never touched.
  LaunchInfo launch = opts.single_process ? LaunchInfo{} : launch_from_env();
  const bool several = launch.under_launcher && launch.world != 1;
  if (several && !mpi_available())
    throw Error(cat("this process is one of ", launch.world == 0 ? std::string("several") : std::to_string(launch.world),
                    " ranks started by ", launch.launcher, ", but this loom was built without MPI: rebuild with "
                    "MPI (libopenmpi-dev; cmake -DLOOM_WITH_MPI=ON) or start a single process"));
  if (launch.under_launcher && mpi_available()) launch = detect_launch();
  local_rank_ = launch.local_rank;
  local_world_ = launch.local_world;
  launcher_ = launch.launcher;
  if (launch.world == 1 && cfg_.sharding.plugin != "none" && !launch.under_launcher)
    throw Error(cat("sharding.plugin = \"", cfg_.sharding.plugin, "\" splits the work across ranks, but this "
                    "process was started alone: launch it with `mpirun -np N loom ...` (or `srun --mpi=pmix ...` "
                    "under Slurm), or set sharding.plugin = \"none\" for one process"));
  // Quiet the other ranks: rank 0 speaks for the run, the rest report warnings and errors.
  if (launch.rank != 0 && cfg_.run.log_level == "info") set_log_level("warn");
  if (cfg_.model.layers != "native")
    throw Error(cat("model.layers = \"", cfg_.model.layers,
                    "\": this version of loom builds native layers only (separate q/k/v and gate/up GEMMs); "
                    "set model.layers = \"native\""));
  if (cfg_.train.seq_len > spec_.max_seq_len)
    throw Error(cat("train.seq_len = ", cfg_.train.seq_len, " exceeds the model's max_seq_len = ", spec_.max_seq_len));
  if (cfg_.run.device == "cuda") {
#ifdef LOOM_HAVE_CUDA
    if (!cuda_available())
      throw Error("run.device = \"cuda\" but no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)");
#endif
    backend_ = make_cuda_backend(cuda_device_for_rank(launch.local_rank, launch.local_world));
  } else {
    backend_ = make_cpu_backend(cfg_.run.threads);
  }
  if (launch.under_launcher && mpi_available()) {
    // MPI carries host tensors; on CUDA, NCCL carries the device tensors and
    // MPI stays for scalars, barriers and the NCCL unique id.
    if (cfg_.run.device == "cuda") {
      host_owned_ = make_mpi_communicator(cfg_.run.collective_timeout);
      host_ = host_owned_.get();
#ifdef LOOM_HAVE_NCCL
      comm_ = make_nccl_communicator(backend_->device_index(), cfg_.run.collective_timeout);
#else
      throw Error("run.device = \"cuda\" with several ranks needs NCCL, and this loom was built without it: "
                  "install NCCL (libnccl-dev) and rebuild");
#endif
    } else {
      comm_ = make_mpi_communicator(cfg_.run.collective_timeout);
      host_ = comm_.get();
    }
  } else {
    comm_ = make_self_communicator();
    host_ = comm_.get();
  }
  create_plugins();
  plan_memory();
}

Session::~Session() = default;

void Session::create_plugins() {
  std::vector<fs::path> dirs(cfg_.run.plugin_path.begin(), cfg_.run.plugin_path.end());
  registry_ = std::make_unique<PluginRegistry>(dirs);
  auto init_for = [&](const PluginSection& s) {
    PluginInit init;
    init.config = s.table;
    init.device = backend_->device();
    init.rank = comm_->rank();
    init.world = comm_->size();
    init.local_rank = local_rank_;
    init.local_world = local_world_;
    init.seed = cfg_.run.seed;
    init.deterministic = cfg_.run.deterministic;
    return init;
  };
  precision_ = registry_->create_as<PluginKind::precision>(cfg_.precision.plugin, init_for(cfg_.precision),
                                                           cfg_.precision.path);
  attention_ = registry_->create_as<PluginKind::attention>(cfg_.attention.plugin, init_for(cfg_.attention),
                                                           cfg_.attention.path);
  sharding_ = registry_->create_as<PluginKind::sharding>(cfg_.sharding.plugin, init_for(cfg_.sharding),
                                                         cfg_.sharding.path);
  data_ = registry_->create_as<PluginKind::data>(cfg_.data.plugin, init_for(cfg_.data), cfg_.data.path);

  dtypes_ = precision_->dtypes();
  // Refuse shapes the attention kernel cannot do before anything is allocated.
  LlamaModel probe(spec_, cfg_.train.micro_batch, cfg_.train.seq_len, parse_recompute(cfg_.model.recompute),
                   dtypes_.activation, *precision_, *attention_, *backend_);
  Support sup = attention_->supports(probe.attention_shape(), dtypes_.activation, backend_->device());
  if (!sup.ok)
    throw Error(cat("attention.plugin = \"", cfg_.attention.plugin, "\" cannot run this model: ", sup.reason));

  DataSpec ds;
  ds.batch = cfg_.train.micro_batch;
  ds.seq_len = cfg_.train.seq_len;
  ds.vocab_size = spec_.vocab_size;
  ds.rank = comm_->rank();
  ds.world = comm_->size();
  ds.seed = cfg_.run.seed;
  data_->open(ds);
  if (int64_t hint = data_->vocab_hint(); hint > spec_.vocab_size)
    throw Error(cat("data.plugin = \"", cfg_.data.plugin, "\" produces token ids up to ", hint - 1,
                    " but model.vocab_size = ", spec_.vocab_size, ": raise model.vocab_size to at least ", hint));
  if (cfg_.train.validation_every > 0 && !data_->has_split(Split::validation))
    throw Error(cat("train.validation_every = ", cfg_.train.validation_every, " but data.plugin = \"",
                    cfg_.data.plugin, "\" has no validation split: configure one or set train.validation_every = 0"));
}

void Session::plan_memory() {
  unit_infos_ = model_units(spec_);
  ops_ = std::make_unique<BackendOptimizerOps>(*backend_, dtypes_.stochastic_rounding, cfg_.run.seed);
  env_.ctx = backend_->ctx();
  env_.ctx.deterministic = cfg_.run.deterministic;
  env_.world = comm_.get();
  env_.ops = ops_.get();
  env_.host = host_;
  env_.local_world = local_world_;
  env_.param_dtype = dtypes_.param;
  env_.grad_dtype = dtypes_.grad;
  env_.grad_accum = cfg_.train.grad_accum;
  layouts_ = sharding_->plan(env_, unit_infos_);
  LOOM_CHECK(layouts_.size() == unit_infos_.size(), "sharding plugin returned ", layouts_.size(), " layouts for ",
             unit_infos_.size(), " units");

  const size_t pb = dtype_size(dtypes_.param), gb = dtype_size(dtypes_.grad), ob = dtype_size(dtypes_.optim_state);
  unit_blocks_.clear();
  for (size_t i = 0; i < unit_infos_.size(); ++i) {
    const UnitLayout& l = layouts_[i];
    const std::string& n = unit_infos_[i].name;
    LOOM_CHECK(l.padded_numel >= unit_infos_[i].numel && l.optim_numel >= 0 && l.optim_begin >= 0 &&
                   l.optim_begin + l.optim_numel <= l.padded_numel && l.replicas >= 1 && l.replica >= 0 &&
                   l.replica < l.replicas && l.param_numel == (l.params_sharded ? l.optim_numel : l.padded_numel),
               "sharding.plugin = \"", cfg_.sharding.plugin, "\" planned an inconsistent layout for unit ", n);
    UnitBlocks b{};
    b.params = plan_.add("params." + n, MemCategory::params, static_cast<size_t>(l.param_numel) * pb);
    b.grads = plan_.add("grads." + n, MemCategory::grads, static_cast<size_t>(l.grad_numel) * gb);
    b.grad_shard = plan_.add("grad_shard." + n, MemCategory::grads, static_cast<size_t>(l.grad_shard_numel) * 4);
    b.has_master = dtypes_.has_master;
    if (b.has_master)
      b.master = plan_.add("master." + n, MemCategory::master, static_cast<size_t>(l.optim_numel) * 4);
    b.m = plan_.add("adam_m." + n, MemCategory::optimizer, static_cast<size_t>(l.optim_numel) * ob);
    b.v = plan_.add("adam_v." + n, MemCategory::optimizer, static_cast<size_t>(l.optim_numel) * ob);
    unit_blocks_.push_back(b);
  }
  scratch_req_ = sharding_->scratch(env_);
  scratch_blocks_.clear();
  for (const ShardingBuffer& r : scratch_req_)
    scratch_blocks_.push_back(
        plan_.add("sharding." + r.name, r.category, static_cast<size_t>(r.numel) * dtype_size(r.dtype)));
  model_ = std::make_unique<LlamaModel>(spec_, cfg_.train.micro_batch, cfg_.train.seq_len,
                                        parse_recompute(cfg_.model.recompute), dtypes_.activation, *precision_,
                                        *attention_, *backend_);
  model_->plan(plan_);
  precision_ws_bytes_ = precision_->workspace_bytes();
  precision_ws_ = plan_.add("precision.workspace", MemCategory::workspace, precision_ws_bytes_);
}

std::string Session::describe() const {
  std::ostringstream os;
  const double N = static_cast<double>(spec_.total_params());
  os << "model: " << human_count(N) << " parameters (" << spec_.total_params() << "): hidden " << spec_.hidden
     << ", layers " << spec_.num_layers << ", heads " << spec_.num_heads << "/" << spec_.num_kv_heads << " kv"
     << ", ffn " << spec_.ffn_hidden << ", vocab " << spec_.vocab_size
     << (spec_.tied_embeddings ? ", tied embeddings" : "") << "\n";
  os << "flops per token: " << human_count(spec_.flops_per_token(cfg_.train.seq_len)) << " (6N + 12LhS, N = "
     << human_count(static_cast<double>(spec_.matmul_params())) << " matmul weights)\n";
  os << "plugins: precision " << cfg_.precision.plugin << ", attention " << cfg_.attention.plugin << ", sharding "
     << cfg_.sharding.plugin << ", data " << cfg_.data.plugin << "; device " << cfg_.run.device << ", ranks "
     << comm_->size() << "\n";
  os << "batch: " << cfg_.train.micro_batch << " x " << cfg_.train.seq_len << " tokens per micro-step, grad_accum "
     << cfg_.train.grad_accum << " -> "
     << cfg_.train.micro_batch * cfg_.train.seq_len * cfg_.train.grad_accum * comm_->size() << " tokens per step\n";
  if (comm_->size() > 1 || cfg_.sharding.plugin != "none") {
    const MemoryFormula f = memory_formula();
    auto mib = [](double b) {
      std::ostringstream m;
      m << std::fixed << std::setprecision(2) << b / (1024.0 * 1024.0) << " MiB";
      return m.str();
    };
    os << "ranks: " << comm_->size() << (launcher_.empty() ? "" : " (" + launcher_ + ")") << ", this is rank "
       << comm_->rank() << "; ZeRO formulas per rank for " << cfg_.sharding.plugin << ": params "
       << mib(f.params) << ", grads " << mib(f.grads) << ", optimizer state " << mib(f.optimizer)
       << " (the plan below adds padding and the strategy's comm buffers)\n";
  }
  os << "memory plan per rank (" << dtype_name(dtypes_.param) << " params, " << dtype_name(dtypes_.grad) << " grads, "
     << dtype_name(dtypes_.optim_state) << " optimizer state, " << dtype_name(dtypes_.activation)
     << " activations, recompute " << cfg_.model.recompute << "):\n"
     << plan_.summary();
  return os.str();
}

std::string Session::memory_report() const {
  std::ostringstream os;
  auto mib = [](double b) { return b / (1024.0 * 1024.0); };
  os << std::fixed << std::setprecision(1) << "memory on rank " << comm_->rank() << ": planned "
     << mib(static_cast<double>(plan_.total_bytes())) << " MiB (params "
     << mib(static_cast<double>(plan_.category_bytes(MemCategory::params))) << ", grads "
     << mib(static_cast<double>(plan_.category_bytes(MemCategory::grads))) << ", optimizer "
     << mib(static_cast<double>(plan_.category_bytes(MemCategory::optimizer) +
                                plan_.category_bytes(MemCategory::master)))
     << ", activations " << mib(static_cast<double>(plan_.category_bytes(MemCategory::activations)))
     << ", comm " << mib(static_cast<double>(plan_.category_bytes(MemCategory::comm))) << "), arena allocated "
     << mib(static_cast<double>(arena_.bytes())) << " MiB";
  if (backend_->device() == Device::cuda) {
    os << ", device in use " << mib(static_cast<double>(backend_->device_memory_used())) << " MiB";
  } else {
    std::ifstream st("/proc/self/status");
    for (std::string line; std::getline(st, line);)
      if (line.rfind("VmRSS:", 0) == 0) os << ", process RSS " << line.substr(6);
  }
  return os.str();
}

void Session::fault_point() {
  static const char* spec = std::getenv("LOOM_FAULT_STALL");
  if (!spec) return;
  int rank = -1;
  long long step = -1;
  char mode[8] = {};
  const int n = std::sscanf(spec, "%d:%lld:%7s", &rank, &step, mode);
  if (n < 2) return;
  if (rank != comm_->rank() || step != step_ + 1) return;
  if (n == 3 && std::string(mode) == "kill") {
    log_warn(cat("LOOM_FAULT_STALL: rank ", rank, " dies before step ", step));
    std::fflush(nullptr);
    std::raise(SIGKILL);
  }
  log_warn(cat("LOOM_FAULT_STALL: rank ", rank, " stops responding before step ", step));
  for (;;) ::pause();
}

void Session::initialise() {
  LOOM_CHECK(!initialised_, "session initialised twice");
  arena_.allocate(plan_, backend_->device());
  model_->bind(arena_);
  precision_->set_workspace(arena_.ptr(precision_ws_), precision_ws_bytes_);
  units_.clear();
  for (size_t i = 0; i < unit_infos_.size(); ++i) {
    const UnitLayout& l = layouts_[i];
    const UnitBlocks& b = unit_blocks_[i];
    UnitState u;
    u.index = static_cast<int>(i);
    u.info = &unit_infos_[i];
    u.layout = l;
    Tensor p = arena_.tensor(b.params, dtypes_.param, {l.param_numel});
    (l.params_sharded ? u.param_shard : u.params) = p;
    if (l.grad_numel > 0) u.grads = arena_.tensor(b.grads, dtypes_.grad, {l.grad_numel});
    if (l.grad_shard_numel > 0) u.grad_shard = arena_.tensor(b.grad_shard, DType::f32, {l.grad_shard_numel});
    if (b.has_master) u.master = arena_.tensor(b.master, DType::f32, {l.optim_numel});
    u.adam_m = arena_.tensor(b.m, dtypes_.optim_state, {l.optim_numel});
    u.adam_v = arena_.tensor(b.v, dtypes_.optim_state, {l.optim_numel});
    // Padding and optimizer state start at zero (AdamW's m and v, and the
    // padded tail every gather and reduce carries).
    for (Tensor* t : {&p, &u.grads, &u.grad_shard, &u.master, &u.adam_m, &u.adam_v})
      if (t->data) backend_->zero(*t);
    units_.push_back(u);
    own_grads_.push_back(u.grads);
  }
  scratch_.clear();
  for (size_t i = 0; i < scratch_req_.size(); ++i) {
    scratch_.push_back(arena_.tensor(scratch_blocks_[i], scratch_req_[i].dtype, {scratch_req_[i].numel}));
    backend_->zero(scratch_.back());
  }
  const size_t n = static_cast<size_t>(cfg_.train.micro_batch * cfg_.train.seq_len);
  host_tokens_.assign(static_cast<size_t>(cfg_.train.micro_batch * (cfg_.train.seq_len + 1)), 0);
  host_inputs_.assign(n, 0);
  host_targets_.assign(n, 0);

  const bool resumed = try_resume();
  if (!resumed) {
    const std::string& init = cfg_.model.init;
    if (init.rfind("hf:", 0) == 0) init_from_hf(init.substr(3));
    else init_random();
  }
  sharding_->setup(env_, units_, scratch_);
  initialised_ = true;
}

const ParamInfo& Session::find_param(const std::string& hf_name, int* unit) const {
  for (size_t u = 0; u < unit_infos_.size(); ++u)
    for (const ParamInfo& p : unit_infos_[u].params)
      if (p.name == hf_name) {
        *unit = static_cast<int>(u);
        return p;
      }
  throw Error(cat("no parameter named '", hf_name, "' in this model"));
}

std::vector<float> Session::read_tensor(const Tensor& t) const { return download_f32(*backend_, t); }

std::vector<float> Session::read_param(const std::string& hf_name, bool grad) const {
  int u = 0;
  const ParamInfo& p = find_param(hf_name, &u);
  const UnitState& unit = units_[static_cast<size_t>(u)];
  LOOM_CHECK(!unit.layout.params_sharded && (!grad || unit.layout.grad_numel > 0), "read_param('", hf_name,
             "'): sharding.plugin = \"", cfg_.sharding.plugin, "\" keeps only a shard of it on this rank");
  const Tensor& flat = grad ? unit.grads : unit.params;
  return download_f32(*backend_, view(flat, p.offset, {p.numel}));
}

void Session::write_param(const std::string& hf_name, const float* src) {
  int u = 0;
  const ParamInfo& p = find_param(hf_name, &u);
  UnitState& unit = units_[static_cast<size_t>(u)];
  // The owned range [optim_begin, optim_begin + optim_numel): what the master
  // copy holds in fp32, and what a sharded params buffer holds.
  const int64_t lo = std::max(p.offset, unit.layout.optim_begin);
  const int64_t hi = std::min(p.offset + p.numel, unit.layout.optim_begin + unit.layout.optim_numel);
  if (unit.layout.params_sharded) {
    if (lo < hi) {
      Tensor dst = view(unit.param_shard, lo - unit.layout.optim_begin, {hi - lo});
      upload_f32(*backend_, dst, src + (lo - p.offset));
    }
  } else {
    Tensor dst = view(unit.params, p.offset, {p.numel});
    upload_f32(*backend_, dst, src);
  }
  if (unit.master.data && lo < hi) {
    Tensor m = view(unit.master, lo - unit.layout.optim_begin, {hi - lo});
    upload_f32(*backend_, m, src + (lo - p.offset));
  }
}

void Session::init_random() {
  // Matrices ~ N(0, init_std); the residual-branch outputs (o_proj, down_proj)
  // scaled by 1/sqrt(2L) as in GPT-2 so the residual stream's variance does
  // not grow with depth; norm gains = 1.
  const double std0 = cfg_.model.init_std;
  const double std_res = std0 / std::sqrt(2.0 * static_cast<double>(spec_.num_layers));
  uint64_t stream = 0;
  for (const UnitInfo& u : unit_infos_)
    for (const ParamInfo& p : u.params) {
      std::vector<float> buf(static_cast<size_t>(p.numel));
      ++stream;
      if (p.shape.size() == 1) std::fill(buf.begin(), buf.end(), 1.0f);
      else {
        const bool residual = p.name.find("o_proj") != std::string::npos || p.name.find("down_proj") != std::string::npos;
        fill_normal(buf.data(), p.numel, cfg_.run.seed, stream, residual ? std_res : std0);
      }
      write_param(p.name, buf.data());
    }
}

void Session::init_from_hf(const std::string& dir) {
  std::vector<std::pair<std::string, std::vector<float>>> loaded;
  hf::load_hf_llama_weights(dir, spec_, [&](const std::string& name, int64_t numel) -> float* {
    loaded.emplace_back(name, std::vector<float>(static_cast<size_t>(numel)));
    return loaded.back().second.data();
  });
  for (auto& [name, data] : loaded) write_param(name, data.data());
  log_info(cat("initialised ", loaded.size(), " tensors from HF checkpoint ", dir));
}

void Session::load_batch(const int32_t* inputs, const int32_t* targets) {
  const size_t bytes = static_cast<size_t>(model_->tokens_per_micro()) * 4;
  backend_->upload(model_->inputs(), inputs, bytes);
  backend_->upload(model_->targets(), targets, bytes);
}

void Session::next_batch(Split split) {
  const int64_t B = cfg_.train.micro_batch, S = cfg_.train.seq_len;
  data_->next(split, host_tokens_.data());
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* row = host_tokens_.data() + b * (S + 1);
    std::copy(row, row + S, host_inputs_.data() + b * S);
    std::copy(row + 1, row + S + 1, host_targets_.data() + b * S);
  }
  for (int32_t t : host_tokens_)
    if (t < 0 || t >= spec_.vocab_size)
      throw Error(cat("data.plugin = \"", cfg_.data.plugin, "\" produced token id ", t, " outside [0, ",
                      spec_.vocab_size, ") (model.vocab_size)"));
  load_batch(host_inputs_.data(), host_targets_.data());
}

void Session::forward_unit(int unit, bool training, float dloss_scale) {
  UnitState& u = units_[static_cast<size_t>(unit)];
  sharding_->before_forward(env_, u);
  model_->forward_unit(unit, units_, training, dloss_scale);
  sharding_->after_forward(env_, u);
}

void Session::backward_unit(int unit) {
  UnitState& u = units_[static_cast<size_t>(unit)];
  sharding_->before_backward(env_, u);
  model_->backward_unit(unit, units_);
  sharding_->after_backward(env_, u, last_micro_);
}

double Session::batch_loss() {
  return backend_->sum(model_->losses()) / static_cast<double>(model_->tokens_per_micro());
}

double Session::forward(bool training, float dloss_scale) {
  for (int u = 0; u < model_->num_units(); ++u) forward_unit(u, training, dloss_scale);
  return batch_loss();
}

void Session::backward() {
  for (int u = model_->num_units() - 1; u >= 0; --u) backward_unit(u);
}

void Session::zero_grads() {
  for (Tensor& g : own_grads_)
    if (g.data) backend_->zero(g);
}

double Session::mean_over_ranks(double v) { return all_reduce_scalar(*host_, v, ReduceOp::avg); }

Session::MemoryFormula Session::memory_formula() const {
  // ZeRO (Rajbhandari et al. 2020), per rank, with p the shard group: params
  // P*Psi/p at stage 3, grads G*Psi/p from stage 2, optimizer state K*Psi/p
  // from stage 1, where P and G are the param and grad bytes per element and K
  // the master + m + v bytes. Sharded gradients are kept as fp32 shards
  // (reduce_dtype), so G = 4 there, and stage 1 keeps whole gradients plus
  // that shard. The stage and p are read off the layout the strategy planned
  // for its largest unit (a plugin of any name), not off the plugin's name.
  const double psi = static_cast<double>(spec_.total_params());
  const double P = static_cast<double>(dtype_size(dtypes_.param));
  const double G = static_cast<double>(dtype_size(dtypes_.grad));
  const double K = (dtypes_.has_master ? 4.0 : 0.0) + 2.0 * static_cast<double>(dtype_size(dtypes_.optim_state));
  MemoryFormula f;
  if (layouts_.empty()) return f;
  // A unit another one reads (a tied embedding) may be kept whole on purpose: skip it.
  const UnitLayout* big = nullptr;
  for (size_t i = 0; i < layouts_.size(); ++i) {
    const bool read_by_another = std::any_of(unit_infos_.begin(), unit_infos_.end(), [&](const UnitInfo& u) {
      return u.uses_params_of == static_cast<int>(i);
    });
    if (!read_by_another && (!big || layouts_[i].padded_numel > big->padded_numel)) big = &layouts_[i];
  }
  if (!big) big = &layouts_[0];
  const double p = big->optim_numel > 0 ? static_cast<double>(big->padded_numel) / static_cast<double>(big->optim_numel) : 1.0;
  const bool z1 = big->optim_numel < big->padded_numel;
  const bool z2 = z1 && big->grad_numel == 0;
  const bool z3 = big->params_sharded;
  f.params = P * psi / (z3 ? p : 1.0);
  f.grads = z2 ? 4.0 * psi / p : G * psi + (z1 ? 4.0 * psi / p : 0.0);
  f.optimizer = K * psi / (z1 ? p : 1.0);
  return f;
}

StepResult Session::optimizer_step(int64_t step_index) {
  AdamWHyper h;
  const auto& t = cfg_.train;
  h.lr = static_cast<float>(lr_at(step_index, t.steps, t.warmup_steps, t.lr, t.min_lr, t.schedule));
  h.beta1 = static_cast<float>(t.beta1);
  h.beta2 = static_cast<float>(t.beta2);
  h.eps = static_cast<float>(t.eps);
  h.weight_decay = static_cast<float>(t.weight_decay);
  h.step = step_index + 1;
  StepResult r = sharding_->step(env_, units_, h, 1.0f, static_cast<float>(t.grad_clip));
  if (!r.skipped) precision_->end_step(backend_->ctx());
  return r;
}

Tensor Session::logits() const {
  LOOM_CHECK(initialised_, "logits() before initialise()");
  return model_->logits();
}

}  // namespace loom
