// The fp8_delayed recipe: precision/common/fp8_recipe.hpp with delayed scaling.
// Keys of its [precision] table: docs/PLUGINS.md.
#include "loom/precision.hpp"
#include "precision/common/fp8_recipe.hpp"

namespace loom::fp8_delayed {
namespace {

class Fp8DelayedPrecision final : public fp8_recipe::Fp8Recipe {
 public:
  explicit Fp8DelayedPrecision(const PluginInit& init) : Fp8Recipe("fp8_delayed", fp8::Scaling::delayed, init) {}
};

}  // namespace
}  // namespace loom::fp8_delayed

using loom::fp8_delayed::Fp8DelayedPrecision;
LOOM_PLUGIN(precision, Fp8DelayedPrecision, "fp8_delayed", "1.0.0",
            "FP8 with delayed scaling (TransformerEngine DelayedScaling: amax history, margin), E4M3/E5M2 GEMMs (cuBLASLt on CUDA, emulated on the CPU); LM head in bf16 on CUDA, fp32 on the CPU")
