// The three GEMMs of a linear layer mapped onto row-major CBLAS calls.
// m = rows (tokens), k = in features, n = out features.
#include "loom/cpu_gemm.hpp"

#include <cblas.h>

#include <climits>

#include "loom/error.hpp"

namespace loom::cpu {
namespace {

// CBLAS takes int dimensions (LP64 OpenBLAS): refuse what would silently wrap.
blasint to_blas(int64_t v, const char* what) {
  LOOM_CHECK(v >= 0 && v <= INT_MAX, "cpu gemm: ", what, "=", v, " does not fit the BLAS int range [0, ", INT_MAX,
             "]");
  return static_cast<blasint>(v);
}

void check_ld(int64_t ld, int64_t cols, const char* what) {
  LOOM_CHECK(ld >= cols && ld >= 1, "cpu gemm: row stride of ", what, " is ", ld, ", smaller than its ", cols,
             " columns");
}

// Overloads so that one template body serves float and double.
void gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, blasint M, blasint N, blasint K, float alpha, const float* A,
          blasint lda, const float* B, blasint ldb, float beta, float* C, blasint ldc) {
  cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
void gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, blasint M, blasint N, blasint K, double alpha, const double* A,
          blasint lda, const double* B, blasint ldb, double beta, double* C, blasint ldc) {
  cblas_dgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

template <typename T>
void forward_t(T* y, int64_t ldy, const T* x, int64_t ldx, const T* w, int64_t m, int64_t k, int64_t n,
               bool accumulate) {
  check_ld(ldy, n, "y");
  check_ld(ldx, k, "x");
  if (m == 0 || n == 0) return;
  // y[m,n] = x[m,k] * (W[n,k])^T (+ y: beta = 1 adds the residual already in y)
  gemm(CblasNoTrans, CblasTrans, to_blas(m, "m"), to_blas(n, "n"), to_blas(k, "k"), T(1), x, to_blas(ldx, "ldx"), w,
       to_blas(k, "k"), accumulate ? T(1) : T(0), y, to_blas(ldy, "ldy"));
}

template <typename T>
void backward_input_t(T* dx, int64_t lddx, const T* dy, int64_t lddy, const T* w, int64_t m, int64_t k, int64_t n) {
  check_ld(lddx, k, "dx");
  check_ld(lddy, n, "dy");
  if (m == 0 || k == 0) return;
  // dx[m,k] = dy[m,n] * W[n,k]
  gemm(CblasNoTrans, CblasNoTrans, to_blas(m, "m"), to_blas(k, "k"), to_blas(n, "n"), T(1), dy, to_blas(lddy, "lddy"),
       w, to_blas(k, "k"), T(0), dx, to_blas(lddx, "lddx"));
}

template <typename T>
void backward_weight_t(T* dw, const T* dy, int64_t lddy, const T* x, int64_t ldx, int64_t m, int64_t k, int64_t n,
                       bool accumulate) {
  check_ld(lddy, n, "dy");
  check_ld(ldx, k, "x");
  if (n == 0 || k == 0) return;
  // dW[n,k] = dy[m,n]^T * x[m,k]; beta = 1 adds onto the previous micro-batches.
  // With m == 0 BLAS scales C by beta, which is the right answer (0 or unchanged).
  gemm(CblasTrans, CblasNoTrans, to_blas(n, "n"), to_blas(k, "k"), to_blas(m, "m"), T(1), dy, to_blas(lddy, "lddy"), x,
       to_blas(ldx, "ldx"), accumulate ? T(1) : T(0), dw, to_blas(k, "k"));
}

}  // namespace

void linear_forward(float* y, int64_t ldy, const float* x, int64_t ldx, const float* w, int64_t m, int64_t k,
                    int64_t n, bool accumulate) {
  forward_t(y, ldy, x, ldx, w, m, k, n, accumulate);
}
void linear_forward(double* y, int64_t ldy, const double* x, int64_t ldx, const double* w, int64_t m, int64_t k,
                    int64_t n, bool accumulate) {
  forward_t(y, ldy, x, ldx, w, m, k, n, accumulate);
}
void linear_backward_input(float* dx, int64_t lddx, const float* dy, int64_t lddy, const float* w, int64_t m,
                           int64_t k, int64_t n) {
  backward_input_t(dx, lddx, dy, lddy, w, m, k, n);
}
void linear_backward_input(double* dx, int64_t lddx, const double* dy, int64_t lddy, const double* w, int64_t m,
                           int64_t k, int64_t n) {
  backward_input_t(dx, lddx, dy, lddy, w, m, k, n);
}
void linear_backward_weight(float* dw, const float* dy, int64_t lddy, const float* x, int64_t ldx, int64_t m,
                            int64_t k, int64_t n, bool accumulate) {
  backward_weight_t(dw, dy, lddy, x, ldx, m, k, n, accumulate);
}
void linear_backward_weight(double* dw, const double* dy, int64_t lddy, const double* x, int64_t ldx, int64_t m,
                            int64_t k, int64_t n, bool accumulate) {
  backward_weight_t(dw, dy, lddy, x, ldx, m, k, n, accumulate);
}

}  // namespace loom::cpu
