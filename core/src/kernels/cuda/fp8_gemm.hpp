// FP8 GEMMs through cuBLASLt (fp8_gemm.cpp), the building block of the FP8
// recipes on Hopper:
//
//   D[m, n] = a_inv_scale * b_inv_scale * (A[m, k] B[n, k]^T)  (+ C[m, n], beta = 1)
//
// A and B row-major FP8 (e4m3 or e5m2) with k, the contracted dimension,
// contiguous in both ("K-major"); D (and C) row-major bf16 or fp32. The
// inverse scales are device floats (ScalingState's scale_inv slots), read by
// cuBLASLt through CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER, so a scale update
// on the device needs no host round trip.
//
// Why this one form. On sm_89/sm_90, cuBLASLt's FP8 kernels are "TN" only:
// column-major op(A) = A^T, op(B) = B. A row-major [r, c] matrix is, byte for
// byte, the column-major [c, r] one, so the row-major product above is
// cuBLASLt's D^T[n, m] = (B buffer as k x n)^T (A buffer as k x m): cuBLASLt's
// A is our B (TRANSA = T) and its B is our A (TRANSB = N), M' = n, N' = m,
// K' = k. Any other layout needs a transposed copy, which the cast kernels
// write in the same pass (fp8_cast's q_t).
//
// A linear (loom/precision.hpp: W [out, in] row-major, x [tokens, in],
// y/dy [tokens, out]) maps its three GEMMs onto this form as:
//
//   fprop  y  = x W^T     : A = x_fp8   [tokens, in],   B = W_fp8   [out, in]     m=tokens n=out k=in
//   dgrad  dx = dy W      : A = dy_fp8  [tokens, out],  B = W^T_fp8 [in, out]     m=tokens n=in  k=out
//   wgrad  dW = dy^T x    : A = dy^T_fp8 [out, tokens], B = x^T_fp8 [in, tokens]  m=out    n=in  k=tokens
//
// so the x cast writes x and x^T (x^T is kept for wgrad), the weight cast W
// and W^T (once per optimizer step, reused by every micro-batch), and the dy
// cast dy and dy^T. With the "hybrid" formats dy is E5M2 and x, W are E4M3:
// fprop is E4M3 x E4M3, dgrad and wgrad E5M2 (A) x E4M3 (B). cuBLASLt has no
// E5M2 x E5M2 kernel; that pair is refused. Fast accumulation (FP8 tensor-core
// partial sums kept in reduced precision instead of promoted to fp32 every few
// k-steps) is what TransformerEngine uses for fprop only; dgrad and wgrad
// sum gradients and keep full accumulation. wgrad's beta = 1 (C = D = dW)
// accumulates micro-batches; fprop's C can be the residual.
//
// Requirements (each refused with a loom::Error naming the values): m, n, k
// positive multiples of 16; A, B, C, D 16-byte aligned, leading dimensions
// multiples of 16 bytes (lda, ldb multiples of 16 elements; ldc, ldd of 8 for
// bf16, 4 for fp32); A and B FP8, not both E5M2; C of D's dtype and shape,
// either D itself (same row stride) or sharing no byte with it; scale and
// amax pointers device floats (4-byte aligned). cuBLASLt also needs compute
// capability 8.9 or newer.
//
// D amax (optional): *d_amax is overwritten with max |D| of this call (the
// slot is zeroed first), by cuBLASLt's CUBLASLT_MATMUL_DESC_AMAX_D_POINTER
// when it takes it for the problem; where it refuses (no algorithm, or
// CUBLAS_STATUS_INVALID_VALUE for a non-FP8 D), the plan falls back to an
// fp8_amax pass over D after the GEMM (amax_fused() says which). NaN in D:
// see fp8_amax.
//
// Plans (matmul descriptor, layouts, and the algorithm: the heuristic's first
// answer, or with GemmAlgo::fastest the fastest of its first answers, timed
// once when the plan is built on a scratch D) are cached
// per problem key (shape, leading dims, dtypes, pointer alignments, C, amax,
// fast accumulation): a repeated call issues one cublasLtMatmul (plus the
// amax pass when not fused) and allocates nothing; the scale and amax
// pointers are set on the cached descriptor only when they change. One
// thread per object. The workspace (32 MiB for Hopper, as TE and llm.c) and
// the cublasLtHandle_t come from the caller.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "loom/gemm_algo.hpp"
#include "loom/tensor.hpp"

