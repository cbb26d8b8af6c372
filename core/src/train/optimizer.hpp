// AdamW, the global gradient norm and clipping on the backend, as sharding
// plugins see them (loom::OptimizerOps). The norm, the clipping coefficient
// and the skip decision live in the step's device scalars (StepScalars in
// loom/ops/backend.hpp), so the optimizer step never waits for the device.
#pragma once
#include "loom/error.hpp"
#include "loom/ops/backend.hpp"
#include "loom/sharding.hpp"

namespace loom {

class BackendOptimizerOps final : public OptimizerOps {
 public:
  explicit BackendOptimizerOps(Backend& backend, bool stochastic_rounding = false, uint64_t seed = 0)
      : backend_(backend), stochastic_rounding_(stochastic_rounding), seed_(seed) {}
  // The step's scalars (f64[kStepScalars] on the backend, zeroed by the core
  // at the start of each step) and the clipping settings norm_finish applies.
  void bind(const Tensor& scalars, float grad_scale, float clip_norm) {
    LOOM_CHECK(scalars.dtype == DType::f64 && scalars.numel() >= kStepScalars, "step scalars must be f64[",
               kStepScalars, "]");
    scalars_ = scalars;
    grad_scale_ = grad_scale;
    clip_norm_ = clip_norm;
  }
  void norm_add(const ExecContext& ctx, const Tensor& grads, int64_t begin, int64_t end) override;
  void norm_finish(const ExecContext& ctx, Communicator* group) override;
  void adamw(const ExecContext& ctx, UnitState& unit, const Tensor& grads_owned, const AdamWHyper& h,
             Tensor& params_out, int64_t params_out_begin, bool consume_grads) override;
  ExecContext optimizer_queue(const ExecContext&) override { return backend_.side_ctx(); }
  uint64_t mark(const ExecContext& ctx) override { return backend_.mark(ctx); }
  void wait(const ExecContext& ctx, uint64_t marker) override { backend_.wait(ctx, marker); }
  void zero(const ExecContext& ctx, Tensor& t) override;
  void accumulate(const ExecContext& ctx, Tensor& dst, const Tensor& src) override;
  void convert(const ExecContext& ctx, Tensor& dst, const Tensor& src) override;

 private:
  Backend& backend_;
  bool stochastic_rounding_;
  uint64_t seed_;
  Tensor scalars_;
  float grad_scale_ = 1.f, clip_norm_ = 0.f;
};

// Learning rate at `step` (0-based): linear warmup to lr over warmup_steps,
// then cosine or linear decay to min_lr at the last step, or constant.
double lr_at(int64_t step, int64_t total_steps, int64_t warmup_steps, double lr, double min_lr,
             const std::string& schedule);

}  // namespace loom
