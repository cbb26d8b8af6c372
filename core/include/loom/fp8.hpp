// FP8 formats: OCP / NVIDIA E4M3 ("e4m3fn") and E5M2, encoded and decoded
// exactly in integer arithmetic, and the scale rule of TransformerEngine's
// recipes.
//
//   format  bias  max     inf            NaN                     smallest subnormal
//   E4M3    7     448     none           S.1111.111 (0x7F/0xFF)  2^-9
//   E5M2    15    57344   S.11111.00     S.11111.{01,10,11}      2^-16
//
// Encoding rounds to nearest, ties to even, like the hardware casts. A
// finite value beyond ±max saturates to ±max by default, as TE's casts do
// (PTX cvt .satfinite); so does ±inf, because .satfinite maps it to MAXNORM
// too. Overflow::to_special gives IEEE-style overflow instead (E5M2: ±inf,
// E4M3: NaN, the only special it has), with the rounding boundary at the
// midpoint to the next power of two. NaN always encodes to NaN (0x7F).
//
// Usable from CUDA later: C++17, no exceptions, no <format>/spdlog; the scalar
// functions are __host__ __device__ under nvcc. The batched helpers at the end
// are host code (core/src/kernels/cpu/fp8.cpp).
#pragma once
#include <cfloat>
#include <cstdint>
#include <cstring>

#include "loom/dtype.hpp"

#if defined(__CUDACC__)
#define LOOM_FP8_HD __host__ __device__
#else
#define LOOM_FP8_HD
#endif

namespace loom::fp8 {

enum class Format : uint8_t { e4m3, e5m2 };
enum class Overflow : uint8_t { saturate, to_special };

constexpr float kE4M3Max = 448.0f;
constexpr float kE5M2Max = 57344.0f;
constexpr uint8_t kNaNCode = 0x7F;  // NaN in both formats (E5M2: S.11111.11)

LOOM_FP8_HD constexpr int man_bits(Format f) { return f == Format::e4m3 ? 3 : 2; }
LOOM_FP8_HD constexpr int exp_bias(Format f) { return f == Format::e4m3 ? 7 : 15; }
LOOM_FP8_HD constexpr float max_value(Format f) { return f == Format::e4m3 ? kE4M3Max : kE5M2Max; }
// Code of +max: E4M3 0.1111.110 (0.1111.111 is NaN), E5M2 0.11110.11.
LOOM_FP8_HD constexpr uint8_t max_code(Format f) { return f == Format::e4m3 ? 0x7E : 0x7B; }
// What an overflow becomes without saturation: E5M2 +inf, E4M3 NaN.
LOOM_FP8_HD constexpr uint8_t overflow_code(Format f) { return f == Format::e4m3 ? 0x7F : 0x7C; }
// The value of the subnormal code 1: 2^(1 - bias - mantissa bits).
LOOM_FP8_HD constexpr float subnormal_unit(Format f) { return f == Format::e4m3 ? 0x1p-9f : 0x1p-16f; }
constexpr DType dtype(Format f) { return f == Format::e4m3 ? DType::e4m3 : DType::e5m2; }

LOOM_FP8_HD inline uint32_t float_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}
LOOM_FP8_HD inline float bits_float(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}
// Bit tests rather than std::isfinite: the same code on host and device, and
// immune to -ffast-math assuming no infinities.
LOOM_FP8_HD inline bool is_finite(float x) { return ((float_bits(x) >> 23) & 0xFF) != 0xFF; }
LOOM_FP8_HD inline bool is_nan(float x) { return (float_bits(x) & 0x7FFFFFFF) > 0x7F800000; }

// fp32 -> FP8 code, round to nearest even.
LOOM_FP8_HD inline uint8_t encode(float x, Format f, Overflow overflow = Overflow::saturate) {
  const int M = man_bits(f), B = exp_bias(f);
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t e32 = (u >> 23) & 0xFF, m32 = u & 0x7FFFFF;
  const uint8_t beyond = overflow == Overflow::saturate ? max_code(f) : overflow_code(f);
  if (e32 == 0xFF) return m32 ? kNaNCode : static_cast<uint8_t>(sign | beyond);
  // ±0 and fp32 subnormals (< 2^-126, far below half the smallest FP8 subnormal) become a signed zero.
  if (e32 == 0) return sign;
  const int e = static_cast<int>(e32) - 127;
  const uint32_t sig = (1u << 23) | m32;  // value = sig * 2^(e - 23)
  const int emin = 1 - B;                 // exponent of the smallest normal
  // Keep M fraction bits below the leading one; below emin the FP8 exponent is
  // pinned at emin, so the leading one itself moves right (a subnormal).
  const int shift = 23 - M + (e < emin ? emin - e : 0);
  // From 25 bits on the whole of sig (< 2^24) is below half a unit: zero.
  // (shift == 24 is exact below: q = 0, half = 2^23 <= sig.)
  if (shift > 24) return sign;
  uint32_t q = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  // Normal: q holds the implicit one (q in [2^M, 2^(M+1)]), so the code is
  // ((e + B - 1) << M) + q, and a rounding carry out of the mantissa moves into
  // the next binade by itself. Subnormal: the code is q, and q = 2^M (rounded
  // up to the smallest normal) is that normal's code.
  const int32_t mag = e < emin ? static_cast<int32_t>(q) : ((e + B - 1) << M) + static_cast<int32_t>(q);
  if (mag > max_code(f)) return static_cast<uint8_t>(sign | beyond);
  return static_cast<uint8_t>(sign | mag);
}

