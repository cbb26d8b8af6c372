// Host reference of the per-row / per-column FP8 casts (loom/ops/fp8_rowwise.hpp).
#include "loom/ops/fp8_rowwise.hpp"

#include <cmath>
#include <vector>

#include "loom/error.hpp"

namespace loom::ops {
namespace {

float abs_or_inf(float v) { return std::isnan(v) ? INFINITY : std::fabs(v); }

void check(const float* x, int64_t rows, int64_t cols, int64_t ld, const float* scale_inv, const char* what) {
  LOOM_CHECK(rows >= 0 && cols >= 0 && ld >= cols, what, ": x [", rows, ", ", cols, "] with row stride ", ld,
             " (the row stride must be at least the row length)");
  LOOM_CHECK((rows == 0 || cols == 0) || (x != nullptr && scale_inv != nullptr), what,
             ": x and scale_inv must be given");
}

}  // namespace

void fp8_cast_rowwise_host(const float* x, int64_t rows, int64_t cols, int64_t ld, const RowwiseOptions& o,
                           uint8_t* q, float* scale_inv) {
  check(x, rows, cols, ld, scale_inv, "fp8_cast_rowwise_host");
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * ld;
    float m = 0.0f;
    for (int64_t j = 0; j < cols; ++j) m = std::fmax(m, abs_or_inf(row[j]));
    const float s = rowwise_scale(m, o);
    scale_inv[r] = 1.0f / s;
    if (q != nullptr)
      for (int64_t j = 0; j < cols; ++j) q[r * cols + j] = fp8::encode(row[j] * s, o.format);
  }
}

void fp8_cast_colwise_host(const float* x, int64_t rows, int64_t cols, int64_t ld, const RowwiseOptions& o,
                           uint8_t* q_t, float* scale_inv) {
  check(x, rows, cols, ld, scale_inv, "fp8_cast_colwise_host");
  std::vector<float> m(static_cast<size_t>(cols), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) m[static_cast<size_t>(c)] = std::fmax(m[static_cast<size_t>(c)], abs_or_inf(x[r * ld + c]));
  for (int64_t c = 0; c < cols; ++c) {
    const float s = rowwise_scale(m[static_cast<size_t>(c)], o);
    scale_inv[c] = 1.0f / s;
    if (q_t != nullptr)
      for (int64_t r = 0; r < rows; ++r) q_t[c * rows + r] = fp8::encode(x[r * ld + c] * s, o.format);
  }
}

}  // namespace loom::ops
