// Rotary position embedding, HF Llama convention (rotate_half): element i of a
// head pairs with element i + D/2, and
//   y_i       = x_i c - x_{i+D/2} s
//   y_{i+D/2} = x_{i+D/2} c + x_i s,     c, s = cos, sin(pos * inv_freq_i)
//
// Precision of the angles. transformers builds the table in fp32:
//   inv_freq = 1.0 / (theta ** (arange(0, D, 2).float() / D))   -> fp32
//   freqs    = inv_freq * pos                                     -> fp32
//   cos, sin = freqs.cos(), freqs.sin()                           -> fp32
// The fp32 rounding of inv_freq (relative 6e-8) is multiplied by the position,
// so at pos = 2048 HF's angles differ from the exact ones by up to ~1e-4 rad:
// far more than the 1e-5 the golden logit tests allow. We therefore reproduce
// HF's fp32 angle: the power is evaluated in double and rounded once to fp32
// (the correctly rounded value; torch's vectorised pow is within 1 ulp of it),
// the reciprocal and the product with pos are fp32 operations as in torch.
// (The tests match an fp32 emulation of HF built on powf/cosf to ~1e-8 up to
// pos 4096, where exact angles miss it by ~2e-5.) cos and sin of that fp32
// angle are then taken in double, which is exact to rounding;
// the float kernel rounds them to fp32 (HF's table, within 1 ulp) and the
// double kernel keeps them, so both overloads compute the same function.
#include <cmath>

#include "kernels/cpu/cpu_kernels.hpp"
#include "loom/error.hpp"

namespace loom::cpu {

float rope_angle(int64_t pos, int64_t i, int64_t D, double theta) {
  const float exponent = static_cast<float>(2 * i) / static_cast<float>(D);  // fp32 division, as torch
  const float power = static_cast<float>(std::pow(theta, static_cast<double>(exponent)));
  const float inv_freq = 1.0f / power;
  return static_cast<float>(pos) * inv_freq;
}

namespace {

// sign = +1 rotates by +angle (forward), -1 by -angle: the backward of a
// rotation is its transpose, the rotation by the opposite angle.
template <typename T>
void rope_apply(T* x, int64_t B, int64_t S, int64_t nh, int64_t D, int64_t row_stride, double theta, int sign,
                const int32_t* positions) {
  LOOM_CHECK(D > 0 && D % 2 == 0, "rope: head_dim must be even and positive, got D=", D);
  // Checked up front: an exception cannot leave the OpenMP region.
  if (positions)
    for (int64_t bs = 0; bs < B * S; ++bs)
      LOOM_CHECK(positions[bs] >= 0 && positions[bs] < S, "rope: position ", positions[bs], " of row ", bs,
                 " is outside [0, S = ", S, ")");
  LOOM_CHECK(row_stride >= nh * D, "rope: row_stride=", row_stride, " is smaller than nh*D=", nh * D,
             " (nh=", nh, ", D=", D, ")");
  LOOM_CHECK(theta > 0, "rope: theta must be positive, got ", theta);
  const int64_t half = D / 2;
#pragma omp parallel for schedule(static)
  for (int64_t bs = 0; bs < B * S; ++bs) {
    const int64_t pos = positions ? positions[bs] : bs % S;
    T* row = x + bs * row_stride;
    for (int64_t i = 0; i < half; ++i) {
      // The table value for (pos, i) is shared by every head of the row.
      const double angle = rope_angle(pos, i, D, theta);
      const T c = static_cast<T>(std::cos(angle));
      const T s = static_cast<T>(sign * std::sin(angle));
      for (int64_t hd = 0; hd < nh; ++hd) {
        T* v = row + hd * D;
        const T x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c - x2 * s;
        v[i + half] = x2 * c + x1 * s;
      }
    }
  }
}

}  // namespace

void rope_forward(float* x, int64_t B, int64_t S, int64_t nh, int64_t D, int64_t row_stride, double theta,
                  const int32_t* positions) {
  rope_apply(x, B, S, nh, D, row_stride, theta, +1, positions);
}
void rope_backward(float* dx, int64_t B, int64_t S, int64_t nh, int64_t D, int64_t row_stride, double theta,
                   const int32_t* positions) {
  rope_apply(dx, B, S, nh, D, row_stride, theta, -1, positions);
}
void rope_forward(double* x, int64_t B, int64_t S, int64_t nh, int64_t D, int64_t row_stride, double theta,
                  const int32_t* positions) {
  rope_apply(x, B, S, nh, D, row_stride, theta, +1, positions);
}
void rope_backward(double* dx, int64_t B, int64_t S, int64_t nh, int64_t D, int64_t row_stride, double theta,
                   const int32_t* positions) {
  rope_apply(dx, B, S, nh, D, row_stride, theta, -1, positions);
}

}  // namespace loom::cpu
