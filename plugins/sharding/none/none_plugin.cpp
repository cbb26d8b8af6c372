// Sharding "none": one rank holds everything; the step is global-norm
// clipping followed by AdamW over every unit. The reference the other
// strategies are compared against.
#include <cmath>

#include "loom/error.hpp"
#include "loom/sharding.hpp"

namespace {

class NoSharding final : public loom::Sharding {
 public:
  explicit NoSharding(const loom::PluginInit& init) {
    init.config.finish();  // no keys of its own
    if (init.world != 1)
      throw loom::Error(loom::cat("sharding.plugin = \"none\" runs on one rank, but this run has ", init.world,
                                  " ranks: pick ddp, zero1, zero2, zero3 (full_shard) or hybrid_shard, or start one process"));
  }

  std::vector<loom::UnitLayout> plan(const loom::ShardingEnv&, const std::vector<loom::UnitInfo>& units) override {
    std::vector<loom::UnitLayout> out;
    for (const auto& u : units) {
      loom::UnitLayout l;
      l.padded_numel = l.param_numel = l.grad_numel = l.optim_numel = u.numel;
      out.push_back(l);
    }
    return out;
  }

  loom::StepResult step(loom::ShardingEnv& env, std::vector<loom::UnitState>& units, const loom::AdamWHyper& h,
                        float grad_scale, float clip_norm) override {
    double sq = 0;
    for (auto& u : units) sq += env.ops->grad_sq_norm(env.ctx, u.grads, 0, u.info->numel);
    loom::StepResult r;
    r.grad_norm = std::sqrt(sq) * grad_scale;
    if (!std::isfinite(r.grad_norm)) {
      r.skipped = true;
      return r;
    }
    // As torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1.
    float scale = grad_scale;
    if (clip_norm > 0) {
      const double coef = clip_norm / (r.grad_norm + 1e-6);
      if (coef < 1.0) scale = static_cast<float>(grad_scale * coef);
    }
    for (auto& u : units) env.ops->adamw(env.ctx, u, u.grads, scale, h, u.params, 0);
    return r;
  }
};

}  // namespace

LOOM_PLUGIN(sharding, NoSharding, "none", "1.0.0", "single rank: params, grads and optimizer state all local")
