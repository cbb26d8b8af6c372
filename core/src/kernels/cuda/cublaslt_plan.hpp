// What the core's cuBLASLt GEMM wrappers share (fp8_gemm.cpp,
// fp8_block_gemm.cpp): the status check that names the failed call, and the
// descriptor objects of one matmul plan, destroyed with it, and the alignment
// an operand's address gives.
#pragma once
#include <cublasLt.h>

#include <cstdint>

#include "loom/error.hpp"

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

}  // namespace loom::gpu
