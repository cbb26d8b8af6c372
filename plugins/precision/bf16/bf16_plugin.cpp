// The bf16 precision recipe, the default on GPUs: parameters and activations
// in bf16, an fp32 master copy that the optimizer updates (then rounds into
// the bf16 parameters), fp32 gradients and fp32 AdamW state (bf16 with
// optimizer_state = "bf16": half its memory, the master stays fp32). Every GEMM reads
// bf16 and accumulates in fp32; the weight gradient is produced in fp32 (bf16
// inputs, fp32 C/D), so micro-batches accumulate into dW without bf16 rounding.
// CUDA only: the CPU reference is the fp32 recipe.
#include <memory>

#include "loom/error.hpp"
#include "loom/precision.hpp"
#include "precision/common/cublaslt_recipe.hpp"

namespace loom::bf16 {
namespace {

class Bf16Precision final : public precision_common::CublasLtRecipe {
 public:
  explicit Bf16Precision(const PluginInit& init)
      : CublasLtRecipe("bf16", precision_common::GemmDTypes{DType::bf16, DType::bf16, DType::f32}, init) {
    // One option of its own; finish() rejects any other key given.
    state_bf16_ = init.config.get_choice("optimizer_state", "fp32", {"fp32", "bf16"}) == "bf16";
    init.config.finish();
  }

  PrecisionDTypes dtypes() const override {
    return {DType::bf16, DType::f32, DType::f32, state_bf16_ ? DType::bf16 : DType::f32, DType::bf16,
            /*has_master=*/true};
  }

 private:
  bool state_bf16_ = false;  // AdamW's m and v in bf16
};

}  // namespace
}  // namespace loom::bf16

using loom::bf16::Bf16Precision;
LOOM_PLUGIN(precision, Bf16Precision, "bf16", "1.0.0",
            "bf16 params and activations, fp32 master weights, grads and AdamW state; cuBLASLt GEMMs with fp32 "
            "accumulation (CUDA)")
