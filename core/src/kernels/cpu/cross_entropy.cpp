// Fused softmax + cross-entropy over the vocabulary, with the logits gradient
// written in place (the logits buffer is dead after the loss, so this saves a
// [N, V] allocation).
#include <cmath>
#include <limits>

#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/fixed_order.hpp"
#include "loom/error.hpp"

namespace loom::cpu {
namespace {

// One row: returns -log softmax(l)[t] and, when scale != 0, overwrites l with
// (softmax(l) - onehot(t)) * scale. Stable form: log-sum-exp = m + log sum exp(l - m)
// with m the row maximum, so no exp overflows; the sum is taken in double.
template <typename T>
double cross_entropy_row(T* l, int32_t t, int64_t V, double scale) {
  if (t < 0) {  // ignored position (padding): no loss, zero gradient
    if (scale != 0.0)
      for (int64_t j = 0; j < V; ++j) l[j] = T(0);
    return 0.0;
  }
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < V; ++j) m = std::fmax(m, static_cast<double>(l[j]));
  double sum = 0.0;
  for (int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<double>(l[j]) - m);
  const double lse = m + std::log(sum);
  const double lt = static_cast<double>(l[t]);  // read before the row is overwritten
  const double loss = lse - lt;
  if (scale != 0.0) {
    for (int64_t j = 0; j < V; ++j) l[j] = static_cast<T>(std::exp(static_cast<double>(l[j]) - lse) * scale);
    l[t] = static_cast<T>((std::exp(lt - lse) - 1.0) * scale);
  }
  return loss;
}

template <typename T>
double cross_entropy_t(T* logits, const int32_t* targets, int64_t N, int64_t V, double scale) {
  LOOM_CHECK(V > 0, "cross_entropy: vocabulary size must be positive, got V=", V);
  // Checked up front: an exception cannot leave an OpenMP region, and the
  // logits must stay untouched when the call fails.
  for (int64_t n = 0; n < N; ++n)
    LOOM_CHECK(targets[n] < V, "cross_entropy: target ", targets[n], " at row ", n, " is outside the vocabulary [0, ",
               V, ")");
  // Per-row losses summed in a fixed order (one row per chunk), so the loss
  // is bitwise the same for any thread count.
  return detail::fixed_order_sum(N, 1, [&](int64_t begin, int64_t end) {
    double s = 0.0;
    for (int64_t n = begin; n < end; ++n) s += cross_entropy_row(logits + n * V, targets[n], V, scale);
    return s;
  });
}

}  // namespace

double cross_entropy(float* logits, const int32_t* targets, int64_t N, int64_t V, float dlogits_scale) {
  return cross_entropy_t(logits, targets, N, V, dlogits_scale);
}
double cross_entropy(double* logits, const int32_t* targets, int64_t N, int64_t V, double dlogits_scale) {
  return cross_entropy_t(logits, targets, N, V, dlogits_scale);
}

}  // namespace loom::cpu
