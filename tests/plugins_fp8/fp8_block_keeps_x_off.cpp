// Test-only precision plugin "fp8_block_bf16_x": the fp8_block recipe on the
// CPU, but answering keeps_wgrad_input = false for every linear, so the
// blocks keep their fp32 inputs per layer and hand them to the backward as
// before ABI 5.0. test_fp8_block compares its losses with fp8_block's (which
// lets the blocks drop those inputs): the recipe never reads them in an FP8
// backward, so they must be bitwise equal. Built from
// precision/common/fp8_block.cpp without the GPU path.
#include "loom/precision.hpp"
#include "precision/common/fp8_block.hpp"

namespace loom::test_fp8 {
namespace {

class Fp8BlockBf16X final : public fp8_block::Fp8BlockRecipe {
 public:
  explicit Fp8BlockBf16X(const PluginInit& init) : Fp8BlockRecipe(init) {}
  bool keeps_wgrad_input(int /*id*/) const override { return false; }
};

}  // namespace
}  // namespace loom::test_fp8

using loom::test_fp8::Fp8BlockBf16X;
LOOM_PLUGIN(precision, Fp8BlockBf16X, "fp8_block_bf16_x", "1.0.0",
            "test only: fp8_block (CPU) that lets the blocks keep every linear's input for the backward")
