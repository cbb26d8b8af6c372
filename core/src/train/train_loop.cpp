// The step loop (DESIGN.md "One training step"), evaluation, and checkpoints
// of a single-process session.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <cstring>
#include <iomanip>
#include <map>
#include <memory>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"
#include "train/session.hpp"

namespace fs = std::filesystem;

namespace loom {
namespace {

std::string model_json(const ModelSpec& s) {
  nlohmann::json j = {{"hidden", s.hidden},         {"num_layers", s.num_layers},   {"num_heads", s.num_heads},
                      {"num_kv_heads", s.num_kv_heads}, {"ffn_hidden", s.ffn_hidden}, {"vocab_size", s.vocab_size},
                      {"rope_theta", s.rope_theta}, {"norm_eps", s.norm_eps}, {"tied_embeddings", s.tied_embeddings}};
  return j.dump();
}

std::string hex(const std::string& bytes) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) { out += d[c >> 4]; out += d[c & 15]; }
  return out;
}
std::string unhex(const std::string& h) {
  LOOM_CHECK(h.size() % 2 == 0, "odd-length hex string in checkpoint metadata");
  auto v = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw Error("non-hex character in checkpoint metadata");
  };
  std::string out;
  for (size_t i = 0; i < h.size(); i += 2) out += static_cast<char>(v(h[i]) * 16 + v(h[i + 1]));
  return out;
}

std::string duration(double s) {
  std::ostringstream os;
  const int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) os << t / 3600 << "h" << std::setw(2) << std::setfill('0') << (t / 60) % 60 << "m";
  else if (t >= 60) os << t / 60 << "m" << std::setw(2) << std::setfill('0') << t % 60 << "s";
  else os << t << "s";
  return os.str();
}

// A one-line progress bar on stdout when it is a terminal; log lines (stderr)
// clear it first so the two never interleave on one line.
class ProgressBar {
 public:
  explicit ProgressBar(int64_t total) : total_(total), tty_(total > 0 && isatty(STDOUT_FILENO) == 1) {}
  void clear() {
    if (tty_) { std::fputs("\r\033[2K", stdout); std::fflush(stdout); }
  }
  void draw(int64_t step, double loss, double eta_s) {
    if (!tty_) return;
    const int width = 30;
    const int filled = static_cast<int>(width * static_cast<double>(step) / static_cast<double>(total_));
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(width, '.');
    std::printf("\r[%s] %lld/%lld  loss %.4f  eta %s", bar.c_str(), static_cast<long long>(step),
                static_cast<long long>(total_), loss, duration(eta_s).c_str());
    std::fflush(stdout);
  }
  void finish() {
    if (tty_) { std::fputs("\n", stdout); std::fflush(stdout); }
  }

 private:
  int64_t total_;
  bool tty_;
};

fs::path checkpoint_root(const Config& cfg) {
  return cfg.checkpoint.dir.empty() ? fs::path(cfg.run.out_dir) / "checkpoints" : fs::path(cfg.checkpoint.dir);
}

}  // namespace

double Session::evaluate() {
  data_->reset(Split::validation);
  double total = 0;
  const int64_t n = cfg_.train.validation_batches;
  for (int64_t i = 0; i < n; ++i) {
    next_batch(Split::validation);
    total += forward(false, 0.f);
  }
  return mean_over_ranks(total / static_cast<double>(n));
}

namespace {

// The part of a unit this rank writes to a checkpoint: its owned range (what
// its optimizer state covers), split between the ranks that own the same range
// (ddp: every rank; hybrid_shard: one per group), so that every element is
// written exactly once and the save is spread over all ranks.
std::pair<int64_t, int64_t> checkpoint_piece(const UnitState& u) {
  const UnitLayout& l = u.layout;
  const int64_t lo = std::min(l.optim_begin, u.info->numel);
  const int64_t hi = std::min(l.optim_begin + l.optim_numel, u.info->numel);
  const int64_t n = hi - lo, r = l.replicas, k = l.replica;
  return {lo + n * k / r, lo + n * (k + 1) / r};
}

// Flat range [lo, hi) of a unit's params as this rank holds them.
Tensor params_range(const UnitState& u, int64_t lo, int64_t hi) {
  if (u.layout.params_sharded) return view(u.param_shard, lo - u.layout.optim_begin, {hi - lo});
  return view(u.params, lo, {hi - lo});
}

}  // namespace

