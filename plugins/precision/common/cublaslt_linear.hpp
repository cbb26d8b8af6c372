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
// Every (linear id, GEMM) pair keeps a plan: the matmul descriptor, the matrix
// layouts (C shares D's unless a residual has its own leading dimension) and
// the heuristic's best algorithm for the workspace handed in. A plan is built
// on first use and never rebuilt; a call whose shape, leading dimensions or
// pointer alignment differ from every plan of its slot gets a new plan beside
// the others (the model never does this in a step, so steady state issues
// exactly one cublasLtMatmul per GEMM and no heuristic query). Variable-row
// linears (MoE experts) share plans built per bucket of row counts instead,
// all of a problem's buckets at its first call (the .cpp says how). Forward also
// takes a residual as the C input (y = x W^T + residual): y itself, or a
// buffer sharing no element with y, with its own row stride.
//
// Which algorithm a plan takes (precision.gemm_algo, loom/gemm_algo.hpp): the
// heuristic's first answer, or the fastest of its first kGemmAlgoCandidates
// answers, timed once when the plan is built on the call's own operands (D
// and C in a scratch buffer, so the call's output and an accumulated dW are
// untouched) and shared by every later plan of the same problem.
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
  // llm.c and TransformerEngine hand cuBLASLt 32 MiB: Hopper kernels need it.
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

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
  int64_t plans_built() const { return plans_built_; }
  GemmAlgo algo_choice() const { return algo_; }
  // GemmAlgo::fastest: problems timed so far, and how many of them took an
  // algorithm other than the heuristic's first.
  int64_t problems_timed() const { return static_cast<int64_t>(timed_.size()); }
  int64_t problems_switched() const;

  struct Plan;  // defined in the .cpp (holds cuBLASLt handles)

 private:
  enum Gemm { kFprop = 0, kDgrad = 1, kWgrad = 2 };
  struct Slot;
  const LinearDesc& lookup(const ExecContext& ctx, int id) const;
  // Finds or builds the plan for this call, then runs D = alpha op(A) op(B) + beta C
  // (C has D's shape and dtype; it is D itself except for a fused residual).
  void matmul(const ExecContext& ctx, int id, Gemm g, int64_t rows, int64_t cols, int64_t inner, const void* a,
              int64_t lda, const void* b, int64_t ldb, const void* c, int64_t ldc, void* d, int64_t ldd, float beta);

  struct Timed;  // a problem timed once: its key and the algorithm picked

  std::string recipe_;
  GemmDTypes dtypes_;
  GemmAlgo algo_ = GemmAlgo::heuristic;
  std::vector<std::unique_ptr<Timed>> timed_;
  std::vector<LinearDesc> linears_;
  std::vector<std::unique_ptr<Slot>> slots_;  // one per linear, 3 GEMMs each
  // Variable-row linears' plans, per GEMM, shared by every such linear of the
  // same problem (keyed by the row bucket in m's place: the .cpp's comment).
  std::array<std::vector<std::unique_ptr<Plan>>, 3> variable_plans_;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  bool workspace_set_ = false;
  int64_t plans_built_ = 0;
};

}  // namespace loom::precision_common

// Plans built by every CublasLtLinears in the calling plugin library, exported
// from each plugin that links this library so that tests can prove that
// repeated calls reuse their plan (dlsym on the loaded plugin).
extern "C" __attribute__((visibility("default"))) int64_t loom_precision_cublaslt_plans_built();