namespace loom::gpu {

// Which dim of a call changes from call to call: the token count of a
// variable-row linear (an MoE expert), m in fprop and dgrad, k in wgrad.
enum class Fp8Varying : uint8_t { none, m, k };

struct Fp8GemmOptions {
  const Tensor* c = nullptr;  // added with beta = 1; D itself or a disjoint buffer
  float* d_amax = nullptr;    // overwritten with max |D| (see above)
  bool fast_accum = false;    // CUBLASLT_MATMUL_DESC_FAST_ACCUM
  // A varying dim (<= varying_max): the plan is built for a bucket of its
  // values (fp8_gemm.cpp) and takes the call's value in its layouts, with the
  // heuristic's answer under every GemmAlgo, so that the counts of a run build
  // a few plans in all rather than one (and a timing) per count.
  Fp8Varying varying = Fp8Varying::none;
  int64_t varying_max = 0;
};

class Fp8Gemm {
 public:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  // cuBLASLt's FP8 kernels read the A/B scale pointers as 16-byte aligned
  // (measured on an H100 with cuBLASLt 13.1: a scale 4 or 8 bytes past a
  // 16-byte boundary makes cublasLtMatmul return CUBLAS_STATUS_NOT_SUPPORTED
  // although the heuristic offered the algorithm). A recipe's scales are one
  // contiguous float per tensor, so a scale that is not 16-byte aligned is
  // first copied (4 bytes, on the GEMM's stream) into one of two aligned
  // slots carved from the end of the workspace.
  static constexpr size_t kScaleSlotBytes = 256;

  // handle: a cublasLtHandle_t (void* so that this header needs no cuBLASLt).
  // workspace: device memory, 256-byte aligned, used by every GEMM of this object.
  // algo: the heuristic's first answer, or the fastest of its first answers,
  // timed once per problem when its plan is built (loom/gemm_algo.hpp; D and
  // C in a scratch, the amax slot reset before the real call as always).
  Fp8Gemm(void* cublaslt_handle, void* workspace, size_t workspace_bytes, GemmAlgo algo = GemmAlgo::heuristic);
  ~Fp8Gemm();
  Fp8Gemm(const Fp8Gemm&) = delete;
  Fp8Gemm& operator=(const Fp8Gemm&) = delete;

  void set_workspace(void* workspace, size_t bytes);

  // D = a_inv_scale * b_inv_scale * A B^T (+ C): A [m, k], B [n, k], D [m, n]
  // (row views allowed: fold_rows). See the file comment for what is refused.
  void gemm(const Tensor& a, const float* a_inv_scale, const Tensor& b, const float* b_inv_scale, Tensor& d,
            const Fp8GemmOptions& opt, cudaStream_t stream);

  // Plans built (heuristic queries made) so far; a repeated call builds none.
  int64_t plans_built() const { return plans_built_; }
  // Whether the plan of the last gemm() had cuBLASLt compute the D amax (false:
  // the fp8_amax fallback ran, or no amax was asked for).
  bool amax_fused() const { return last_amax_fused_; }
  // The cuBLASLt algorithm's workspace need for the last gemm().
  size_t last_workspace_needed() const { return last_workspace_needed_; }

  struct Plan;  // fp8_gemm.cpp (holds cuBLASLt handles)

 private:
  void* handle_;
  void* workspace_;
  size_t workspace_bytes_;       // cuBLASLt's part of the workspace
  GemmAlgo algo_ = GemmAlgo::heuristic;
  float* scale_slots_ = nullptr;  // the workspace's last kScaleSlotBytes: 16-byte aligned copies of the scales
  std::vector<std::unique_ptr<Plan>> plans_;
  int64_t plans_built_ = 0;
  bool last_amax_fused_ = false;
  size_t last_workspace_needed_ = 0;
};

}  // namespace loom::gpu
