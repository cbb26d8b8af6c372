// Global-norm helpers for gradient clipping: the sum of squares of a buffer
// and an in-place scale.
#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/fixed_order.hpp"

namespace loom::cpu {
namespace {

template <typename T>
double sq_norm_t(const T* x, int64_t n) {
  // Fixed-length chunks summed in a fixed order: the clipping factor, and so
  // every parameter after the step, is bitwise independent of the thread count.
  constexpr int64_t kChunk = 4096;
  return detail::fixed_order_sum(n, kChunk, [x](int64_t begin, int64_t end) {
    double s = 0.0;
    for (int64_t i = begin; i < end; ++i) s += static_cast<double>(x[i]) * x[i];
    return s;
  });
}

template <typename T>
void scale_t(T* x, T s, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

}  // namespace

double sq_norm(const float* x, int64_t n) { return sq_norm_t(x, n); }
double sq_norm(const double* x, int64_t n) { return sq_norm_t(x, n); }
void scale(float* x, float s, int64_t n) { scale_t(x, s, n); }
void scale(double* x, double s, int64_t n) { scale_t(x, s, n); }

}  // namespace loom::cpu
