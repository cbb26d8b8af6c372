#include "train/session_log_ring.hpp"

#include <algorithm>

#include "loom/block.hpp"
#include "loom/error.hpp"
#include "train/optimizer.hpp"

namespace loom {

StepLogRing::StepLogRing(const Config& cfg, Runtime& rt, TrainState& state, const Model& model,
                         std::function<void()> caught_up)
    : cfg_(cfg), rt_(rt), state_(state), model_(model), caught_up_(std::move(caught_up)) {}

void StepLogRing::make_room() {
  if (pending_ < state_.scalar_log_rows()) return;
  std::vector<StepLog> early = read_rows(last_opened_, false);  // the ring is full: keep its rows on the host
  unread_.insert(unread_.end(), early.begin(), early.end());
}

Tensor& StepLogRing::open(int64_t step) {
  Backend& be = *rt_.backend;
  LOOM_CHECK(pending_ < state_.scalar_log_rows(), "step log: step ", step, " opened on a full ring");
  parity_ = state_.next_scalars();
  last_opened_ = step;
  Tensor& scalars = state_.scalars();
  if (closed_[parity_] != kNoMarker) be.wait(be.ctx(), closed_[parity_]);  // its last reader (two steps ago) is done
  be.zero(scalars);
  Tensor begin = view(scalars, kTimeBegin, {1});
  be.timestamp(begin);
  Tensor ring_begin = view(state_.scalar_log(), row(step) * kStepScalars + kTimeBegin, {1});
  be.copy(ring_begin, begin);
  return scalars;
}

void StepLogRing::close(int64_t step) {
  Backend& be = *rt_.backend;
  const ExecContext& opt = be.side_ctx();
  be.wait(opt, be.mark(be.ctx()));
  {
    QueueScope on(be, opt);
    Tensor end = view(state_.scalars(), kTimeEnd, {1});
    be.timestamp(end);
    Tensor r = view(state_.scalar_log(), row(step) * kStepScalars, {kStepScalars});
    be.copy(r, state_.scalars());
  }
  closed_prev_ = closed_[parity_ ^ 1];
  closed_[parity_] = be.mark(opt);
  ++pending_;
}

std::vector<StepLog> StepLogRing::read(int64_t last_step, bool keep_newest) {
  std::vector<StepLog> out = std::move(unread_);
  unread_.clear();
  std::vector<StepLog> now = read_rows(last_step, keep_newest);
  out.insert(out.end(), now.begin(), now.end());
  return out;
}

// keep_newest: read the steps before the newest one. The newest step's row is
// written when its optimizer finishes; the rows before it were closed by the
// previous step's optimizer, long done, so the compute queue waits only for
// that (closed_prev_), not for the optimizer still running beside it. The one
// download waits for the compute queue, which has just queued the newest
// step's forward and backward; the host then queues the next step at once.
std::vector<StepLog> StepLogRing::read_rows(int64_t last_step, bool keep_newest) {
  std::vector<StepLog> out;
  const int64_t n = keep_newest ? pending_ - 1 : pending_;  // rows reported
  if (n <= 0) return out;
  LOOM_CHECK(!keep_newest || closed_prev_ != kNoMarker, "step log: ", pending_,
             " steps pending but no previous step closed");
  const auto& t = cfg_.train;
  Backend& be = *rt_.backend;
  const int world = rt_.world();
  // The whole ring in one call (a few KiB): rows are indexed by step number,
  // so nothing on the device ever moves between reads.
  const int64_t ring = state_.scalar_log_rows();
  std::vector<double> rows(static_cast<size_t>(ring * kStepScalars));
  if (keep_newest) be.wait(be.ctx(), closed_prev_);  // rows [0, n) are complete there
  else be.wait(be.ctx(), be.mark(be.side_ctx()));    // the ring's last rows are written on the optimizer queue
  // Every pending row, the newest included: the n reported rows whole, and
  // the newest row's start (written on the compute queue) ends the period of
  // the step before it.
  be.download(rows.data(), state_.scalar_log(), rows.size() * sizeof(double));  // the one wait
  caught_up_();
  // Losses averaged over ranks in one collective (every rank reads the same
  // steps). The blocks' extra losses (a mixture of experts' aux loss) ride in
  // the same collective (the second half).
  const bool extra = !model_.extra_losses().empty();
  std::vector<double> losses(static_cast<size_t>(extra ? 2 * n : n));
  const double tokens_per_rank = static_cast<double>(model_.env().N * t.grad_accum);
  const int64_t first = last_step - pending_ + 1;  // the step number of the oldest unread row
  auto row_of = [&](int64_t step) { return rows.data() + row(step) * kStepScalars; };
  for (int64_t i = 0; i < n; ++i) {
    losses[static_cast<size_t>(i)] = row_of(first + i)[kLossSum] / tokens_per_rank;
    if (extra) losses[static_cast<size_t>(n + i)] = row_of(first + i)[kAuxSum] / static_cast<double>(t.grad_accum);
  }
  if (rt_.host->size() > 1) {
    Tensor lt(losses.data(), DType::f64, Device::cpu, {static_cast<int64_t>(losses.size())});
    rt_.host->all_reduce(ExecContext{}, lt, ReduceOp::avg);
  }
  const double tokens_per_step = static_cast<double>(t.micro_batch * t.seq_len * t.grad_accum * world);
  const double samples_per_step = static_cast<double>(t.micro_batch * t.grad_accum * world);
  const bool gpu = be.device() == Device::cuda;
  const size_t mem = gpu ? be.device_memory_used() : peak_resident_bytes();
  for (int64_t i = 0; i < n; ++i) {
    const double* r = row_of(first + i);
    StepLog s;
    s.step = first + i;
    s.loss = losses[static_cast<size_t>(i)];
    if (extra) {
      s.has_aux = true;
      s.aux_loss = losses[static_cast<size_t>(n + i)];
    }
    s.lr = lr_at(s.step - 1, t.steps, t.warmup_steps, t.lr, t.min_lr, t.schedule);
    s.grad_norm = r[kGradNorm];
    s.skipped = r[kSkip] != 0.0;
    // A step's time is the period from its start to the next step's: with the
    // optimizer overlapping the next forward, that is what each step costs.
    // The last step of a read has no successor yet: start to end of its work.
    s.step_ms = i + 1 < pending_ ? row_of(first + i + 1)[kTimeBegin] - r[kTimeBegin] : r[kTimeEnd] - r[kTimeBegin];
    const double secs = std::max(s.step_ms, 1e-6) * 1e-3;
    s.tokens_per_s = tokens_per_step / secs;
    s.samples_per_s = samples_per_step / secs;
    if (gpu) s.mfu = mfu(model_.spec().flops_per_token(t.seq_len), s.tokens_per_s / static_cast<double>(world));
    s.peak_mem_bytes = mem;
    out.push_back(s);
  }
  pending_ -= n;  // keep_newest: the newest step stays unread, in its row
  return out;
}

}  // namespace loom
