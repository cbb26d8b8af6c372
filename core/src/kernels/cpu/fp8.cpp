// Batched FP8 casts on the host: the CPU reference of the device cast kernels
// (loom/fp8.hpp says what they compute).
#include "loom/fp8.hpp"

#include <array>

namespace loom::fp8 {
namespace {

// Decoding through a 256-entry table per format: one load per element.
struct DecodeTables {
  std::array<float, 256> e4m3{}, e5m2{};
  DecodeTables() {
    for (int c = 0; c < 256; ++c) {
      e4m3[c] = decode(static_cast<uint8_t>(c), Format::e4m3);
      e5m2[c] = decode(static_cast<uint8_t>(c), Format::e5m2);
    }
  }
};
const float* decode_table(Format f) {
  static const DecodeTables tables;
  return f == Format::e4m3 ? tables.e4m3.data() : tables.e5m2.data();
}

// Fixed-size chunks: a small tensor stays on the calling thread (no OpenMP
// team for a few thousand elements), a large one splits into equal pieces.
constexpr int64_t kChunk = 1 << 14;

// Max is exact and independent of order, so a parallel max reduction is
// bitwise deterministic (unlike a float sum); NaN is tracked apart because a
// comparison with NaN is false and would drop it depending on the order.
template <typename Body>
float amax_loop(int64_t n, Body body) {
  float m = 0.0f;
  int nan = 0;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) reduction(max : m) reduction(| : nan) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = c * kChunk + kChunk < n ? c * kChunk + kChunk : n;
    for (int64_t i = c * kChunk; i < end; ++i) {
      const float a = body(i);
      if (is_nan(a)) nan = 1;
      else if (a > m) m = a;
    }
  }
  return nan ? bits_float(0x7FC00000u) : m;
}

float abs_bits(float x) { return bits_float(float_bits(x) & 0x7FFFFFFFu); }

}  // namespace

float amax(const float* x, int64_t n) {
  return amax_loop(n, [&](int64_t i) { return abs_bits(x[i]); });
}

float quantize(const float* x, int64_t n, float scale, Format f, uint8_t* q) {
  return amax_loop(n, [&](int64_t i) {
    q[i] = encode(x[i] * scale, f);
    return abs_bits(x[i]);
  });
}

void dequantize(const uint8_t* q, int64_t n, float scale, Format f, float* y) {
  const float* table = decode_table(f);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t end = c * kChunk + kChunk < n ? c * kChunk + kChunk : n;
    for (int64_t i = c * kChunk; i < end; ++i) y[i] = table[q[i]] / scale;
  }
}

float quantize_dequantize(const float* x, int64_t n, float scale, Format f, float* y) {
  const float* table = decode_table(f);
  return amax_loop(n, [&](int64_t i) {
    const float a = abs_bits(x[i]);  // read before y[i] is written: y may be x
    y[i] = table[encode(x[i] * scale, f)] / scale;
    return a;
  });
}

}  // namespace loom::fp8
