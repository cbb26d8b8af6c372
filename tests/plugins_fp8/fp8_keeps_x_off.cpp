// Test-only precision plugin "fp8_delayed_bf16_x": the fp8_delayed recipe on
// the CPU, but answering keeps_wgrad_input = false for every linear, so the
// blocks keep their bf16/fp32 inputs per layer and hand them to the backward
// as before ABI 5.0. test_fp8_recipes compares its losses with fp8_delayed's
// (which lets the blocks drop those inputs): the recipe never reads them, so
// they must be bitwise equal. Built from precision/common/fp8_recipe.cpp
// without the GPU path.
#include "loom/precision.hpp"
#include "precision/common/fp8_recipe.hpp"

namespace loom::test_fp8 {
namespace {

class Fp8DelayedBf16X final : public fp8_recipe::Fp8Recipe {
 public:
  explicit Fp8DelayedBf16X(const PluginInit& init) : Fp8Recipe("fp8_delayed", fp8::Scaling::delayed, init) {}
  bool keeps_wgrad_input(int /*id*/) const override { return false; }
};

}  // namespace
}  // namespace loom::test_fp8

using loom::test_fp8::Fp8DelayedBf16X;
LOOM_PLUGIN(precision, Fp8DelayedBf16X, "fp8_delayed_bf16_x", "1.0.0",
            "test only: fp8_delayed (CPU) that lets the blocks keep every linear's input for the backward")
