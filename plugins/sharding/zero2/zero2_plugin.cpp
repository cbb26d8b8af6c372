// Sharding "zero2" (ZeRO stage 2, FSDP SHARD_GRAD_OP): gradients and optimizer
// state sharded; each unit's gradient is reduce-scattered as its backward
// finishes. Keys: reduce_dtype.
#include "sharding/common/flat_sharding.hpp"

namespace {
class Zero2 final : public loom::shard::FlatSharding {
 public:
  explicit Zero2(const loom::PluginInit& init) : FlatSharding(init, loom::shard::Strategy::zero2, "zero2") {}
};
}  // namespace

LOOM_PLUGIN(sharding, Zero2, "zero2", "1.0.0", "grads and optimizer state sharded (ZeRO-2)")