void Session::save_checkpoint(int64_t step) {
  const fs::path root = checkpoint_root(cfg_);
  if (comm_->rank() == 0) fs::create_directories(root);
  backend_->synchronize();
  comm_->synchronize();  // collectives still writing params (zero1/zero2's gathers) have finished
  std::vector<int64_t> pieces(units_.size() * 2);
  {
    ckpt::CheckpointWriter w(root.string(), step, comm_->rank());
    // Device tensors go through host copies that live until the shard is written.
    std::vector<std::vector<std::byte>> staging;
    auto add = [&](const std::string& name, const Tensor& t) {
      if (t.device == Device::cpu) return w.add(name, t);
      staging.emplace_back(t.bytes());
      backend_->download(staging.back().data(), t, t.bytes());
      Tensor host = t;
      host.data = staging.back().data();
      host.device = Device::cpu;
      w.add(name, host);
    };
    for (size_t i = 0; i < units_.size(); ++i) {
      const UnitState& u = units_[i];
      const auto [lo, hi] = checkpoint_piece(u);
      pieces[2 * i] = lo;
      pieces[2 * i + 1] = hi;
      if (lo >= hi) continue;
      const std::string& n = u.info->name;
      const int64_t o = lo - u.layout.optim_begin;  // offset in the owned-range buffers
      add("params." + n, params_range(u, lo, hi));
      if (u.master.data) add("master." + n, view(u.master, o, {hi - lo}));
      add("adam_m." + n, view(u.adam_m, o, {hi - lo}));
      add("adam_v." + n, view(u.adam_v, o, {hi - lo}));
    }
    w.write_shard();
  }
  // Every rank's piece of every unit, for the metadata (and for resharding on load).
  std::vector<int64_t> all(pieces.size() * static_cast<size_t>(host_->size()));
  {
    // all_gather moves raw bytes: the 8-byte integers travel as f64-sized elements, unconverted.
    Tensor in(pieces.data(), DType::f64, Device::cpu, {static_cast<int64_t>(pieces.size())});
    Tensor out(all.data(), DType::f64, Device::cpu, {static_cast<int64_t>(all.size())});
    host_->all_gather(ExecContext{}, in, out);
  }
  host_->barrier();  // every rank's shard is on disk before the marker
  if (comm_->rank() == 0) {
    nlohmann::json units = nlohmann::json::array();
    for (size_t i = 0; i < units_.size(); ++i) {
      nlohmann::json params = nlohmann::json::array();
      for (const ParamInfo& p : unit_infos_[i].params)
        params.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}});
      nlohmann::json ranges = nlohmann::json::array();
      for (int r = 0; r < host_->size(); ++r) {
        const size_t k = static_cast<size_t>(r) * pieces.size() + 2 * i;
        if (all[k] < all[k + 1]) ranges.push_back({r, all[k], all[k + 1]});
      }
      units.push_back({{"name", unit_infos_[i].name}, {"numel", unit_infos_[i].numel}, {"params", params},
                       {"shards", ranges}});
    }
    nlohmann::json meta = {
        {"format", "loom-checkpoint"},
        {"version", 2},
        {"step", step},
        {"world_size", comm_->size()},
        {"strategy", cfg_.sharding.plugin},
        {"precision", cfg_.precision.plugin},
        {"dtypes", {{"params", std::string(dtype_name(dtypes_.param))},
                    {"optim_state", std::string(dtype_name(dtypes_.optim_state))},
                    {"master", dtypes_.has_master}}},
        {"model", nlohmann::json::parse(model_json(spec_))},
        {"units", units},
        {"data_plugin", cfg_.data.plugin},
        {"data_state", data_->state()},
        {"samples_seen", step * cfg_.train.micro_batch * cfg_.train.grad_accum * comm_->size()},
        {"precision_state", hex(precision_->save_state())},
        {"seed", cfg_.run.seed},
        {"config", cfg_.effective_toml},
    };
    ckpt::CheckpointWriter::write_meta(root.string(), step, meta.dump(2));
    ckpt::CheckpointWriter::mark_complete(root.string(), step);
    ckpt::prune(root.string(), static_cast<int>(cfg_.checkpoint.keep_last));
  }
  host_->barrier();
  log_info(cat("checkpoint: step ", step, " written to ", (root / "").string(), " (", comm_->size(), " rank",
               comm_->size() == 1 ? "" : "s", ", ", cfg_.sharding.plugin, ")"));
}

