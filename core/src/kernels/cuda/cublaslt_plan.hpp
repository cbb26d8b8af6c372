// What the core's cuBLASLt GEMM wrappers share (fp8_gemm.cpp,
// fp8_block_gemm.cpp, and the precision plugins' cublaslt_linear.cpp): the
// status check that names the failed call, and the descriptor objects of one
// matmul plan, destroyed with it, the alignment an operand's address gives,
// the row bucket of a variable-row GEMM, and the timing of a plan's candidate
// algorithms.
#pragma once
#include <cublasLt.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "loom/error.hpp"
#include "loom/gemm_algo.hpp"

// Throws a loom::Error naming `where`, the call and cuBLASLt's status.
#define LOOM_CUBLASLT_CHECK(call, where)                                                                        \
  do {                                                                                                          \
    const cublasStatus_t st_ = (call);                                                                          \
    LOOM_CHECK(st_ == CUBLAS_STATUS_SUCCESS, where, ": ", #call, " failed: ", cublasLtGetStatusName(st_), " (", \
               cublasLtGetStatusString(st_), ")");                                                              \
  } while (0)

namespace loom::gpu {

// Largest power of two (capped at 256, cuBLASLt's default assumption)
// dividing the address: what a plan records as an operand's alignment.
inline uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && (a % al) != 0) al /= 2;
  return al;
}

// The row count a plan of a variable-row GEMM is built for (an MoE expert's
// token count changes every call; its plan serves a bucket of counts): rows
// (>= 1) rounded up to a multiple of 256 up to 2048, above that to an eighth
// of the largest power of two <= rows (at most 12.5% more rows), and never
// above most. Eight buckets per doubling above 2048. Multiples of 16 stay
// multiples of 16 (FP8 GEMMs) as long as most is one.
inline int64_t row_bucket(int64_t rows, int64_t most) {
  int64_t p = 1;
  while (p <= rows / 2) p *= 2;
  const int64_t q = p / 8 > 256 ? p / 8 : 256;
  const int64_t b = (rows + q - 1) / q * q;
  return b < most ? b : most;
}

// The matmul descriptor and the A, B, C, D layouts of one plan (C null: C
// uses D's layout). Host-side objects only: their destruction cannot fail in
// a way worth reporting at teardown.
struct LtMatmulObjects {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatrixLayout_t c_layout() const { return c ? c : d; }
  void destroy_op() {
    if (op) cublasLtMatmulDescDestroy(op);
    op = nullptr;
  }
  LtMatmulObjects() = default;
  LtMatmulObjects(const LtMatmulObjects&) = delete;
  LtMatmulObjects& operator=(const LtMatmulObjects&) = delete;
  ~LtMatmulObjects() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (d) cublasLtMatrixLayoutDestroy(d);
    destroy_op();
  }
};

// GemmAlgo::fastest for a plan (loom/gemm_algo.hpp): the index of the
// fastest of the heuristic's `found` answers for D = op(A) op(B) (+ beta C),
// timed with cuBLASLt's A and B as given and D — and C where it has a layout
// of its own — in a scratch of d_bytes (+ c_bytes). Answers that do not fit
// the workspace or failed the heuristic are never picked.
inline int fastest_algorithm(cublasLtHandle_t handle, const LtMatmulObjects& p,
                             const cublasLtMatmulHeuristicResult_t* cand, int found, const void* lt_a,
                             const void* lt_b, float beta, size_t d_bytes, size_t c_bytes, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream, const std::string& where) {
  const float one = 1.0f;
  return time_gemm_candidates(
      stream, found, d_bytes + c_bytes,
      [&](int i, void* scratch) {
        const cublasLtMatmulHeuristicResult_t& r = cand[i];
        if (r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > workspace_bytes) return false;
        const void* sc = p.c ? static_cast<const char*>(scratch) + d_bytes : scratch;
        return cublasLtMatmul(handle, p.op, &one, lt_a, p.a, lt_b, p.b, &beta, sc, p.c_layout(), scratch, p.d,
                              &r.algo, workspace, workspace_bytes, stream) == CUBLAS_STATUS_SUCCESS;
      },
      where);
}

}  // namespace loom::gpu
