// The part every cuBLASLt recipe shares: a Precision whose GEMMs all go
// through one CublasLtLinears. A recipe adds its dtypes() and its options.
#pragma once
#include <string>

#include "loom/error.hpp"
#include "loom/precision.hpp"
#include "precision/common/cublaslt_linear.hpp"

namespace loom::precision_common {

class CublasLtRecipe : public Precision {
 public:
  // Refuses a non-CUDA device with a message naming the recipe and the CPU reference.
  CublasLtRecipe(const std::string& name, GemmDTypes dtypes, const PluginInit& init) : gemms_(name, dtypes) {
    // The CPU backend computes in fp32 only; the core leaves this decision to
    // the recipe (it never matches plugin names), so the refusal is here.
    if (init.device != Device::cuda)
      throw Error(cat("precision.plugin = \"", name, "\" runs on CUDA only and this run has run.device = \"",
                      device_name(init.device), "\": set run.device = \"cuda\", or precision.plugin = \"fp32\" ",
                      "for the CPU reference"));
  }
  int register_linear(const LinearDesc& desc) override { return gemms_.register_linear(desc); }
  size_t workspace_bytes() const override { return CublasLtLinears::kWorkspaceBytes; }
  void set_workspace(void* ptr, size_t bytes) override { gemms_.set_workspace(ptr, bytes); }
  void linear_forward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, Tensor& y,
                      const Tensor* residual) override {
    gemms_.forward(ctx, id, x, w, y, residual);
  }
  void linear_backward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx,
                       Tensor& dw, bool accumulate) override {
    gemms_.backward(ctx, id, x, w, dy, dx, dw, accumulate);
  }

 private:
  CublasLtLinears gemms_;
};

}  // namespace loom::precision_common