void Session::load_checkpoint_tensors(const std::string& dir, const std::string& meta_text) {
  const nlohmann::json meta = nlohmann::json::parse(meta_text);
  const nlohmann::json& units = meta.at("units");
  if (!units.is_array() || units.size() != units_.size())
    throw Error(cat("checkpoint ", dir, "/meta.json lists ", units.is_array() ? units.size() : 0,
                    " units, this model has ", units_.size(), ": the checkpoint is damaged or from another model"));
  // Readers of the saving ranks' shard files, opened when first needed.
  std::map<int, std::unique_ptr<ckpt::CheckpointReader>> readers;
  auto reader = [&](int r) -> const ckpt::CheckpointReader& {
    auto& slot = readers[r];
    if (!slot) slot = std::make_unique<ckpt::CheckpointReader>(dir, r);
    return *slot;
  };
  std::vector<std::byte> piece, staging;
  // Fills dst with flat range [a, b) of `kind.<unit>`, from every saved piece that overlaps it.
  auto fill = [&](const std::string& kind, size_t ui, int64_t a, int64_t b, Tensor dst) {
    if (a >= b) return;
    const std::string name = kind + "." + unit_infos_[ui].name;
    const size_t es = dtype_size(dst.dtype);
    staging.assign(static_cast<size_t>(b - a) * es, std::byte{0});
    int64_t covered = 0;
    for (const auto& sh : units[ui].at("shards")) {
      const int r = sh.at(0).get<int>();
      const int64_t lo = sh.at(1).get<int64_t>(), hi = sh.at(2).get<int64_t>();
      const int64_t x = std::max(a, lo), y = std::min(b, hi);
      if (x >= y) continue;
      const ckpt::CheckpointReader& rd = reader(r);
      const ckpt::TensorRecord& rec = rd.info(name);
      if (rec.dtype != dst.dtype || rec.bytes != static_cast<uint64_t>(hi - lo) * es)
        throw Error(cat("checkpoint ", rd.file(), ": tensor ", name, " is ", dtype_name(rec.dtype), " ",
                        rec.shape_str(), " but the metadata and this run expect ", dtype_name(dst.dtype), " [",
                        hi - lo, "]: the checkpoint is damaged or was written with another precision"));
      piece.resize(rec.bytes);
      Tensor host(piece.data(), rec.dtype, Device::cpu, {hi - lo});
      rd.read(name, host);
      std::memcpy(staging.data() + static_cast<size_t>(x - a) * es, piece.data() + static_cast<size_t>(x - lo) * es,
                  static_cast<size_t>(y - x) * es);
      covered += y - x;
    }
    if (covered != b - a)
      throw Error(cat("checkpoint ", dir, ": the shards hold ", covered, " of the ", b - a, " elements [", a, ", ", b,
                      ") of ", name, " this rank needs: a shard file is missing or the metadata is damaged"));
    backend_->upload(dst, staging.data(), staging.size());
    backend_->synchronize();  // the staging buffer is reused by the next tensor
  };
  for (size_t i = 0; i < units_.size(); ++i) {
    UnitState& u = units_[i];
    const int64_t N = u.info->numel;
    if (units[i].value("numel", int64_t{-1}) != N)
      throw Error(cat("checkpoint ", dir, ": unit ", u.info->name, " has ", units[i].value("numel", int64_t{-1}),
                      " parameters there and ", N, " in this model"));
    const int64_t lo = std::min(u.layout.optim_begin, N), hi = std::min(u.layout.optim_begin + u.layout.optim_numel, N);
    if (u.layout.params_sharded) fill("params", i, lo, hi, view(u.param_shard, 0, {hi - lo}));
    else fill("params", i, 0, N, view(u.params, 0, {N}));
    if (u.master.data) fill("master", i, lo, hi, view(u.master, 0, {hi - lo}));
    fill("adam_m", i, lo, hi, view(u.adam_m, 0, {hi - lo}));
    fill("adam_v", i, lo, hi, view(u.adam_v, 0, {hi - lo}));
  }
}

