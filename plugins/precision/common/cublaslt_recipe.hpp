// The part every cuBLASLt recipe shares: a Precision whose GEMMs all go
// through one CublasLtLinears. A recipe adds its dtypes() and its options.
#pragma once
#include <string>

#include "loom/error.hpp"
#include "loom/log.hpp"
#include "loom/precision.hpp"
#include "precision/common/cublaslt_linear.hpp"

namespace loom::precision_common {

class CublasLtRecipe : public Precision {
 public:
  // Refuses a non-CUDA device with a message naming the recipe and the CPU reference.
  // Reads precision.gemm_algo (cublaslt_linear.hpp); the recipe reads its
  // own keys after, then calls finish().
  CublasLtRecipe(const std::string& name, GemmDTypes dtypes, const PluginInit& init)
      : name_(name), gemms_(name, dtypes, read_gemm_algo(init.config, init.deterministic)) {
    // The CPU backend computes in fp32 only; the core leaves this decision to
    // the recipe (it never matches plugin names), so the refusal is here.
    if (init.device != Device::cuda)
      throw Error(cat("precision.plugin = \"", name, "\" runs on CUDA only and this run has run.device = \"",
                      device_name(init.device), "\": set run.device = \"cuda\", or precision.plugin = \"fp32\" ",
                      "for the CPU reference"));
  }
  int register_linear(const LinearDesc& desc) override { return gemms_.register_linear(desc); }
  void setup(const PrecisionSetup& /*setup*/) override {
    log_info(cat("precision ", name_, ": cuBLASLt algorithm per GEMM problem: ",
                 gemms_.algo_choice() == GemmAlgo::fastest
                     ? cat("the fastest of the heuristic's first ", kGemmAlgoCandidates,
                           " answers, timed when the first step builds the plans (gemm_algo = \"fastest\")")
                     : std::string("the heuristic's first answer (gemm_algo = \"heuristic\")")));
  }
  // After the first step, once: what the timing picked.
  void end_step(const ExecContext& /*ctx*/) override {
    if (reported_ || gemms_.problems_timed() == 0) return;
    reported_ = true;
    log_info(cat("precision ", name_, ": timed ", gemms_.problems_timed(), " GEMM problems; ",
                 gemms_.problems_switched(), " run an algorithm other than the heuristic's first"));
  }
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
  std::string name_;
  CublasLtLinears gemms_;
  bool reported_ = false;
};

}  // namespace loom::precision_common
