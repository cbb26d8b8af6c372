// SwiGLU MLP activation: out = silu(gate) * up, silu(g) = g * sigmoid(g).
#include <cmath>

#include "kernels/cpu/cpu_kernels.hpp"

namespace loom::cpu {
namespace {

template <typename T>
T sigmoid(T g) {
  return T(1) / (T(1) + std::exp(-g));
}

template <typename T>
void swiglu_forward_t(T* out, const T* gate, const T* up, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T g = gate[i];
    out[i] = g * sigmoid(g) * up[i];
  }
}

// d silu(g)/dg = sig(g) (1 + g (1 - sig(g)))
template <typename T>
void swiglu_backward_t(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T g = gate[i], sg = sigmoid(g);
    dgate[i] = dout[i] * up[i] * sg * (T(1) + g * (T(1) - sg));
    dup[i] = dout[i] * g * sg;
  }
}

}  // namespace

void swiglu_forward(float* out, const float* gate, const float* up, int64_t n) { swiglu_forward_t(out, gate, up, n); }
void swiglu_forward(double* out, const double* gate, const double* up, int64_t n) {
  swiglu_forward_t(out, gate, up, n);
}
void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up, int64_t n) {
  swiglu_backward_t(dgate, dup, dout, gate, up, n);
}
void swiglu_backward(double* dgate, double* dup, const double* dout, const double* gate, const double* up,
                     int64_t n) {
  swiglu_backward_t(dgate, dup, dout, gate, up, n);
}

}  // namespace loom::cpu
