#include "train/optimizer.hpp"

#include <algorithm>
#include <cmath>

#include "loom/error.hpp"

namespace loom {

double BackendOptimizerOps::grad_sq_norm(const ExecContext&, const Tensor& grads, int64_t begin, int64_t end) {
  return backend_.sq_norm(grads, begin, end);
}

void BackendOptimizerOps::adamw(const ExecContext&, UnitState& unit, const Tensor& grads_owned, float grad_scale,
                                const AdamWHyper& h, Tensor& params_out) {
  const int64_t lo = unit.layout.optim_begin, hi = lo + unit.layout.optim_numel;
  LOOM_CHECK(grads_owned.numel() >= unit.layout.optim_numel, "unit ", unit.info->name, ": owned gradient has ",
             grads_owned.numel(), " elements, the owned range ", unit.layout.optim_numel);
  // Recipes with a separate master copy (bf16 params, fp32 master) update the
  // master and cast it back into the params; that cast is a device kernel of
  // the CUDA backend. Here params are the fp32 master themselves.
  LOOM_CHECK(unit.master.data == nullptr && params_out.dtype == DType::f32,
             "unit ", unit.info->name, ": AdamW on this backend updates fp32 params in place (params are ",
             dtype_name(params_out.dtype), unit.master.data ? ", with a master copy" : "", ")");
  // One update per parameter tensor overlapping the owned range: weight decay is per tensor.
  for (const ParamInfo& p : unit.info->params) {
    const int64_t b = std::max(lo, p.offset), e = std::min(hi, p.offset + p.numel);
    if (b >= e) continue;
    const int64_t n = e - b, local = b - lo;
    Tensor g = view(grads_owned, local, {n});
    Tensor m = view(unit.adam_m, local, {n});
    Tensor v = view(unit.adam_v, local, {n});
    Tensor w = view(params_out, b, {n});
    backend_.adamw(w, g, m, v, h.lr, h.beta1, h.beta2, h.eps, p.weight_decay ? h.weight_decay : 0.f, h.step,
                   grad_scale);
  }
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
