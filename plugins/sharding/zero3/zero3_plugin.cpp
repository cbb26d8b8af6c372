// Sharding "zero3", also built as "full_shard" (ZeRO stage 3, FSDP FULL_SHARD):
// params, gradients and optimizer state sharded; each unit is all-gathered
// before its forward and (reshard_after_forward, the default) again before its
// backward, with `prefetch` gathers issued ahead. Keys: reduce_dtype,
// reshard_after_forward, prefetch.
#include "sharding/common/flat_sharding.hpp"

#ifndef LOOM_ZERO3_NAME
#define LOOM_ZERO3_NAME "zero3"
#endif

namespace {
class Zero3 final : public loom::shard::FlatSharding {
 public:
  explicit Zero3(const loom::PluginInit& init)
      : FlatSharding(init, loom::shard::Strategy::zero3, LOOM_ZERO3_NAME) {}
};
}  // namespace

LOOM_PLUGIN(sharding, Zero3, LOOM_ZERO3_NAME, "1.0.0", "params, grads and optimizer state sharded (ZeRO-3, FSDP FULL_SHARD)")
