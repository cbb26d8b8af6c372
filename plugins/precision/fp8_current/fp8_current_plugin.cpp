// The fp8_current recipe: precision/common/fp8_recipe.hpp with current scaling.
// Keys of its [precision] table: docs/PLUGINS.md.
#include "loom/precision.hpp"
#include "precision/common/fp8_recipe.hpp"

namespace loom::fp8_current {
namespace {

class Fp8CurrentPrecision final : public fp8_recipe::Fp8Recipe {
 public:
  explicit Fp8CurrentPrecision(const PluginInit& init) : Fp8Recipe("fp8_current", fp8::Scaling::current, init) {}
};

}  // namespace
}  // namespace loom::fp8_current

using loom::fp8_current::Fp8CurrentPrecision;
LOOM_PLUGIN(precision, Fp8CurrentPrecision, "fp8_current", "1.0.0",
            "FP8 with per-tensor current scaling (each scale from its tensor's own amax), E4M3/E5M2 GEMMs (cuBLASLt on CUDA, emulated on the CPU); LM head in bf16 on CUDA, fp32 on the CPU")
