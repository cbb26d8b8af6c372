// AdamW and gradient norms on the backend, as sharding plugins see them (loom::OptimizerOps).
#pragma once
#include "loom/sharding.hpp"
#include "model/backend.hpp"

namespace loom {

class BackendOptimizerOps final : public OptimizerOps {
 public:
  explicit BackendOptimizerOps(Backend& backend, bool stochastic_rounding = false, uint64_t seed = 0)
      : backend_(backend), stochastic_rounding_(stochastic_rounding), seed_(seed) {}
  double grad_sq_norm(const ExecContext& ctx, const Tensor& grads, int64_t begin, int64_t end) override;
  void adamw(const ExecContext& ctx, UnitState& unit, const Tensor& grads_owned, float grad_scale, const AdamWHyper& h,
             Tensor& params_out, int64_t params_out_begin) override;
  void zero(const ExecContext& ctx, Tensor& t) override;
  void accumulate(const ExecContext& ctx, Tensor& dst, const Tensor& src) override;
  void convert(const ExecContext& ctx, Tensor& dst, const Tensor& src) override;

 private:
  Backend& backend_;
  bool stochastic_rounding_;
  uint64_t seed_;
};

// Learning rate at `step` (0-based): linear warmup to lr over warmup_steps,
// then cosine or linear decay to min_lr at the last step, or constant.
double lr_at(int64_t step, int64_t total_steps, int64_t warmup_steps, double lr, double min_lr,
             const std::string& schedule);

}  // namespace loom
