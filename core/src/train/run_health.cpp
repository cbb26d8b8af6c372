#include "train/run_health.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "config/format_number.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"
#include "train/finite_checks.hpp"

namespace loom {
namespace {

std::string sci(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

}  // namespace

void RunHealth::observe(const std::vector<StepLog>& logs) {
  for (const StepLog& s : logs) {
    ++steps_;
    if (!s.skipped) {
      run_ = 0;
      continue;
    }
    ++skipped_total_;
    if (run_++ == 0) run_first_ = s.step;
    if (t_.max_skipped_steps > 0 && run_ >= t_.max_skipped_steps)
      throw Error(cat("steps ", run_first_, " to ", s.step, ": ", run_, " consecutive steps were skipped because the "
                      "gradient norm was not finite (NaN or inf), reaching train.max_skipped_steps = ",
                      t_.max_skipped_steps, ". The run is not learning: the loss or the gradients overflow (lower "
                      "train.lr, set train.grad_clip > 0, check the data), or the weights hold NaN. No checkpoint was "
                      "written from this state; the complete checkpoints in checkpoint.dir are untouched"));
  }
}

void RunHealth::finish() const {
  if (steps_ > 0 && skipped_total_ == steps_)
    throw Error(cat("every one of the ", steps_, " steps of this run was skipped because the gradient norm was not "
                    "finite (NaN or inf): nothing was learned. Lower train.lr, set train.grad_clip > 0, or check the "
                    "data and the initial weights"));
}

double RunHealth::max_applied_norm(const std::vector<StepLog>& logs) const {
  double m = 0;
  for (const StepLog& s : logs) {
    if (s.skipped) continue;
    // torch's clip_grad_norm_ coefficient, as clip_scale applies it.
    double coef = 1.0;
    if (t_.grad_clip > 0) coef = std::min(1.0, t_.grad_clip / (s.grad_norm + 1e-6));
    m = std::max(m, s.grad_norm * coef);
  }
  return m;
}

void check_optimizer_state(TrainState& state, Runtime& rt, int64_t step, double applied_norm, double grad_clip) {
  std::string found;
  int64_t local = 0;
  for (const UnitState& u : state.units()) {
    const int64_t lo = u.layout.optim_begin, n = u.layout.optim_numel;
    if (n == 0) continue;
    struct Part {
      const char* kind;
      Tensor t;
    };
    std::vector<Part> parts = {{"adam_v", u.adam_v}, {"adam_m", u.adam_m}};
    if (u.master.data) parts.push_back({"master", u.master});
    parts.push_back({"params", u.layout.params_sharded ? u.param_shard : view(u.params, lo, {n})});
    for (const Part& part : parts) {
      const std::vector<float> host = state.read_tensor(part.t);
      for (const ParamInfo& p : u.info->params) {
        const int64_t a = std::max(lo, p.offset), b = std::min(lo + n, p.offset + p.numel);
        if (a >= b) continue;
        const NonFiniteCount c = count_nonfinite(host.data() + (a - lo), DType::f32, b - a);
        if (!c) continue;
        local += c.count();
        if (found.size() < 400)
          found += cat(found.empty() ? "" : "; ", state_kind_words(part.kind), " of '", p.name, "': ",
                       describe_nonfinite(c, b - a));
      }
    }
  }
  const double total = all_reduce_scalar(*rt.host, static_cast<double>(local), ReduceOp::sum);
  if (total == 0) {
    log_debug(cat("step ", step, ": an update of gradient norm ", sci(applied_norm),
                  " left the optimizer state finite"));
    return;
  }
  throw Error(cat("step ", step, ": the optimizer state overflowed after an update applied a gradient of norm ",
                  sci(applied_norm), " (train.grad_clip = ",
                  config_detail::format_number(grad_clip), "): ",
                  static_cast<int64_t>(total), " values are no longer finite",
                  found.empty() ? cat(" on other ranks") : cat(" (on rank ", rt.rank(), ": ", found, ")"),
                  ". AdamW's second moment holds the square of each gradient element, which overflows above about "
                  "1.8e19; those weights would stop updating for good. Lower train.lr or set train.grad_clip > 0 "
                  "(e.g. 1.0), and resume from the last complete checkpoint; no checkpoint is written from this state"));
}

}  // namespace loom
