// Sharding "none": one rank holds everything. The reference the other
// strategies are compared against, and the single-GPU path — so it overlaps
// the optimizer with the model:
//
//   backward of unit u ends     -> the optimizer queue adds u's squared gradients to the norm
//   step()                      -> the optimizer queue: clip decision, then AdamW unit by unit,
//                                  a marker after each (the gradients are left as they are: the
//                                  next step's first micro-batch writes them, zeroes_grads)
//   next forward of unit u      -> the compute queue waits for u's marker only
//
// so the memory-bound norm runs beside the backward's GEMMs and each unit's
// AdamW beside the next step's forward of the units before it, instead of
// after everything. On the CPU both queues are one and this is the plain
// sequence: norm, clip, AdamW, forward.
#include <vector>

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
    updated_.assign(units.size(), kNone);
    return out;
  }

  bool zeroes_grads() const override { return true; }

  void before_forward(loom::ShardingEnv& env, loom::UnitState& u) override {
    const uint64_t m = updated_.at(static_cast<size_t>(u.index));
    if (m != kNone) env.ops->wait(env.ctx, m);  // this unit's last update has landed
  }

  void after_backward(loom::ShardingEnv& env, loom::UnitState& u, bool last_micro) override {
    if (!last_micro) return;  // the gradients are complete only after the step's last micro-batch
    const loom::ExecContext q = env.ops->optimizer_queue(env.ctx);
    env.ops->wait(q, env.ops->mark(env.ctx));
    env.ops->norm_add(q, u.grads, 0, u.info->numel);
  }

  void step(loom::ShardingEnv& env, std::vector<loom::UnitState>& units, const loom::AdamWHyper& h) override {
    const loom::ExecContext q = env.ops->optimizer_queue(env.ctx);
    // Everything queued on the compute queue so far (the last backward, and a
    // unit whose after_backward was not the last micro-batch's) comes first.
    env.ops->wait(q, env.ops->mark(env.ctx));
    env.ops->norm_finish(q, nullptr);
    for (auto& u : units) {
      env.ops->adamw(q, u, u.grads, h, u.params, 0, /*consume_grads=*/false);
      updated_[static_cast<size_t>(u.index)] = env.ops->mark(q);
    }
  }

 private:
  static constexpr uint64_t kNone = ~uint64_t{0};
  std::vector<uint64_t> updated_;  // per unit: the marker after its last AdamW
};

}  // namespace

LOOM_PLUGIN(sharding, NoSharding, "none", "1.0.0", "single rank: params, grads and optimizer state all local")
