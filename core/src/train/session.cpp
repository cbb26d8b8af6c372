#include "train/session.hpp"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "checkpoint/checkpoint.hpp"
#include "hf/hf_llama.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"
#include "train/checkpointing.hpp"
#include "train/fault_injection.hpp"
#include "train/optimizer.hpp"
#include "train/run_health.hpp"
#include "train/stop_signal.hpp"
#include "train/tensorboard.hpp"
#include "train/weights.hpp"

namespace fs = std::filesystem;

namespace loom {
namespace {

Config with_log_level(Config cfg) {
  set_log_level(cfg.run.log_level);
  return cfg;
}

}  // namespace

ModelSpec run_model_spec(const Config& cfg) {
  const std::string& init = cfg.model.init;
  if (init.rfind("hf:", 0) != 0) return cfg.model.spec;
  ModelSpec hf = hf::read_hf_llama_config(init.substr(3));
  hf.max_seq_len = std::max(hf.max_seq_len, cfg.train.seq_len);
  return hf;
}

Session::Session(Config cfg, SessionOptions opts)
    : cfg_(with_log_level(std::move(cfg))), rt_(make_runtime(cfg_, run_model_spec(cfg_), opts.single_process, opts.plan_world, opts.plan_local_world,
                      opts.plan_device)) {
  model_ = std::make_unique<Model>(run_model_spec(cfg_), cfg_.model.layers, cfg_.model.ffn, cfg_.expert_parallel);
  state_ = std::make_unique<TrainState>(cfg_, rt_, *model_);
  ring_ = std::make_unique<StepLogRing>(cfg_, rt_, *state_, *model_, [this] {
    if (stager_) stager_->device_caught_up();
  });
}

Session::~Session() = default;

std::optional<TokenScanReport> Session::scan_data_tokens() const {
  const auto* scan = dynamic_cast<const TokenScan*>(rt_.data.get());
  if (!scan) return std::nullopt;
  return scan->scan_tokens();
}

std::optional<std::string> Session::check_resume_checkpoint() {
  return loom::check_resume_checkpoint(cfg_, spec(), rt_.data.get());
}

void Session::initialise() {
  LOOM_CHECK(!initialised_, "session initialised twice");
  LOOM_CHECK(!rt_.planned_device, "a session planned for a GPU it does not run on (", rt_.planned_device->name,
             ") cannot be initialised: it is a plan only");
  // A step_N in checkpoint.dir that is no folder would only fail at the save of step N.
  check_checkpoint_names(cfg_);
  state_->check_memory_fits();  // a plan that cannot fit is refused, not OOM-killed
  state_->allocate();
  // Enough pinned slots for every micro-batch between two log steps (plus an
  // evaluation's), so that staging never waits for the device.
  const auto& t = cfg_.train;
  // (The stager caps the ring at 64 MiB; the terms are bounded so that the sum
  // cannot overflow: grad_accum <= kMaxDim, the ring <= kMaxStepLogRows.)
  const int64_t slots =
      t.grad_accum * state_->scalar_log_rows() + std::min<int64_t>(t.validation_batches, int64_t{1} << 30) + 2;
  StagedDocuments docs;
  docs.spans = t.reset_attention_mask || t.reset_position_ids;
  docs.mask_loss = t.eod_mask_loss;
  stager_ = std::make_unique<TokenStager>(*rt_.backend, t.micro_batch, t.seq_len, slots, docs);
  if (std::optional<int64_t> s = resume_checkpoint(cfg_, rt_, *state_, *model_)) {
    step_ = *s;
    resumed_ = true;
  } else if (cfg_.model.init.rfind("hf:", 0) == 0) {
    init_from_hf(*state_, model_->spec(), cfg_.model.init.substr(3));
  } else {
    init_random(*state_, model_->spec(), cfg_.run.seed, cfg_.model.init_std, cfg_.model.embedding_init_std);
  }
  state_->setup_sharding();
  profiler_ = std::make_unique<Profiler>(cfg_.profile, *rt_.backend, rank(), world(), cfg_.run.out_dir, arena_bytes());
  initialised_ = true;
}

// ---------------------------------------------------------------------------
// The step (docs/ARCHITECTURE.md "The step"), queued on the device: forward,
// backward, reduce, clip, update.
// ---------------------------------------------------------------------------

void Session::train_step() {
  const auto& t = cfg_.train;
  Backend& be = *rt_.backend;
  // The gradient of the mean loss over every token of the step, on every rank:
  // strategies then reduce gradients with a plain sum. Under eod_mask_loss
  // the model scales it per micro-batch by N / (its tokens that carry loss):
  // each micro-batch's loss is the mean over those (Model::set_loss_weight).
  const float dloss_scale = 1.0f / static_cast<float>(model_->env().N * t.grad_accum * world());
  fault_point(rank(), step_ + 1);
  ring_->make_room();
  Range step_range(be, "step");  // NVTX and the tracer: the whole step on the compute stream
  // The step's scalars (loss sum, norm, clip decision, timestamps), on the device.
  Tensor& scalars = ring_->open(step_ + 1);
  rt_.sharding->begin_step(state_->env(), units());
  // The first micro-batch's backward writes every parameter gradient
  // (BlockEnv::first_micro), so the gradients need no zeroing between steps;
  // a strategy whose step does not say so (Sharding::zeroes_grads) still gets
  // them zeroed here, as its own bookkeeping may read them before.
  if (!rt_.sharding->zeroes_grads()) state_->zero_grads();
  Tensor loss_sum = view(scalars, kLossSum, {1}), extra_sum = view(scalars, kAuxSum, {1});
  for (int64_t micro = 0; micro < t.grad_accum; ++micro) {
    last_micro_ = micro == t.grad_accum - 1;
    model_->set_first_micro(micro == 0);
    {
      trace::Scope phase(trace::Track::host, "data");
      next_batch(Split::train);   // tokens -> pinned slot -> device, queued
    }
    // The micro-batch's random draws: a pure function of (seed, micro-batch), so a resume draws the same.
    model_->begin_micro_batch(cfg_.run.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(step_ * t.grad_accum + micro));
    {
      trace::Scope phase(trace::Track::host, "forward");
      forward(true, dloss_scale); // every unit, sharding hooks around each
    }
    {
      trace::Scope phase(trace::Track::host, "backward");
      backward();                 // the head computes the loss chunk by chunk, then every unit in reverse
    }
    // The step's loss: the sum of its micro-batches' mean losses, times N
    // (read_ring divides by N x grad_accum). Masked targets have loss 0; the
    // mean is over the tokens that carry loss, so their sum is weighted by
    // N / count first (the losses are not read again before the next forward).
    if (model_->loss_weight() != 1.f) {
      Tensor losses = model_->losses();
      be.scale(losses, model_->loss_weight());
    }
    be.sum_into(loss_sum, model_->losses(), 0, model_->env().N, false);
    model_->add_extra_losses(extra_sum);
  }
  model_->set_first_micro(false);  // a backward outside a step (tests, --breakdown) accumulates
  {
    trace::Scope phase(trace::Track::host, "optimizer");
    queue_optimizer_step(step_);  // reduce -> global norm, clip -> AdamW -> re-gather, on the device
  }
  ring_->close(step_ + 1);  // its end time and scalars into the log ring, where its last work runs
  ++step_;
}

void Session::queue_optimizer_step(int64_t step_index) {
  AdamWHyper h;
  const auto& t = cfg_.train;
  h.lr = static_cast<float>(lr_at(step_index, t.steps, t.warmup_steps, t.lr, t.min_lr, t.schedule));
  h.beta1 = static_cast<float>(t.beta1);
  h.beta2 = static_cast<float>(t.beta2);
  h.eps = static_cast<float>(t.eps);
  h.weight_decay = static_cast<float>(t.weight_decay);
  h.step = step_index + 1;
  rt_.sharding->step(state_->env(), units(), h);
  rt_.precision->end_step(rt_.backend->ctx());
}

size_t Session::memory_in_use() const {
  const Backend& be = *rt_.backend;
  return be.device() == Device::cuda ? be.device_memory_used() : state_->arena_bytes();
}

StagedBatch Session::next_batch(Split split) {
  Tensor tokens = model_->tokens();
  const StagedBatch b = stager_->stage(*rt_.data, split, tokens, model_->spec().vocab_size, cfg_.data.plugin);
  use_batch(b);
  return b;
}

void Session::load_batch(const int32_t* inputs, const int32_t* targets, const uint8_t* starts) {
  Tensor tokens = model_->tokens();
  use_batch(stager_->stage(inputs, targets, tokens, starts));
}

void Session::use_batch(const StagedBatch& b) {
  if (stager_->documents().spans) model_->set_documents(b.spans, b.longest);
  loss_tokens_ = b.loss_tokens;
  // eod_mask_loss: the mean over the tokens that carry loss. When none does,
  // every target is masked (-1): the cross-entropy gives each a zero loss and
  // a zero gradient row at any nonzero scale, so the micro-batch adds nothing.
  const int64_t N = model_->env().N;
  model_->set_loss_weight(b.loss_tokens == N || b.loss_tokens == 0
                              ? 1.f
                              : static_cast<float>(static_cast<double>(N) / static_cast<double>(b.loss_tokens)));
}

// The sharding's hooks run between the units' traced ranges: each gets a
// range of its own (NVTX, and the tracer's compute track in a profiling
// window), so that a trace names what the compute stream does there (a wait
// for a gather, an FP8 decode, a gradient added into its shard) instead of
// showing it as idle time (benchmarks/trace_gaps.py).
void Session::forward_unit(int unit, bool training, float dloss_scale) {
  Backend& be = *rt_.backend;
  UnitState& u = units()[static_cast<size_t>(unit)];
  {
    Range r(be, "sharding.before_forward");
    rt_.sharding->before_forward(state_->env(), u);
  }
  model_->forward_unit(unit, units(), training, dloss_scale);
  Range r(be, "sharding.after_forward");
  rt_.sharding->after_forward(state_->env(), u);
}

void Session::backward_unit(int unit) {
  Backend& be = *rt_.backend;
  UnitState& u = units()[static_cast<size_t>(unit)];
  u.grads_fresh = false;  // a strategy that lends a fresh buffer says so again (a plugin of ABI 10.0 never does)
  {
    Range r(be, "sharding.before_backward");
    rt_.sharding->before_backward(state_->env(), u);
  }
  model_->backward_unit(unit, units());
  Range r(be, "sharding.after_backward");
  rt_.sharding->after_backward(state_->env(), u, last_micro_);
}

void Session::forward(bool training, float dloss_scale) {
  for (int u = 0; u < model_->num_units(); ++u) forward_unit(u, training, dloss_scale);
}

void Session::backward() {
  for (int u = model_->num_units() - 1; u >= 0; --u) backward_unit(u);
}

double Session::evaluate() {
  Backend& be = *rt_.backend;
  trace::Scope phase(trace::Track::host, "validation");
  Range range(be, "validation");
  rt_.data->reset(Split::validation);
  Tensor& sum = state_->eval_sum();
  be.zero(sum);
  const int64_t n = cfg_.train.validation_batches;
  int64_t counted = 0;  // validation tokens that carry loss (all of them without eod_mask_loss)
  for (int64_t i = 0; i < n; ++i) {
    counted += next_batch(Split::validation).loss_tokens;
    forward(false, 0.f);
    be.sum_into(sum, model_->losses(), 0, model_->env().N, false);
  }
  double total = 0;
  be.download(&total, sum, sizeof total);
  stager_->device_caught_up();
  return mean_over_ranks(counted > 0 ? total / static_cast<double>(counted) : 0.0);
}

void Session::save_checkpoint(int64_t step) {
  if (replace_before_save_) {  // run.overwrite: the previous run goes just before this run's first checkpoint
    if (replaced_run_) replaced_run_->remove();
    rt_.host->barrier();  // no rank writes a step folder the previous run still holds
    replace_before_save_ = false;
  }
  loom::save_checkpoint(cfg_, rt_, *state_, *model_, step);
  stager_->device_caught_up();
}

// ---------------------------------------------------------------------------
// The loop: steps, log steps (read back, log, evaluate), checkpoints.
// ---------------------------------------------------------------------------

int Session::agreed_stop_signal() {
  const int local = StopSignals::pending();
  if (rt_.host->size() == 1) return local;
  // A host all-reduce per step (no device wait): every rank stops after the same step.
  return static_cast<int>(all_reduce_scalar(*rt_.host, static_cast<double>(local), ReduceOp::max));
}

void Session::claim_outputs() {
  if (outputs_claimed_) return;  // a later train() call continues in the folder this one prepared
  outputs_claimed_ = true;
  replace_before_save_ = !resumed_ && cfg_.run.overwrite;
  if (rank() == 0) {
    output_lock_ = OutputLock::acquire(cfg_);
    replaced_run_ = prepare_run_files(cfg_, resumed_ ? std::optional<int64_t>(step_) : std::nullopt);
  }
  rt_.host->barrier();  // checkpoint.dir exists before the other ranks look at it
  // Every rank writes its shard there: a full disk or a read-only mount on any
  // node is found now, not at the first save.
  probe_writable("checkpoint.dir", checkpoint_root(cfg_).string(), cat(".loom.write_test.rank_", rank()));
}

RunSummary Session::train(int64_t stop_at) {
  if (!initialised_) initialise();
  // From here a signal stops the run after the current step, with a checkpoint.
  StopSignals signals(cfg_.run.stop_signal);
  const auto& t = cfg_.train;
  RunSummary sum;
  sum.first_step = step_;
  const fs::path out(cfg_.run.out_dir);
  // Rank 0 writes the run's files and draws the progress bar; the metrics are global (losses averaged over ranks).
  const bool lead = rank() == 0;
  MetricsFile metrics;
  claim_outputs();
  std::unique_ptr<TensorBoardWriter> tb;  // [run] tensorboard = true
  if (lead) {
    metrics.open((out / "metrics.jsonl").string(), step_ > 0);
    if (cfg_.run.tensorboard) tb = std::make_unique<TensorBoardWriter>((out / "tensorboard").string(), step_);
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
    metrics.write_validation(0, v);
    if (tb) tb->scalars(0, {{"val/loss", v}});
  }

  const int64_t last = stop_at > 0 ? std::min(stop_at, t.steps) : t.steps;
  RunHealth health(t);
  // Steps read back: checked, written to metrics and TensorBoard, logged.
  auto report = [&](std::vector<StepLog>& logs) {
    if (logs.empty()) return;
    // An update large enough to overflow AdamW's second moment: look at the state (rare; see run_health.hpp).
    if (const double applied = health.max_applied_norm(logs); applied > kOverflowRiskNorm)
      check_optimizer_state(*state_, rt_, step_, applied, t.grad_clip);
    bar.clear();
    for (const StepLog& s : logs) {
      metrics.write(s);
      if (tb) tb->step(s);
      sum.steps.push_back(s);
      if (s.skipped) log_warn(cat("step ", s.step, ": gradient norm is not finite; update skipped"));
    }
    health.observe(logs);  // too many skipped steps in a row: stops with an error
    // A line for every log step read, not only the newest: a read forced by a
    // checkpoint, validation or the last step also returns the ordinary log
    // step queued before it, which would otherwise never reach the console.
    bool printed = false;
    for (const StepLog& s : logs) {
      if (s.step % t.log_every != 0 && s.step != t.steps && !s.has_val) continue;
      log_info(log_line(s, t.steps));
      printed = true;
    }
    // The recipe's own state (FP8: scales, amax, skipped updates), as of the newest step queued.
    if (printed)
      if (const std::string p = rt_.precision->log_summary(); !p.empty()) log_info(cat("precision: ", p));
    const StepLog& s = logs.back();
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    const double per_step = elapsed / static_cast<double>(step_ - sum.first_step);
    bar.draw(s.step, s.loss, per_step * static_cast<double>(t.steps - step_));
  };
  // Up to here a stop signal ends the process at once (no step has run:
  // nothing to save); from here it finishes the current step and checkpoints it.
  StopSignals::steps_begin();
  int stop = agreed_stop_signal();  // a signal that arrived before steps_begin (e.g. a rank's peer): nothing new to save
  while (step_ < last && stop == 0) {
    profiler_->before_step(step_ + 1);
    train_step();
    profiler_->after_step(step_);
    stop = agreed_stop_signal();
    const bool validate = t.validation_every > 0 && (step_ % t.validation_every == 0 || step_ == t.steps) && !stop;
    const bool checkpoint =
        stop || (cfg_.checkpoint.every > 0 && (step_ % cfg_.checkpoint.every == 0 || step_ == last));
    // An ordinary log step is read and reported after the next step is
    // queued (read_step_logs_but_newest): the device never idles waiting for
    // an optimizer step to end so that the host can read it. Validation,
    // checkpoints, the last step and the end of a profiling window (whose
    // steps' times the trace is checked against) read everything now.
    const bool window_end = cfg_.profile.enabled() && step_ == cfg_.profile.stop;
    const bool forced = step_ == last || validate || checkpoint || window_end;
    if (!forced) {
      if (log_due_) {
        std::vector<StepLog> logs = read_step_logs_but_newest();
        report(logs);
        log_due_ = false;
      }
      if (step_ % t.log_every == 0) log_due_ = true;
      continue;  // the device runs on; nothing here waits for it
    }
    log_due_ = false;
    std::vector<StepLog> logs = read_step_logs();
    if (validate) {
      logs.back().has_val = true;
      logs.back().val_loss = evaluate();
      sum.val_losses.emplace_back(step_, logs.back().val_loss);
    }
    report(logs);
    if (checkpoint) {
      bar.clear();
      save_checkpoint(step_);
    }
  }
  profiler_->finish();
  bar.finish();
  sum.last_step = step_;
  sum.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
  if (stop) {
    sum.stop_signal = stop;
    const bool stepped = step_ > sum.first_step;
    log_warn(cat("stopped by ", signal_name(stop), world() > 1 ? cat(" on rank ", rank(), " of ", world()) : std::string(),
                 " after step ", step_, stepped ? cat("; checkpoint ", (checkpoint_root(cfg_) / ckpt::step_dir_name(step_)).string(),
                                                      " written")
                                                : std::string("; no step ran in this process, nothing new to save"),
                 ". Run the same command to resume"));
    return sum;
  }
  health.finish();
  if (replaced_run_) replaced_run_->remove();  // finished without a checkpoint: the replacement stands
  replace_before_save_ = false;
  std::ostringstream fin;
  fin << "done: " << (step_ - sum.first_step) << " steps in " << duration(sum.wall_s) << " | final loss "
      << std::fixed << std::setprecision(4) << (sum.steps.empty() ? 0.0 : sum.steps.back().loss);
  if (!sum.val_losses.empty())
    fin << " | val loss " << sum.val_losses.front().second << " -> " << sum.val_losses.back().second;
  if (health.skipped_total()) fin << " | " << health.skipped_total() << " skipped steps";
  if (rt_.backend->device() == Device::cuda) {
    // What the steps used beside what was planned for them (the plan with
    // what lies beyond the arena, estimated: `loom check`'s "per rank in all").
    const double used = static_cast<double>(rt_.backend->device_memory_used()),
                 planned = static_cast<double>(state_->planned_device_bytes());
    fin << " | device memory " << std::setprecision(2) << used / (1024.0 * 1024.0 * 1024.0) << " GiB in use, "
        << planned / (1024.0 * 1024.0 * 1024.0) << " GiB planned (" << std::showpos << 100.0 * (used / planned - 1.0)
        << std::noshowpos << "%)" << std::setprecision(4);
  }
  fin << " | metrics " << (out / "metrics.jsonl").string();
  log_info(fin.str());
  return sum;
}

}  // namespace loom
