// Sharding "ddp" (FSDP NO_SHARD): every rank holds the whole model, its
// gradients and its optimizer state; gradients are all-reduced per unit on the
// step's last micro-batch, overlapped with the rest of the backward on GPU.
// Keys: reduce_dtype ("fp32" | "bf16"). See sharding/common/flat_sharding.hpp.
#include "sharding/common/flat_sharding.hpp"

namespace {
class Ddp final : public loom::shard::FlatSharding {
 public:
  explicit Ddp(const loom::PluginInit& init) : FlatSharding(init, loom::shard::Strategy::ddp, "ddp") {}
};
}  // namespace

LOOM_PLUGIN(sharding, Ddp, "ddp", "1.0.0", "replicated params, grads all-reduced per unit")
