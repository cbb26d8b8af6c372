// Sharding "zero1" (ZeRO stage 1): optimizer state and the fp32 master are
// sharded; gradients stay whole on every rank until the step's last
// micro-batch, are reduce-scattered, AdamW updates the owned shard and the
// updated params are all-gathered. Keys: reduce_dtype.
#include "sharding/common/flat_sharding.hpp"

namespace {
class Zero1 final : public loom::shard::FlatSharding {
 public:
  explicit Zero1(const loom::PluginInit& init) : FlatSharding(init, loom::shard::Strategy::zero1, "zero1") {}
};
}  // namespace

LOOM_PLUGIN(sharding, Zero1, "zero1", "1.0.0", "optimizer state sharded (ZeRO-1)")
