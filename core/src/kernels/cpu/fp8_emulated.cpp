// Emulated FP8 GEMMs (loom/fp8_emulated.hpp): quantise-dequantise each operand
// into the workspace, then the fp32 recipe's GEMM (loom/cpu_gemm.hpp).
#include "loom/fp8_emulated.hpp"

#include <algorithm>

#include "loom/cpu_gemm.hpp"
#include "loom/error.hpp"

namespace loom::fp8 {
namespace {

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

namespace {

// The two operands of one GEMM cast into the workspace (a [a_rows, a_cols]
// copy, then b's [b_rows, b_cols]), with their amaxes.
struct Cast {
  const float* a;
  const float* b;
  int64_t lda, ldb;  // row strides of a and b as the GEMM reads them
  OperandAmax amax;
};
Cast cast_pair(const Operand& a, int64_t a_rows, int64_t a_cols, const char* a_name, const Operand& b, int64_t b_rows,
               int64_t b_cols, const char* b_name, int64_t m, int64_t k, int64_t n, float* workspace) {
  check_operand(a, a_cols, a_name);
  check_operand(b, b_cols, b_name);
  check_workspace(workspace, m, k, n);
  float* qa = workspace;
  float* qb = workspace + a_rows * a_cols;
  Cast c{qa, qb, std::max<int64_t>(a_cols, 1), std::max<int64_t>(b_cols, 1), {0.0f, 0.0f}};
  if (a.cast) c.a = a.data, c.lda = a.ld;
  else c.amax.first = quantize_rows(a, a_rows, a_cols, qa);
  if (b.cast) c.b = b.data, c.ldb = b.ld;
  else c.amax.second = quantize_rows(b, b_rows, b_cols, qb);
  return c;
}

}  // namespace

// The products are the fp32 recipe's (loom/cpu_gemm.hpp) on the cast copies,
// which are contiguous (their row strides are their row lengths), or on an
// operand passed already cast, with its own row stride (w must be contiguous).
OperandAmax emulated_linear_forward(float* y, int64_t ldy, const Operand& x, const Operand& w, int64_t m, int64_t k,
                                    int64_t n, bool accumulate, float* workspace) {
  const Cast c = cast_pair(x, m, k, "x", w, n, k, "w", m, k, n, workspace);
  LOOM_CHECK(c.ldb == std::max<int64_t>(k, 1), "fp8 emulated gemm: a cast w must be contiguous [n, k] (row stride ",
             c.ldb, ", k = ", k, ")");
  cpu::linear_forward(y, ldy, c.a, c.lda, c.b, m, k, n, accumulate);
  return c.amax;
}

OperandAmax emulated_linear_backward_input(float* dx, int64_t lddx, const Operand& dy, const Operand& w, int64_t m,
                                           int64_t k, int64_t n, float* workspace) {
  const Cast c = cast_pair(dy, m, n, "dy", w, n, k, "w", m, k, n, workspace);
  LOOM_CHECK(c.ldb == std::max<int64_t>(k, 1), "fp8 emulated gemm: a cast w must be contiguous [n, k] (row stride ",
             c.ldb, ", k = ", k, ")");
  cpu::linear_backward_input(dx, lddx, c.a, c.lda, c.b, m, k, n);
  return c.amax;
}

OperandAmax emulated_linear_backward_weight(float* dw, const Operand& dy, const Operand& x, int64_t m, int64_t k,
                                            int64_t n, bool accumulate, float* workspace) {
  const Cast c = cast_pair(dy, m, n, "dy", x, m, k, "x", m, k, n, workspace);
  cpu::linear_backward_weight(dw, c.a, c.lda, c.b, c.ldb, m, k, n, accumulate);
  return c.amax;
}

}  // namespace loom::fp8
