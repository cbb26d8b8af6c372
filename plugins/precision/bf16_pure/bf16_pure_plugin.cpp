// The bf16_pure recipe (the seeds' "pure bf16"): parameters, gradients, AdamW
// state and activations all in bf16, no master copy, so the optimizer rounds
// each update straight into the bf16 parameters; with `stochastic_rounding =
// true` it rounds stochastically so that updates smaller than a bf16 ulp are
// not lost on average (the optimizer reads the flag from dtypes()). GEMMs
// read bf16 and accumulate in fp32; dW is written (and accumulated over
// micro-batches) in bf16. CUDA only.
#include "loom/error.hpp"
#include "loom/precision.hpp"
#include "precision/common/cublaslt_recipe.hpp"

namespace loom::bf16_pure {
namespace {

class Bf16PurePrecision final : public precision_common::CublasLtRecipe {
 public:
  explicit Bf16PurePrecision(const PluginInit& init)
      : CublasLtRecipe("bf16_pure", precision_common::GemmDTypes{DType::bf16, DType::bf16, DType::bf16}, init) {
    stochastic_rounding_ = init.config.get_bool("stochastic_rounding", false);
    init.config.finish();
  }

  PrecisionDTypes dtypes() const override {
    PrecisionDTypes t{DType::bf16, DType::bf16, DType::bf16, DType::bf16, DType::bf16, /*has_master=*/false};
    t.stochastic_rounding = stochastic_rounding_;
    return t;
  }

 private:
  bool stochastic_rounding_ = false;
};

}  // namespace
}  // namespace loom::bf16_pure

using loom::bf16_pure::Bf16PurePrecision;
LOOM_PLUGIN(precision, Bf16PurePrecision, "bf16_pure", "1.0.0",
            "bf16 params, grads, AdamW state and activations, no master copy, optional stochastic rounding; "
            "cuBLASLt GEMMs with fp32 accumulation (CUDA)")
