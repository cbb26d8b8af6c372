// RMSNorm (Llama): out = x / sqrt(mean(x^2) + eps) * w, no mean subtraction, no bias.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/cpu_kernels.hpp"

namespace loom::cpu {
namespace {

template <typename T>
void rmsnorm_forward_t(T* out, T* rstd, const T* x, const T* w, int64_t N, int64_t h, double eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * h;
    // Mean of squares in double: the reference should not carry fp32
    // summation error over h ~ 4096 terms.
    double ss = 0.0;
    for (int64_t j = 0; j < h; ++j) ss += static_cast<double>(xr[j]) * xr[j];
    const T r = static_cast<T>(1.0 / std::sqrt(ss / static_cast<double>(h) + eps));
    rstd[n] = r;
    // HF order: (x * rstd) rounded to the input type, then times the weight.
    T* o = out + n * h;
    for (int64_t j = 0; j < h; ++j) o[j] = static_cast<T>(xr[j] * r) * w[j];
  }
}

// With y_j = x_j r w_j and r = (mean(x^2) + eps)^(-1/2), dr/dx_i = -r^3 x_i / h, so
//   dx_i = r w_i dy_i - r^3 x_i / h * sum_j dy_j w_j x_j
//   dw_j = sum_n dy_nj x_nj r_n
template <typename T>
void rmsnorm_backward_t(T* dx, T* dw, const T* dout, const T* x, const T* w, const T* rstd, int64_t N, int64_t h) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * h;
    const T* dy = dout + n * h;
    const double r = rstd[n];
    double dot = 0.0;
    for (int64_t j = 0; j < h; ++j) dot += static_cast<double>(dy[j]) * w[j] * xr[j];
    const double c = r * r * r * dot / static_cast<double>(h);
    T* d = dx + n * h;
    for (int64_t j = 0; j < h; ++j) d[j] += static_cast<T>(r * w[j] * dy[j] - c * xr[j]);
  }
  // dw sums over rows: each thread owns a block of columns and walks n in
  // order, so the sum order is fixed (no per-thread partials).
  constexpr int64_t kCols = 64;
  const int64_t nblocks = (h + kCols - 1) / kCols;
#pragma omp parallel for schedule(static)
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    const int64_t j0 = blk * kCols, j1 = std::min(h, j0 + kCols);
    double acc[kCols] = {};
    for (int64_t n = 0; n < N; ++n) {
      const T* xr = x + n * h;
      const T* dy = dout + n * h;
      const double r = rstd[n];
      for (int64_t j = j0; j < j1; ++j) acc[j - j0] += static_cast<double>(dy[j]) * xr[j] * r;
    }
    for (int64_t j = j0; j < j1; ++j) dw[j] += static_cast<T>(acc[j - j0]);
  }
}

}  // namespace

void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t N, int64_t h, float eps) {
  rmsnorm_forward_t(out, rstd, x, w, N, h, eps);
}
void rmsnorm_forward(double* out, double* rstd, const double* x, const double* w, int64_t N, int64_t h,
                     double eps) {
  rmsnorm_forward_t(out, rstd, x, w, N, h, eps);
}
void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w, const float* rstd,
                      int64_t N, int64_t h) {
  rmsnorm_backward_t(dx, dw, dout, x, w, rstd, N, h);
}
void rmsnorm_backward(double* dx, double* dw, const double* dout, const double* x, const double* w,
                      const double* rstd, int64_t N, int64_t h) {
  rmsnorm_backward_t(dx, dw, dout, x, w, rstd, N, h);
}

}  // namespace loom::cpu
