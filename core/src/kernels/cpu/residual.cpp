// Residual stream: the forward add, and the gradient add where two paths meet.
#include "kernels/cpu/cpu_kernels.hpp"

namespace loom::cpu {
namespace {

template <typename T>
void residual_forward_t(T* out, const T* a, const T* b, int64_t n) {
  // Elementwise, so out may alias a (each element is read before it is written).
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

template <typename T>
void accumulate_t(T* dst, const T* src, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

}  // namespace

void residual_forward(float* out, const float* a, const float* b, int64_t n) { residual_forward_t(out, a, b, n); }
void residual_forward(double* out, const double* a, const double* b, int64_t n) { residual_forward_t(out, a, b, n); }
void accumulate(float* dst, const float* src, int64_t n) { accumulate_t(dst, src, n); }
void accumulate(double* dst, const double* src, int64_t n) { accumulate_t(dst, src, n); }

}  // namespace loom::cpu
