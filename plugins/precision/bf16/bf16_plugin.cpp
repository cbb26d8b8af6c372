// The bf16 precision recipe, the default on GPUs: parameters and activations
// in bf16, an fp32 master copy that the optimizer updates (then rounds into
// the bf16 parameters), fp32 gradients and fp32 AdamW state. Every GEMM reads
// bf16 and accumulates in fp32; the weight gradient is produced in fp32 (bf16
// inputs, fp32 C/D), so micro-batches accumulate into dW without bf16 rounding.
// CUDA only: the CPU reference is the fp32 recipe.
#include <memory>

#include "loom/error.hpp"
#include "loom/precision.hpp"
#include "precision/common/cublaslt_linear.hpp"

namespace loom::bf16 {
namespace {

class Bf16Precision final : public Precision {
 public:
  explicit Bf16Precision(const PluginInit& init)
      : gemms_("bf16", precision_common::GemmDTypes{DType::bf16, DType::bf16, DType::f32}) {
    LOOM_CHECK(init.device == Device::cuda, "precision bf16: bf16 runs on CUDA; the CPU reference is "
               "precision.plugin = \"fp32\" (this run asked for device ", device_name(init.device), ")");
    // The recipe has no options of its own; finish() rejects any key given.
    init.config.finish();
  }

  PrecisionDTypes dtypes() const override {
    return {DType::bf16, DType::f32, DType::f32, DType::f32, DType::bf16, /*has_master=*/true};
  }
  int register_linear(const LinearDesc& desc) override { return gemms_.register_linear(desc); }
  size_t workspace_bytes() const override { return precision_common::CublasLtLinears::kWorkspaceBytes; }
  void set_workspace(void* ptr, size_t bytes) override { gemms_.set_workspace(ptr, bytes); }
  void linear_forward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, Tensor& y) override {
    gemms_.forward(ctx, id, x, w, y);
  }
  void linear_backward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx,
                       Tensor& dw, bool accumulate) override {
    gemms_.backward(ctx, id, x, w, dy, dx, dw, accumulate);
  }

 private:
  precision_common::CublasLtLinears gemms_;
};

}  // namespace
}  // namespace loom::bf16

using loom::bf16::Bf16Precision;
LOOM_PLUGIN(precision, Bf16Precision, "bf16", "1.0.0",
            "bf16 params and activations, fp32 master weights, grads and AdamW state; cuBLASLt GEMMs with fp32 "
            "accumulation (CUDA)")