bool Session::try_resume() {
  const std::string& mode = cfg_.checkpoint.resume;
  if (mode == "none") return false;
  const fs::path root = checkpoint_root(cfg_);
  std::optional<ckpt::CheckpointInfo> info;
  if (mode == "auto") {
    if (!fs::exists(root)) return false;
    info = ckpt::latest_complete(root.string());
    if (!info) return false;
  } else {
    info = ckpt::find_step(root.string(), std::stoll(mode));
    // Going back to an older step with checkpointing on would later overwrite
    // the newer checkpoints of this directory: refuse now, before any work.
    if (cfg_.checkpoint.every > 0) {
      std::string newer;
      for (const ckpt::CheckpointInfo& c : ckpt::list_checkpoints(root.string()))
        if (c.step > info->step) newer += (newer.empty() ? "" : ", ") + c.dir;
      if (!newer.empty())
        throw Error(cat("checkpoint.resume = ", mode, ": newer checkpoints would be overwritten as training continues (",
                        newer, "); move them away, set checkpoint.dir to another folder, or set checkpoint.every = 0"));
    }
  }
  std::string meta_text;
  {
    ckpt::CheckpointReader r(info->dir, 0);
    meta_text = r.meta();
  }
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(meta_text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(cat(info->dir, "/meta.json is not valid JSON (", e.what(),
                    "): the checkpoint cannot be used; resume from another one or set checkpoint.resume = \"none\""));
  }
  const auto want = nlohmann::json::parse(model_json(spec_));
  if (meta.value("model", nlohmann::json{}) != want)
    throw Error(cat("checkpoint ", info->dir, " was written for another model: it has ",
                    meta.value("model", nlohmann::json{}).dump(), ", this config builds ", want.dump(),
                    ". Point checkpoint.dir elsewhere or set checkpoint.resume = \"none\""));
  if (meta.value("version", 0) != 2)
    throw Error(cat("checkpoint ", info->dir, " has format version ", meta.value("version", 0),
                    "; this loom reads version 2. Point checkpoint.dir elsewhere or set checkpoint.resume = \"none\""));
  const std::string precision = meta.value("precision", "");
  if (precision != cfg_.precision.plugin)
    throw Error(cat("checkpoint ", info->dir, " was written with precision.plugin = \"", precision,
                    "\", this run uses \"", cfg_.precision.plugin,
                    "\": resume with the same precision recipe (parameter and optimizer-state dtypes differ)"));
  const int world = meta.value("world_size", 0);
  const std::string strategy = meta.value("strategy", "");
  if (world != comm_->size() || strategy != cfg_.sharding.plugin)
    log_info(cat("resharding checkpoint ", info->dir, ": written by ", world, " rank(s) with sharding \"", strategy,
                 "\", loading into ", comm_->size(), " rank(s) with \"", cfg_.sharding.plugin, "\""));
  load_checkpoint_tensors(info->dir, meta_text);
  data_->restore(meta.at("data_state").get<std::string>());
  precision_->load_state(unhex(meta.value("precision_state", "")));
  step_ = meta.at("step").get<int64_t>();
  log_info(cat("resumed from ", info->dir, " at step ", step_));
  return true;
}

StepLog Session::train_step() {
  const auto& t = cfg_.train;
  const int64_t tokens_per_step = t.micro_batch * t.seq_len * t.grad_accum * comm_->size();
  const int64_t samples_per_step = t.micro_batch * t.grad_accum * comm_->size();
  // The gradient of the mean loss over every token of the step, on every rank:
  // strategies then reduce gradients with a plain sum.
  const float dloss_scale = 1.0f / static_cast<float>(model_->tokens_per_micro() * t.grad_accum * comm_->size());
  fault_point();
  backend_->timer_start();
  sharding_->begin_step(env_, units_);
  zero_grads();
  double loss = 0;
  for (int64_t micro = 0; micro < t.grad_accum; ++micro) {
    last_micro_ = micro == t.grad_accum - 1;
    next_batch(Split::train);
    loss += forward(true, dloss_scale);
    backward();
  }
  StepLog s;
  s.lr = lr_at(step_, t.steps, t.warmup_steps, t.lr, t.min_lr, t.schedule);
  StepResult r = optimizer_step(step_);
  const double ms = backend_->timer_stop_ms();
  ++step_;
  s.step = step_;
  s.loss = mean_over_ranks(loss / static_cast<double>(t.grad_accum));
  s.grad_norm = r.grad_norm;
  s.skipped = r.skipped;
  s.step_ms = ms;
  s.tokens_per_s = static_cast<double>(tokens_per_step) / (ms * 1e-3);
  s.samples_per_s = static_cast<double>(samples_per_step) / (ms * 1e-3);
  // MFU (DESIGN.md): flops per token x tokens/s per GPU over 989 TFLOP/s dense bf16.
  if (backend_->device() == Device::cuda) {
    s.mfu = spec_.flops_per_token(t.seq_len) * s.tokens_per_s / static_cast<double>(comm_->size()) / 989e12;
    s.peak_mem_bytes = backend_->device_memory_used();
  }
  return s;
}

