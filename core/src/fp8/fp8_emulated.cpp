// Emulated FP8 GEMMs (loom/fp8_emulated.hpp): quantise-dequantise each operand
// into the workspace, then one row-major sgemm, as the fp32 recipe maps its
// three GEMMs onto CBLAS.
#include "loom/fp8_emulated.hpp"

#include <cblas.h>

#include <algorithm>
#include <climits>

#include "loom/error.hpp"

namespace loom::fp8 {
namespace {

blasint to_blas(int64_t v, const char* what) {
  LOOM_CHECK(v >= 0 && v <= INT_MAX, "fp8 emulated gemm: ", what, "=", v, " does not fit the BLAS int range [0, ",
             INT_MAX, "]");
  return static_cast<blasint>(v);
}

void check_operand(const Operand& a, int64_t cols, const char* what) {
  LOOM_CHECK(a.ld >= cols && a.ld >= 1, "fp8 emulated gemm: row stride of ", what, " is ", a.ld, ", smaller than its ",
             cols, " columns");
  // A scale of 0, inf or NaN would turn every value into 0 or NaN silently.
  LOOM_CHECK(a.scale > 0.0f && is_finite(a.scale), "fp8 emulated gemm: scale of ", what, " is ", a.scale,
             "; a scale must be positive and finite");
}

void check_workspace(const float* workspace, int64_t m, int64_t k, int64_t n) {
  LOOM_CHECK(workspace != nullptr || emulated_workspace_floats(m, k, n) == 0,
             "fp8 emulated gemm: no workspace for m=", m, " k=", k, " n=", n, ", which needs ",
             emulated_workspace_floats(m, k, n), " floats");
}

void check_ld(int64_t ld, int64_t cols, const char* what) {
  LOOM_CHECK(ld >= cols && ld >= 1, "fp8 emulated gemm: row stride of ", what, " is ", ld, ", smaller than its ", cols,
             " columns");
}

// q(a) of a [rows, cols] view into a contiguous [rows, cols] buffer; returns amax.
float quantize_rows(const Operand& a, int64_t rows, int64_t cols, float* out) {
  if (a.ld == cols) return quantize_dequantize(a.data, rows * cols, a.scale, a.format, out);
  float m = 0.0f;
  bool nan = false;
  for (int64_t r = 0; r < rows; ++r) {
    const float ra = quantize_dequantize(a.data + r * a.ld, cols, a.scale, a.format, out + r * cols);
    if (is_nan(ra)) nan = true;
    else m = std::max(m, ra);
  }
  return nan ? bits_float(0x7FC00000u) : m;
}

}  // namespace

int64_t emulated_workspace_floats(int64_t m, int64_t k, int64_t n) {
  LOOM_CHECK(m >= 0 && k >= 0 && n >= 0, "fp8 emulated gemm: negative shape m=", m, " k=", k, " n=", n);
  return std::max({m * k + n * k, m * n + n * k, m * n + m * k});
}

OperandAmax emulated_linear_forward(float* y, int64_t ldy, const Operand& x, const Operand& w, int64_t m, int64_t k,
                                    int64_t n, bool accumulate, float* workspace) {
  check_ld(ldy, n, "y");
  check_operand(x, k, "x");
  check_operand(w, k, "w");
  check_workspace(workspace, m, k, n);
  float* qx = workspace;
  float* qw = workspace + m * k;
  const OperandAmax amax{quantize_rows(x, m, k, qx), quantize_rows(w, n, k, qw)};
  if (m == 0 || n == 0) return amax;
  // y[m,n] = q(x)[m,k] * q(W)[n,k]^T (+ y: beta = 1 adds the residual already in y)
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, to_blas(m, "m"), to_blas(n, "n"), to_blas(k, "k"), 1.0f, qx,
              to_blas(std::max<int64_t>(k, 1), "k"), qw, to_blas(std::max<int64_t>(k, 1), "k"),
              accumulate ? 1.0f : 0.0f, y, to_blas(ldy, "ldy"));
  return amax;
}

OperandAmax emulated_linear_backward_input(float* dx, int64_t lddx, const Operand& dy, const Operand& w, int64_t m,
                                           int64_t k, int64_t n, float* workspace) {
  check_ld(lddx, k, "dx");
  check_operand(dy, n, "dy");
  check_operand(w, k, "w");
  check_workspace(workspace, m, k, n);
  float* qdy = workspace;
  float* qw = workspace + m * n;
  const OperandAmax amax{quantize_rows(dy, m, n, qdy), quantize_rows(w, n, k, qw)};
  if (m == 0 || k == 0) return amax;
  // dx[m,k] = q(dy)[m,n] * q(W)[n,k]; with n == 0 BLAS writes zeros (beta = 0).
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, to_blas(m, "m"), to_blas(k, "k"), to_blas(n, "n"), 1.0f, qdy,
              to_blas(std::max<int64_t>(n, 1), "n"), qw, to_blas(k, "k"), 0.0f, dx, to_blas(lddx, "lddx"));
  return amax;
}

OperandAmax emulated_linear_backward_weight(float* dw, const Operand& dy, const Operand& x, int64_t m, int64_t k,
                                            int64_t n, bool accumulate, float* workspace) {
  check_operand(dy, n, "dy");
  check_operand(x, k, "x");
  check_workspace(workspace, m, k, n);
  float* qdy = workspace;
  float* qx = workspace + m * n;
  const OperandAmax amax{quantize_rows(dy, m, n, qdy), quantize_rows(x, m, k, qx)};
  if (n == 0 || k == 0) return amax;
  // dW[n,k] = q(dy)[m,n]^T * q(x)[m,k]; beta = 1 adds onto the previous micro-batches
  // (with m == 0 BLAS scales dW by beta: 0 or unchanged, the right answer).
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, to_blas(n, "n"), to_blas(k, "k"), to_blas(m, "m"), 1.0f, qdy,
              to_blas(n, "n"), qx, to_blas(k, "k"), accumulate ? 1.0f : 0.0f, dw, to_blas(k, "k"));
  return amax;
}

}  // namespace loom::fp8
