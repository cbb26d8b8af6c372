// fp32 (and float64, for the gradient tests) GEMMs of a linear layer on the
// CPU, through CBLAS: the fp32 recipe's GEMMs, and the product of the
// emulated FP8 GEMMs (loom/fp8_emulated.hpp) once their operands are cast. HF layout: W is [n_out, k_in] row-major and y = x W^T.
//
// Every matrix is row-major with its innermost dimension contiguous; ld* is
// the row stride in elements (>= the row length), so views into a wider
// buffer (e.g. one slice of a fused QKV activation) need no copy.
#pragma once
#include <cstdint>

namespace loom::cpu {

// y[m, n] = x[m, k] W[n, k]^T, added to y when accumulate (the residual a fused layer put there)
void linear_forward(float* y, int64_t ldy, const float* x, int64_t ldx, const float* w, int64_t m, int64_t k,
                    int64_t n, bool accumulate = false);
void linear_forward(double* y, int64_t ldy, const double* x, int64_t ldx, const double* w, int64_t m, int64_t k,
                    int64_t n, bool accumulate = false);

// dx[m, k] = dy[m, n] W[n, k]   (written)
void linear_backward_input(float* dx, int64_t lddx, const float* dy, int64_t lddy, const float* w, int64_t m,
                           int64_t k, int64_t n);
void linear_backward_input(double* dx, int64_t lddx, const double* dy, int64_t lddy, const double* w, int64_t m,
                           int64_t k, int64_t n);

// dW[n, k] = dy[m, n]^T x[m, k], added to dW when accumulate (micro-batches), else written.
void linear_backward_weight(float* dw, const float* dy, int64_t lddy, const float* x, int64_t ldx, int64_t m,
                            int64_t k, int64_t n, bool accumulate);
void linear_backward_weight(double* dw, const double* dy, int64_t lddy, const double* x, int64_t ldx, int64_t m,
                            int64_t k, int64_t n, bool accumulate);

}  // namespace loom::cpu