// encode(x, f) with saturation, the same code for every fp32 x (a test checks
// it against encode over every exponent, mantissa edge and tie), in about a
// third of the instructions: the device casts run ~40 integer operations per
// element with encode, which bounds them below the memory bandwidth of an
// H100. FP8 subnormals are rounded by one fp32 add (|x| + magic, where one
// unit in magic's last place is the FP8 subnormal unit: the add rounds |x| to
// a multiple of it, to nearest even, and the multiple is the code); normals by
// rebiasing the exponent field and adding half a unit less one plus the kept
// mantissa's low bit before the shift (nearest even; a carry moves into the
// exponent by itself). Everything beyond max, inf included, clamps to max.
LOOM_FP8_HD inline uint8_t encode_fast(float x, Format f) {
  const int M = man_bits(f), B = exp_bias(f);
  const uint32_t u = float_bits(x);
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t sign = (u >> 24) & 0x80u;
  if (a > 0x7F800000u) return kNaNCode;
  // magic = 2^(24 - B - M): its last-place unit is 2^(1 - B - M), the subnormal unit.
  const float magic = bits_float(static_cast<uint32_t>(127 + 24 - B - M) << 23);
#if defined(__CUDA_ARCH__)
  const float sum = __fadd_rn(bits_float(a), magic);  // never contracted into an FMA
#else
  const float sum = bits_float(a) + magic;
#endif
  const uint32_t sub = float_bits(sum) - float_bits(magic);
  const uint32_t odd = (a >> (23 - M)) & 1u;
  const uint32_t norm = (a - (static_cast<uint32_t>(127 - B) << 23) + ((1u << (22 - M)) - 1u) + odd) >> (23 - M);
  // Below 2^(1 - B), the smallest FP8 normal, the subnormal rounding applies.
  uint32_t mag = a < (static_cast<uint32_t>(128 - B) << 23) ? sub : norm;
  if (mag > max_code(f)) mag = max_code(f);
  return static_cast<uint8_t>(sign | mag);
}

// FP8 code -> fp32 (exact: every FP8 value is an fp32 value).
LOOM_FP8_HD inline float decode(uint8_t c, Format f) {
  const int M = man_bits(f), B = exp_bias(f);
  const uint32_t sign = static_cast<uint32_t>(c & 0x80) << 24;
  const uint32_t mag = c & 0x7Fu;
  const uint32_t e = mag >> M, m = mag & ((1u << M) - 1);
  if (f == Format::e4m3 && mag == 0x7F) return bits_float(sign | 0x7FC00000u);
  if (f == Format::e5m2 && e == 31) return bits_float(sign | (m ? 0x7FC00000u : 0x7F800000u));
  if (e == 0) {
    const float v = static_cast<float>(m) * subnormal_unit(f);  // exact: m < 8 times a power of two
    return sign ? -v : v;                                       // code 0x80 is -0
  }
  return bits_float(sign | ((e - B + 127) << 23) | (m << (23 - M)));
}

// 2^e for e in [-126, 127], built from its bits (exact; no libm on either side).
LOOM_FP8_HD inline float pow2(int e) { return bits_float(static_cast<uint32_t>(e + 127) << 23); }

// TransformerEngine's scale rule: scale = (fp8_max / amax) / 2^margin, so that
// amax maps to fp8_max / 2^margin. An amax that is 0, negative, inf or NaN says
// nothing about the range: keep the previous scale (skipped = true). A scale
// that overflows becomes FLT_MAX (as TE: amax then maps below fp8_max, the best
// fp32 can do); one that underflows to 0 (amax near FLT_MAX with a margin)
// would make every value 0, so it is skipped too. margin in [0, 126].
struct ScaleUpdate {
  float scale;
  bool skipped;
};
LOOM_FP8_HD inline ScaleUpdate compute_scale(float amax, float fp8_max, int margin, float previous) {
  if (!(amax > 0.0f) || !is_finite(amax)) return {previous, true};
  float s = (fp8_max / amax) * pow2(-margin);  // times 2^-m is exactly "/ 2^m"
  if (!is_finite(s)) s = FLT_MAX;
  if (s == 0.0f) return {previous, true};
  return {s, false};
}

// ---- Batched host helpers (core/src/kernels/cpu/fp8.cpp) ----
//
// x * scale is rounded to fp32 before it is encoded, as a device cast kernel
// computes it. amax is max |x| of the unscaled input, NaN when any element is
// NaN (ready for a scale update, which skips it).

// max |x[i]| over n values (0 for n = 0; NaN when one is NaN).
float amax(const float* x, int64_t n);
// q[i] = encode(x[i] * scale, f) (saturating); returns amax(x).
float quantize(const float* x, int64_t n, float scale, Format f, uint8_t* q);
// y[i] = decode(q[i], f) / scale.
void dequantize(const uint8_t* q, int64_t n, float scale, Format f, float* y);
// y[i] = decode(encode(x[i] * scale, f), f) / scale, the value an FP8 GEMM sees
// (y may be x); returns amax(x).
float quantize_dequantize(const float* x, int64_t n, float scale, Format f, float* y);

}  // namespace loom::fp8
