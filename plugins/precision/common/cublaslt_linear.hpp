// The three GEMMs of a linear layer on CUDA through cuBLASLt, shared by the
// precision plugins (fp32 on CUDA, bf16, bf16_pure). Built only with CUDA.
//
// Semantics are those of loom/precision.hpp, all row-major (HF layout):
//   fprop  y[m, n]  = x[m, k] W[n, k]^T
//   dgrad  dx[m, k] = dy[m, n] W[n, k]
//   wgrad  dW[n, k] = dy[m, n]^T x[m, k]     (beta = 1 adds onto dW: micro-batches)
// m = rows (tokens, leading dims of x folded in), k = LinearDesc::in, n = LinearDesc::out.
// x, y, dy and dx may be row views into wider buffers (row stride > width, the
// stride of dim ndim-2 is used as leading dimension); W and dW are packed.
//
// The GEMMs themselves run through libloom's one cuBLASLt plan cache
// (loom/ops/gemm.hpp: plans per problem, shared by linears of one shape,
// variable-row linears planned per bucket of row counts, GemmAlgo::fastest
// timed once per problem). This class keeps what is a linear's: its
// registration, the dtypes the recipe stores, and the checks that name the
// linear in every message. Forward also takes a residual as the C input
// (y = x W^T + residual): y itself, or a buffer sharing no element with y,
// with its own row stride.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/context.hpp"
#include "loom/gemm_algo.hpp"
#include "loom/dtype.hpp"
#include "loom/ops/gemm.hpp"
#include "loom/precision.hpp"
#include "loom/tensor.hpp"

namespace loom::precision_common {

// What a recipe stores where; the engine checks every tensor against it.
struct GemmDTypes {
  DType activation;  // x, y, dy, dx
  DType param;       // W
  DType grad;        // dW
};

class CublasLtLinears {
 public:
  static constexpr size_t kWorkspaceBytes = ops::GemmPlans::kWorkspaceBytes;

  // `recipe` names the plugin in messages ("bf16").
  CublasLtLinears(std::string recipe, GemmDTypes dtypes, GemmAlgo algo = GemmAlgo::heuristic);
  ~CublasLtLinears();
  CublasLtLinears(const CublasLtLinears&) = delete;
  CublasLtLinears& operator=(const CublasLtLinears&) = delete;

  int register_linear(const LinearDesc& desc);
  // The device buffer every GEMM of this object uses (at least 256-byte aligned).
  void set_workspace(void* ptr, size_t bytes);

  // y = x W^T (+ residual: the C input with beta = 1; may be y itself or a row view).
  void forward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, Tensor& y, const Tensor* residual);
  void backward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx,
                Tensor& dw, bool accumulate);

  // Plans built (= heuristic queries made) by this object so far.
  int64_t plans_built() const { return plans_.plans_built(); }
  GemmAlgo algo_choice() const { return plans_.algo(); }
  // GemmAlgo::fastest: problems timed so far, and how many of them took an
  // algorithm other than the heuristic's first.
  int64_t problems_timed() const { return plans_.plans_timed(); }
  int64_t problems_switched() const { return plans_.plans_switched(); }

 private:
  enum Gemm { kFprop = 0, kDgrad = 1, kWgrad = 2 };
  const LinearDesc& lookup(const ExecContext& ctx, int id) const;
  void run(const ExecContext& ctx, int id, Gemm g, ops::GemmArgs& args);

  std::string recipe_;
  GemmDTypes dtypes_;
  std::vector<LinearDesc> linears_;
  std::vector<std::array<std::string, 3>> what_;  // "<recipe>: <linear>: fprop" per linear and GEMM, for messages
  ops::GemmPlans plans_;
  bool workspace_set_ = false;
};

}  // namespace loom::precision_common

// Plans built by every CublasLtLinears in the calling plugin library, exported
// from each plugin that links this library so that tests can prove that
// repeated calls reuse their plan (dlsym on the loaded plugin).
extern "C" __attribute__((visibility("default"))) int64_t loom_precision_cublaslt_plans_built();