RunSummary Session::train(int64_t stop_at) {
  if (!initialised_) initialise();
  const auto& t = cfg_.train;
  RunSummary sum;
  sum.first_step = step_;
  const fs::path out(cfg_.run.out_dir);
  // Rank 0 writes the run's files and draws the progress bar; the metrics are global (losses averaged over ranks).
  const bool lead = comm_->rank() == 0;
  std::ofstream metrics;
  if (lead) {
    fs::create_directories(out);
    std::ofstream c(out / "config.toml");
    c << cfg_.effective_toml;
    metrics.open(out / "metrics.jsonl", step_ > 0 ? std::ios::app : std::ios::trunc);
    if (!metrics) throw Error(cat("cannot write ", (out / "metrics.jsonl").string(), ": check run.out_dir"));
  }

  log_info(cat("loom: training '", cfg_.run.name, "' for ", t.steps, " steps, output in ", out.string()));
  {
    std::istringstream d(describe());
    for (std::string line; std::getline(d, line);) log_info(line);
  }
  if (step_ >= t.steps) {
    log_info(cat("nothing to do: the checkpoint is at step ", step_, " and train.steps = ", t.steps));
    return sum;
  }

  log_info(memory_report());
  ProgressBar bar(lead ? t.steps : 0);
  const auto run_start = std::chrono::steady_clock::now();

  if (t.validation_every > 0 && step_ == 0) {
    const double v = evaluate();
    sum.val_losses.emplace_back(0, v);
    log_info(cat("step 0 | val loss ", std::fixed, std::setprecision(4), v));
    metrics << nlohmann::json{{"step", 0}, {"val_loss", v}}.dump() << "\n";
  }

  const int64_t last = stop_at > 0 ? std::min(stop_at, t.steps) : t.steps;
  int64_t skipped = 0;
  while (step_ < last) {
    StepLog s = train_step();
    if (s.skipped) {
      ++skipped;
      log_warn(cat("step ", step_, ": gradient norm is not finite; update skipped"));
    }
    if (t.validation_every > 0 && (step_ % t.validation_every == 0 || step_ == t.steps)) {
      s.has_val = true;
      s.val_loss = evaluate();
      sum.val_losses.emplace_back(step_, s.val_loss);
    }
    sum.steps.push_back(s);

    nlohmann::json j = {{"step", s.step},         {"loss", s.loss},
                        {"lr", s.lr},             {"grad_norm", s.grad_norm},
                        {"step_ms", s.step_ms},   {"tokens_per_s", s.tokens_per_s},
                        {"samples_per_s", s.samples_per_s}};
    if (s.has_val) j["val_loss"] = s.val_loss;
    if (s.skipped) j["skipped"] = true;
    if (s.mfu > 0) {
      j["mfu"] = s.mfu;
      j["peak_mem_bytes"] = s.peak_mem_bytes;
    }
    metrics << j.dump() << "\n";
    metrics.flush();

    if (step_ % t.log_every == 0 || step_ == t.steps || s.has_val) {
      bar.clear();
      std::ostringstream line;
      line << "step " << step_ << "/" << t.steps << " | loss " << std::fixed << std::setprecision(4) << s.loss
           << " | lr " << std::scientific << std::setprecision(2) << s.lr << " | grad norm " << std::fixed
           << std::setprecision(3) << s.grad_norm << " | " << std::setprecision(1) << s.samples_per_s
           << " samples/s | " << std::setprecision(0) << s.tokens_per_s << " tok/s | " << std::setprecision(1)
           << s.step_ms << " ms";
      if (s.mfu > 0)
        line << " | MFU " << std::setprecision(1) << 100.0 * s.mfu << "% | mem " << std::setprecision(2)
             << static_cast<double>(s.peak_mem_bytes) / (1024.0 * 1024.0 * 1024.0) << " GiB";
      if (s.has_val) line << " | val loss " << std::setprecision(4) << s.val_loss;
      log_info(line.str());
    }
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    const double per_step = elapsed / static_cast<double>(step_ - sum.first_step);
    bar.draw(step_, s.loss, per_step * static_cast<double>(t.steps - step_));

    if (cfg_.checkpoint.every > 0 && (step_ % cfg_.checkpoint.every == 0 || step_ == last)) {
      bar.clear();
      save_checkpoint(step_);
    }
  }
  bar.finish();
  sum.last_step = step_;
  sum.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
  std::ostringstream fin;
  fin << "done: " << (step_ - sum.first_step) << " steps in " << duration(sum.wall_s) << " | final loss "
      << std::fixed << std::setprecision(4) << (sum.steps.empty() ? 0.0 : sum.steps.back().loss);
  if (!sum.val_losses.empty())
    fin << " | val loss " << sum.val_losses.front().second << " -> " << sum.val_losses.back().second;
  if (skipped) fin << " | " << skipped << " skipped steps";
  fin << " | metrics " << (out / "metrics.jsonl").string();
  log_info(fin.str());
  return sum;
}

}  // namespace loom
