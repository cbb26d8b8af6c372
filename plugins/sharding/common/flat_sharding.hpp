// The flat-buffer sharding engine behind ddp, zero1, zero2, zero3 (full_shard)
// and hybrid_shard: one implementation, parameterised by what is sharded.
//
//              params            grads                      optimizer state (+ fp32 master)
//   ddp        replicated        replicated, all-reduce     replicated
//   zero1      replicated        reduce-scatter at the end  owned shard
//   zero2      replicated        reduce-scatter per unit    owned shard
//   zero3      owned shard       reduce-scatter per unit    owned shard
//   hybrid     zero3 inside a shard group of `shard_group_size` ranks, replicated
//              across groups (grad shards all-reduced across groups)
//
// Each unit's parameters are one flat vector padded to a multiple of the shard
// group (padded_numel = group * chunk); rank r of the group owns
// [r * chunk, (r + 1) * chunk). Every collective is one call per unit.
//
// Gradients: the backward accumulates into a whole-unit buffer. ddp and zero1
// keep one per unit (they hold full gradients anyway) and communicate only on
// the last micro-batch of a step. zero2/zero3/hybrid keep only the reduced
// fp32 shard per unit: the backward writes into one of two rotating scratch
// buffers, reduced into the shard as each unit's backward finishes, every
// micro-batch (accumulating in the shard), so their gradient memory stays
// sharded with gradient accumulation too.
//
// Parameters under zero3/hybrid: before each unit's forward (and again before
// its backward when reshard_after_forward, except for a unit of token
// embeddings alone, whose backward reads no parameter) the shards are all-gathered into one
// of `prefetch + 1` rotating buffers; up to `prefetch` gathers are issued ahead
// of the unit being computed. With reshard_after_forward = false every unit
// has its own gather buffer, filled in the forward and kept for the backward.
// A unit whose params another unit also reads (the embedding of a tied model)
// has its own gather buffer and stays gathered from its forward to its backward.
//
// Ordering on GPU (NCCL): collectives run on the communicator's stream; the
// compute stream waits for a collective's ticket only just before it needs
// the result, and a rotating buffer is rewritten only after waiting for the
// collective that last read it — no host synchronisation in the step except
// the gradient norm. A reduce-scatter that cannot land in the shard itself
// (after the first micro-batch, or reduced in bf16) is added into it on the
// optimizer queue (the second stream), which waits for the collective, so
// the compute stream runs the next unit's backward meanwhile; the optimizer
// step and a replica all-reduce wait for the last of those adds.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "loom/sharding.hpp"

namespace loom::shard {

enum class Strategy { ddp, zero1, zero2, zero3, hybrid };

class FlatSharding : public Sharding {
 public:
  // name: the plugin name as configured (for messages and the table keys it reads).
  FlatSharding(const PluginInit& init, Strategy strategy, std::string name);
  ~FlatSharding() override;

  std::vector<UnitLayout> plan(const ShardingEnv& env, const std::vector<UnitInfo>& units) override;
  std::vector<ShardingBuffer> scratch(const ShardingEnv& env) override;
  void setup(ShardingEnv& env, std::vector<UnitState>& units, std::vector<Tensor>& scratch) override;
  void begin_step(ShardingEnv& env, std::vector<UnitState>& units) override;
  void before_forward(ShardingEnv& env, UnitState& unit) override;
  void before_backward(ShardingEnv& env, UnitState& unit) override;
  void after_backward(ShardingEnv& env, UnitState& unit, bool last_micro) override;
  void step(ShardingEnv& env, std::vector<UnitState>& units, const AdamWHyper& h) override;
  // The core's zeroing pass at a step's start is not needed: the first
  // micro-batch's backward writes every parameter gradient (BlockEnv::
  // first_micro), the whole-unit buffers that zero2 / zero3 / hybrid_shard
  // lend for one backward are written too (UnitState::grads_fresh; only their
  // padding is zeroed in before_backward), and the padding of a unit's own
  // buffer is never written (zero since the arena was allocated).
  bool zeroes_grads() const override { return true; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::shard
