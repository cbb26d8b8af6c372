// The fp8_block recipe: precision/common/fp8_block.hpp (DeepSeek-V3's
// fine-grained FP8 scaling). Keys of its [precision] table: docs/PLUGINS.md.
#include "loom/precision.hpp"
#include "precision/common/fp8_block.hpp"

namespace loom::fp8_block {
namespace {

class Fp8BlockPrecision final : public Fp8BlockRecipe {
 public:
  explicit Fp8BlockPrecision(const PluginInit& init) : Fp8BlockRecipe(init) {}
};

}  // namespace
}  // namespace loom::fp8_block

using loom::fp8_block::Fp8BlockPrecision;
LOOM_PLUGIN(precision, Fp8BlockPrecision, "fp8_block", "1.0.0",
            "FP8 with DeepSeek-V3 fine-grained scaling (1x128 tiles for activations and gradients, 128x128 blocks for weights), E4M3 GEMMs (cuBLASLt block-scaled on CUDA, emulated on the CPU); LM head in bf16 on CUDA, fp32 on the CPU")
