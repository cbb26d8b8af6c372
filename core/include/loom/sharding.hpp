// Sharding plugins decide where parameters, gradients and optimizer state live
// on each rank and run the collectives around each unit (DESIGN.md "One
// training step"). The core owns the buffers (one arena, sized from the plan
// the plugin returns) and the optimizer arithmetic; the plugin owns the
// communication and which range of each unit this rank updates.
#pragma once
#include <cstdint>
#include <vector>

#include "loom/comm.hpp"
#include "loom/context.hpp"
#include "loom/model.hpp"
#include "loom/plugin.hpp"
#include "loom/tensor.hpp"

namespace loom {

// Sizes (in elements) of one unit's buffers on this rank, as the plugin wants them.
struct UnitLayout {
  int64_t padded_numel = 0;  // flat size padded to divide the shard group
  int64_t param_numel = 0;   // resident compute-dtype params between steps
  int64_t gather_numel = 0;  // scratch for gathered full params (zero3), 0 if none
  int64_t grad_numel = 0;    // gradient buffer the backward writes into
  int64_t grad_shard_numel = 0;  // reduced-gradient shard buffer, 0 if none
  int64_t optim_numel = 0;   // master / m / v elements (the owned range)
  int64_t optim_begin = 0;   // owned range start in the padded flat unit
};

// One unit's buffers on this rank (tensors are flat, 1-D).
struct UnitState {
  int index = 0;
  const UnitInfo* info = nullptr;
  UnitLayout layout;
  Tensor params;      // what forward/backward read (full unit when gathered)
  Tensor gathered;    // zero3 scratch (empty otherwise)
  Tensor grads;       // what backward writes
  Tensor grad_shard;  // reduced shard (empty when unused)
  Tensor master;      // fp32 master for the owned range (empty when the recipe has none)
  Tensor adam_m, adam_v;
};

struct AdamWHyper {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;  // 1-based, for bias correction
};

// Arithmetic the core provides to sharding plugins (CPU or CUDA kernels).
class OptimizerOps {
 public:
  virtual ~OptimizerOps() = default;
  // Sum of squares of grads[begin, end) in fp32/fp64 accumulation.
  virtual double grad_sq_norm(const ExecContext& ctx, const Tensor& grads, int64_t begin, int64_t end) = 0;
  // AdamW on the unit's owned range: grads_owned holds the (reduced) gradients
  // for [optim_begin, optim_begin + optim_numel), multiplied by grad_scale
  // (clipping, averaging) before use; params for that range are written back
  // into params_out (offset optim_begin) in the param dtype. Weight decay is
  // applied only to parameters whose ParamInfo says so.
  virtual void adamw(const ExecContext& ctx, UnitState& unit, const Tensor& grads_owned, float grad_scale,
                     const AdamWHyper& h, Tensor& params_out) = 0;
};

struct ShardingEnv {
  ExecContext ctx;
  Communicator* world = nullptr;  // all ranks
  OptimizerOps* ops = nullptr;
};

struct StepResult {
  double grad_norm = 0;  // global norm before clipping
  bool skipped = false;  // non-finite gradients: no update
};

class Sharding : public Plugin {
 public:
  // Called once with every unit; returns one layout per unit.
  virtual std::vector<UnitLayout> plan(const ShardingEnv& env, const std::vector<UnitInfo>& units) = 0;
  // Called once after the core has allocated and initialised the buffers
  // (params hold the initial weights on every rank).
  virtual void setup(ShardingEnv& /*env*/, std::vector<UnitState>& /*units*/) {}
  virtual void before_forward(ShardingEnv& /*env*/, UnitState& /*unit*/) {}
  virtual void after_forward(ShardingEnv& /*env*/, UnitState& /*unit*/) {}
  virtual void before_backward(ShardingEnv& /*env*/, UnitState& /*unit*/) {}
  // last_micro: the last micro-batch of the step (communicate now where the strategy allows waiting).
  virtual void after_backward(ShardingEnv& /*env*/, UnitState& /*unit*/, bool /*last_micro*/) {}
  // Clip by global norm (across shards) -> AdamW on owned ranges -> re-gather.
  // grad_scale is applied to the gradients first (1 / grad_accum etc.), clip_norm <= 0 disables clipping.
  virtual StepResult step(ShardingEnv& env, std::vector<UnitState>& units, const AdamWHyper& h, float grad_scale,
                          float clip_norm) = 0;
};

template <> struct PluginInterface<PluginKind::sharding> { using type = Sharding; };

}  // namespace loom
