// Sharding "hybrid_shard" (FSDP HYBRID_SHARD / HSDP): full sharding inside a
// shard group of `shard_group_size` consecutive ranks (default: the ranks of
// one node), replicated across groups: gradients are reduce-scattered inside
// the group, then the shards all-reduced across groups.
// reshard_after_forward = false keeps each unit gathered from its forward to
// its backward (the ZeRO-2 variant). Keys: shard_group_size,
// reshard_after_forward, prefetch, reduce_dtype.
#include "sharding/common/flat_sharding.hpp"

namespace {
class HybridShard final : public loom::shard::FlatSharding {
 public:
  explicit HybridShard(const loom::PluginInit& init)
      : FlatSharding(init, loom::shard::Strategy::hybrid, "hybrid_shard") {}
};
}  // namespace

LOOM_PLUGIN(sharding, HybridShard, "hybrid_shard", "1.0.0", "full shard inside node groups, replicated across them (HSDP)")
