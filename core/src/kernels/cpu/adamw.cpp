// AdamW (Loshchilov & Hutter): Adam moments with bias correction, weight decay
// decoupled from the gradient (applied to the parameter, not added to g).
#include <cmath>

#include "kernels/cpu/cpu_kernels.hpp"
#include "loom/error.hpp"

namespace loom::cpu {
namespace {

template <typename T>
void adamw_t(T* param, const T* grad, T* m, T* v, int64_t n, T lr, T beta1, T beta2, T eps, T weight_decay,
             int64_t step, T grad_scale) {
  LOOM_CHECK(step >= 1, "adamw: step is 1-based (bias correction divides by 1 - beta^step), got step=", step);
  // Bias corrections in double: beta2^step for small steps is 1 - O(1e-3) and
  // would lose digits in fp32.
  const double bc1 = 1.0 - std::pow(static_cast<double>(beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(beta2), static_cast<double>(step));
  const T inv_bc1 = static_cast<T>(1.0 / bc1);
  const T inv_bc2 = static_cast<T>(1.0 / bc2);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T g = grad[i] * grad_scale;
    const T mi = beta1 * m[i] + (T(1) - beta1) * g;
    const T vi = beta2 * v[i] + (T(1) - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const T m_hat = mi * inv_bc1;
    const T v_hat = vi * inv_bc2;
    param[i] -= lr * (m_hat / (std::sqrt(v_hat) + eps) + weight_decay * param[i]);
  }
}

}  // namespace

void adamw(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
           float eps, float weight_decay, int64_t step, float grad_scale) {
  adamw_t(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale);
}
void adamw(double* param, const double* grad, double* m, double* v, int64_t n, double lr, double beta1,
           double beta2, double eps, double weight_decay, int64_t step, double grad_scale) {
  adamw_t(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step, grad_scale);
}

}  // namespace loom::cpu
