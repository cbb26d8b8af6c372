#include "train/optimizer.hpp"

#include <algorithm>
#include <cmath>

#include "loom/error.hpp"
#include "loom/trace.hpp"

namespace loom {
namespace {

// A tracer range for an optimizer op queued on `ctx`: on the optimizer track
// when that is the backend's second queue, else on the compute track.
trace::Scope op_range(const Backend& b, const ExecContext& ctx, const char* name) {
  const bool side = ctx.stream != nullptr && ctx.stream == b.side_ctx().stream && ctx.stream != b.ctx().stream;
  return trace::Scope(side ? trace::Track::optimizer : trace::Track::compute, name, ctx.stream);
}

}  // namespace

void BackendOptimizerOps::norm_add(const ExecContext& ctx, const Tensor& grads, int64_t begin, int64_t end) {
  LOOM_CHECK(scalars_.data != nullptr, "OptimizerOps::norm_add before the core bound the step scalars");
  QueueScope q(backend_, ctx);
  trace::Scope r = op_range(backend_, ctx, "grad_norm");
  Tensor acc = view(scalars_, kNormSq, {1});
  backend_.sum_into(acc, grads, begin, end, true);
}

void BackendOptimizerOps::norm_finish(const ExecContext& ctx, Communicator* group) {
  LOOM_CHECK(scalars_.data != nullptr, "OptimizerOps::norm_finish before the core bound the step scalars");
  if (group != nullptr && group->size() > 1) {
    // The group's sums of squares added up where they live (NCCL: on the
    // device, ordered on the stream; MPI: host memory, which is the CPU's).
    Tensor acc = view(scalars_, kNormSq, {1});
    group->wait(ctx, group->all_reduce(ctx, acc, ReduceOp::sum));
  }
  QueueScope q(backend_, ctx);
  trace::Scope r = op_range(backend_, ctx, "clip");
  backend_.clip_scale(scalars_, grad_scale_, clip_norm_);
}

void BackendOptimizerOps::adamw(const ExecContext& ctx, UnitState& unit, const Tensor& grads_owned,
                                const AdamWHyper& h, Tensor& params_out, int64_t params_out_begin,
                                bool consume_grads) {
  QueueScope q(backend_, ctx);
  trace::Scope r = op_range(backend_, ctx, "adamw");
  const int64_t lo = unit.layout.optim_begin, hi = lo + unit.layout.optim_numel;
  LOOM_CHECK(grads_owned.numel() >= unit.layout.optim_numel, "unit ", unit.info->name, ": owned gradient has ",
             grads_owned.numel(), " elements, the owned range ", unit.layout.optim_numel);
  const bool has_master = unit.master.data != nullptr;
  Backend::AdamWArgs a;
  a.lr = h.lr;
  a.beta1 = h.beta1;
  a.beta2 = h.beta2;
  a.eps = h.eps;
  a.step = h.step;
  a.grad_scale = 1.0f;
  a.scalars = scalars_.ptr<const double>();
  a.consume_grad = consume_grads;
  a.stochastic_rounding = stochastic_rounding_;
  a.seed = seed_ ^ (static_cast<uint64_t>(unit.index) << 40);
  // One update per parameter tensor overlapping the owned range: weight decay is per tensor.
  for (const ParamInfo& p : unit.info->params) {
    const int64_t b = std::max(lo, p.offset), e = std::min(hi, p.offset + p.numel);
    if (b >= e) continue;
    const int64_t n = e - b, local = b - lo;
    Tensor g = view(grads_owned, local, {n});
    Tensor m = view(unit.adam_m, local, {n});
    Tensor v = view(unit.adam_v, local, {n});
    Tensor w = view(params_out, b - params_out_begin, {n});
    Tensor master = has_master ? view(unit.master, local, {n}) : Tensor();
    a.weight_decay = p.weight_decay() ? h.weight_decay : 0.f;
    backend_.adamw(w, has_master ? &master : nullptr, g, m, v, a);
  }
}

void BackendOptimizerOps::zero(const ExecContext& ctx, Tensor& t) {
  QueueScope q(backend_, ctx);
  backend_.zero(t);
}
void BackendOptimizerOps::accumulate(const ExecContext& ctx, Tensor& dst, const Tensor& src) {
  QueueScope q(backend_, ctx);
  trace::Scope r = op_range(backend_, ctx, "accumulate");
  backend_.accumulate(dst, src);
}
void BackendOptimizerOps::convert(const ExecContext& ctx, Tensor& dst, const Tensor& src) {
  QueueScope q(backend_, ctx);
  trace::Scope r = op_range(backend_, ctx, "convert");
  backend_.convert(dst, src);
}

double lr_at(int64_t step, int64_t total_steps, int64_t warmup_steps, double lr, double min_lr,
             const std::string& schedule) {
  if (warmup_steps > 0 && step < warmup_steps) return lr * static_cast<double>(step + 1) / warmup_steps;
  if (schedule == "constant") return lr;
  const int64_t decay_steps = total_steps - warmup_steps;
  if (decay_steps <= 1) return lr;
  const double progress = std::clamp(static_cast<double>(step - warmup_steps) / (decay_steps - 1), 0.0, 1.0);
  if (schedule == "linear") return lr - (lr - min_lr) * progress;
  if (schedule == "cosine") return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
  throw Error(cat("train.schedule = \"", schedule, "\" is not one of: cosine, linear, constant"));
}

}  // namespace loom
