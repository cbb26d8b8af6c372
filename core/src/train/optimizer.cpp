#include "train/optimizer.hpp"

#include <algorithm>
#include <cmath>

#include "loom/error.hpp"

namespace loom {

double BackendOptimizerOps::grad_sq_norm(const ExecContext&, const Tensor& grads, int64_t begin, int64_t end) {
  return backend_.sq_norm(grads, begin, end);
}

void BackendOptimizerOps::adamw(const ExecContext&, UnitState& unit, const Tensor& grads_owned, float grad_scale,
                                const AdamWHyper& h, Tensor& params_out, int64_t params_out_begin) {
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
  a.grad_scale = grad_scale;
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
    a.weight_decay = p.weight_decay ? h.weight_decay : 0.f;
    backend_.adamw(w, has_master ? &master : nullptr, g, m, v, a);
  }
}

void BackendOptimizerOps::zero(const ExecContext&, Tensor& t) { backend_.zero(t); }
void BackendOptimizerOps::accumulate(const ExecContext&, Tensor& dst, const Tensor& src) { backend_.accumulate(dst, src); }
void BackendOptimizerOps::convert(const ExecContext&, Tensor& dst, const Tensor& src) { backend_.convert(dst, src); }

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
