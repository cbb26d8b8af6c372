// FP8 on the host: the E4M3/E5M2 codecs against references computed here
// from the bit fields and by brute force, the delayed/current scaling state
// against hand-computed sequences and its edge cases, and the emulated FP8
// GEMMs against fp64 GEMMs.
//
// Tolerances. The codecs and the scaling arithmetic are exact: codes and
// scales are compared bitwise (EXPECT_EQ on floats). The GEMM tolerances are
// derived where they are used.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "loom/error.hpp"
#include "loom/fp8.hpp"
#include "loom/fp8_emulated.hpp"
#include "precision/common/fp8_scaling.hpp"
#include "test_util.hpp"

namespace {

using loom::test::expect_error;
using loom::fp8::AmaxAlgo;
using loom::fp8::Format;
using loom::fp8::Formats;
using loom::fp8::Overflow;
using loom::fp8::Role;
using loom::fp8::Scaling;
using loom::fp8::ScalingConfig;
using loom::fp8::ScalingState;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
const Format kFormats[] = {Format::e4m3, Format::e5m2};

const char* fmt_name(Format f) { return f == Format::e4m3 ? "e4m3" : "e5m2"; }

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// ---- An independent reference: the value of a code from its bit fields -----
// (the specification's formula through std::ldexp, in double; nothing of
// loom/fp8.hpp is used).
struct FieldSpec {
  int exp_bits, man_bits, bias;
  bool ieee_specials;  // E5M2: exponent all ones is inf/NaN; E4M3: only S.1111.111 is NaN
};
FieldSpec spec(Format f) { return f == Format::e4m3 ? FieldSpec{4, 3, 7, false} : FieldSpec{5, 2, 15, true}; }

double reference_value(int code, Format f) {
  const FieldSpec s = spec(f);
  const int sign = (code >> 7) & 1;
  const int e = (code >> s.man_bits) & ((1 << s.exp_bits) - 1);
  const int m = code & ((1 << s.man_bits) - 1);
  const int e_all = (1 << s.exp_bits) - 1, m_all = (1 << s.man_bits) - 1;
  double v;
  if (s.ieee_specials && e == e_all) v = m == 0 ? std::numeric_limits<double>::infinity() : std::nan("");
  else if (!s.ieee_specials && e == e_all && m == m_all) v = std::nan("");
  else if (e == 0) v = std::ldexp(static_cast<double>(m), 1 - s.bias - s.man_bits);  // subnormal: 0.m * 2^(1-bias)
  else v = std::ldexp(static_cast<double>((1 << s.man_bits) + m), e - s.bias - s.man_bits);  // 1.m * 2^(e-bias)
  return sign ? -v : v;
}
bool reference_finite(int code, Format f) { return std::isfinite(reference_value(code, f)); }

// Round to nearest even by brute force: the finite code of x's sign nearest
// to x, the even code (mantissa LSB 0) on a tie. Values beyond max land on max
// (the nearest finite code), which is what saturation means.
//
// Within the codes' range the distances that decide (to the codes on either
// side of x, which share x's magnitude) are exact in double. Beyond the
// largest finite value they are not: for x = 1e24 the differences to 57344
// and 49152 round to the same double and would fake a tie, so there the
// nearest code is taken as what it is, the largest (every distance is
// |x| - v, smallest for the largest v).
uint8_t brute_force_encode(double x, Format f) {
  const int sign = std::signbit(x) ? 0x80 : 0;
  int largest = 0;
  for (int mag = 0; mag < 128; ++mag)
    if (reference_finite(mag, f) && reference_value(mag, f) > reference_value(largest, f)) largest = mag;
  if (std::fabs(x) >= reference_value(largest, f)) return static_cast<uint8_t>(sign | largest);
  int best = -1;
  double best_d = 0;
  for (int mag = 0; mag < 128; ++mag) {
    const int c = sign | mag;
    if (!reference_finite(c, f)) continue;
    const double d = std::fabs(reference_value(c, f) - x);
    if (best < 0 || d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best);
}

// ============================== formats ==============================

TEST(Fp8Format, Every256CodesDecodeToTheBitFieldReference) {
  for (Format f : kFormats) {
    int nans = 0, infs = 0;
    for (int c = 0; c < 256; ++c) {
      const double ref = reference_value(c, f);
      const float got = loom::fp8::decode(static_cast<uint8_t>(c), f);
      if (std::isnan(ref)) {
        ++nans;
        EXPECT_TRUE(std::isnan(got)) << fmt_name(f) << " code 0x" << std::hex << c << " decodes to " << got
                                     << ", not NaN";
        continue;
      }
      if (std::isinf(ref)) ++infs;
      // Bitwise: the value and the sign of zero. Every FP8 value is exact in fp32.
      EXPECT_EQ(bits(got), bits(static_cast<float>(ref)))
          << fmt_name(f) << " code 0x" << std::hex << c << std::dec << " decodes to " << got << ", reference " << ref;
    }
    // The formats' specials: E4M3 has 2 NaN codes and no inf; E5M2 6 NaNs and ±inf.
    EXPECT_EQ(nans, f == Format::e4m3 ? 2 : 6) << fmt_name(f) << " NaN codes";
    EXPECT_EQ(infs, f == Format::e4m3 ? 0 : 2) << fmt_name(f) << " inf codes";
  }
}

TEST(Fp8Format, ConstantsMatchTheReference) {
  EXPECT_EQ(reference_value(loom::fp8::max_code(Format::e4m3), Format::e4m3), 448.0);
  EXPECT_EQ(reference_value(loom::fp8::max_code(Format::e5m2), Format::e5m2), 57344.0);
  EXPECT_EQ(loom::fp8::max_value(Format::e4m3), 448.0f);
  EXPECT_EQ(loom::fp8::max_value(Format::e5m2), 57344.0f);
  EXPECT_EQ(reference_value(1, Format::e4m3), std::ldexp(1.0, -9));   // smallest subnormal
  EXPECT_EQ(reference_value(1, Format::e5m2), std::ldexp(1.0, -16));
  EXPECT_EQ(reference_value(0x08, Format::e4m3), std::ldexp(1.0, -6));  // smallest normal
  EXPECT_EQ(reference_value(0x04, Format::e5m2), std::ldexp(1.0, -14));
  for (Format f : kFormats) {
    EXPECT_EQ(loom::fp8::subnormal_unit(f), static_cast<float>(reference_value(1, f))) << fmt_name(f);
    EXPECT_TRUE(std::isnan(reference_value(loom::fp8::kNaNCode, f))) << fmt_name(f);
  }
  EXPECT_TRUE(std::isnan(reference_value(loom::fp8::overflow_code(Format::e4m3), Format::e4m3)));
  EXPECT_EQ(reference_value(loom::fp8::overflow_code(Format::e5m2), Format::e5m2),
            std::numeric_limits<double>::infinity());
}

TEST(Fp8Format, EveryNonNaNCodeRoundTrips) {
  for (Format f : kFormats) {
    for (int c = 0; c < 256; ++c) {
      const double ref = reference_value(c, f);
      if (std::isnan(ref)) continue;
      const float v = loom::fp8::decode(static_cast<uint8_t>(c), f);
      // Without saturation every non-NaN code, ±inf included, comes back (±0 by its sign).
      EXPECT_EQ(loom::fp8::encode(v, f, Overflow::to_special), c)
          << fmt_name(f) << " code 0x" << std::hex << c << " (value " << v << ") under to_special";
      // Saturating (TE's casts) keeps every finite code; ±inf becomes ±max (.satfinite).
      const int expect_sat = std::isinf(ref) ? ((c & 0x80) | loom::fp8::max_code(f)) : c;
      EXPECT_EQ(loom::fp8::encode(v, f), expect_sat)
          << fmt_name(f) << " code 0x" << std::hex << c << " (value " << v << ") saturating";
    }
  }
}

TEST(Fp8Format, RandomValuesEncodeAsTheBruteForceNearestEven) {
  std::mt19937_64 gen(20261126);
  std::uniform_int_distribution<uint32_t> any_bits;
  std::uniform_real_distribution<double> unit(1.0, 2.0);
  std::uniform_int_distribution<int> exponent(-20, 17);  // the two formats' range and beyond, both ends
  for (Format f : kFormats) {
    int checked = 0;
    for (int i = 0; i < 100000; ++i) {
      float x;
      if (i % 2 == 0) {
        // Any fp32 bit pattern but NaN/inf: mostly far outside FP8's range (saturation, zero).
        const uint32_t u = any_bits(gen);
        std::memcpy(&x, &u, sizeof x);
        if (!std::isfinite(x)) continue;
      } else {
        // Log-uniform over FP8's range, with a random sign: normals, subnormals, saturation.
        x = static_cast<float>(std::ldexp(unit(gen), exponent(gen)));
        if (gen() & 1) x = -x;
      }
      const uint8_t want = brute_force_encode(x, f);
      ASSERT_EQ(loom::fp8::encode(x, f), want)
          << fmt_name(f) << " x=" << x << " (bits 0x" << std::hex << bits(x) << ") reference code 0x" << int{want};
      ++checked;
    }
    EXPECT_GT(checked, 90000) << fmt_name(f);
  }
}

TEST(Fp8Format, MidpointsBetweenNeighboursRoundToEven) {
  for (Format f : kFormats) {
    const int maxc = loom::fp8::max_code(f);
    for (int sign : {0, 0x80}) {
      for (int c = 0; c < maxc; ++c) {
        const int lo = sign | c, hi = sign | (c + 1);
        const double a = reference_value(lo, f), b = reference_value(hi, f);
        // Exact in fp32: FP8 values have at most 4 significant bits, their midpoints 5.
        const float mid = static_cast<float>((a + b) / 2);
        ASSERT_EQ(static_cast<double>(mid), (a + b) / 2) << "midpoint not exact in fp32";
        const int even = (lo & 1) == 0 ? lo : hi;
        EXPECT_EQ(loom::fp8::encode(mid, f), even) << fmt_name(f) << " midpoint " << mid << " of codes 0x" << std::hex
                                                   << lo << " and 0x" << hi;
        EXPECT_EQ(loom::fp8::encode(mid, f), brute_force_encode(mid, f)) << fmt_name(f) << " midpoint " << mid;
        // One fp32 ulp either side decides it.
        const float toward_b = std::nextafter(mid, static_cast<float>(b));
        const float toward_a = std::nextafter(mid, static_cast<float>(a));
        EXPECT_EQ(loom::fp8::encode(toward_b, f), hi) << fmt_name(f) << " x=" << toward_b;
        EXPECT_EQ(loom::fp8::encode(toward_a, f), lo) << fmt_name(f) << " x=" << toward_a;
      }
    }
  }
}

TEST(Fp8Format, FastEncodeIsEncodeAtEveryExponentMantissaEdgeAndTie) {
  // encode_fast (the device casts' encoder) against encode: every sign,
  // exponent and top 11 mantissa bits, with the low 12 bits at the values
  // that decide rounding (zero: exact ties and exact values; one either side
  // of half of 2^12; all ones). Rounding happens at bit 20 or above, so the
  // tie and near-tie patterns of every FP8 code are among them, as are
  // zeros, fp32 subnormals, infinities and NaNs. (Every one of the 2^32
  // inputs was checked once as well; it takes minutes.)
  const uint32_t lows[] = {0x000, 0x001, 0x7FF, 0x800, 0x801, 0xFFF};
  for (Format f : kFormats) {
    int64_t bad = 0;
    for (uint32_t hi = 0; hi < (1u << 20); ++hi)
      for (uint32_t lo : lows) {
        const uint32_t u = (hi << 12) | lo;
        float x;
        std::memcpy(&x, &u, sizeof x);
        const uint8_t want = loom::fp8::encode(x, f), got = loom::fp8::encode_fast(x, f);
        if (want != got && bad++ < 5)
          ADD_FAILURE() << fmt_name(f) << " bits 0x" << std::hex << u << ": encode_fast 0x" << int{got}
                        << ", encode 0x" << int{want};
      }
    EXPECT_EQ(bad, 0) << fmt_name(f);
  }
}

TEST(Fp8Format, SaturationAndOverflow) {
  // Beyond max: saturating gives ±max; to_special gives E5M2 ±inf and E4M3 NaN
  // from the midpoint to the next power of two on (E4M3: 464 ties to the even
  // 448 = 1.110b·2^8; E5M2: 61440 ties to the even 2^16, i.e. inf).
  struct Case {
    Format f;
    float x;
    int saturated, special;
  };
  const Case cases[] = {
      {Format::e4m3, 448.0f, 0x7E, 0x7E},          {Format::e4m3, 464.0f, 0x7E, 0x7E},
      {Format::e4m3, std::nextafter(464.0f, 1e9f), 0x7E, 0x7F},
      {Format::e4m3, 1e30f, 0x7E, 0x7F},           {Format::e4m3, FLT_MAX, 0x7E, 0x7F},
      {Format::e4m3, kInf, 0x7E, 0x7F},            {Format::e4m3, -500.0f, 0xFE, 0xFF},
      {Format::e4m3, -kInf, 0xFE, 0xFF},           {Format::e5m2, 57344.0f, 0x7B, 0x7B},
      {Format::e5m2, std::nextafter(61440.0f, 0.0f), 0x7B, 0x7B},
      {Format::e5m2, 61440.0f, 0x7B, 0x7C},        {Format::e5m2, 1e30f, 0x7B, 0x7C},
      {Format::e5m2, kInf, 0x7B, 0x7C},            {Format::e5m2, -FLT_MAX, 0xFB, 0xFC},
      {Format::e5m2, -kInf, 0xFB, 0xFC},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(loom::fp8::encode(c.x, c.f), c.saturated) << fmt_name(c.f) << " x=" << c.x << " saturating";
    EXPECT_EQ(loom::fp8::encode(c.x, c.f, Overflow::to_special), c.special) << fmt_name(c.f) << " x=" << c.x;
  }
}

TEST(Fp8Format, NaNStaysNaN) {
  const uint32_t nan_bits[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u /* signalling */, 0xFFFFFFFFu};
  for (Format f : kFormats) {
    for (uint32_t u : nan_bits) {
      float x;
      std::memcpy(&x, &u, sizeof x);
      for (Overflow o : {Overflow::saturate, Overflow::to_special}) {
        const uint8_t c = loom::fp8::encode(x, f, o);
        EXPECT_TRUE(std::isnan(reference_value(c, f)))
            << fmt_name(f) << " NaN bits 0x" << std::hex << u << " encode to 0x" << int{c} << ", not a NaN code";
      }
    }
  }
}

TEST(Fp8Format, SubnormalsAndSignedZero) {
  const double u4 = std::ldexp(1.0, -9), u5 = std::ldexp(1.0, -16);  // subnormal units
  struct Case {
    Format f;
    double x;
    int code;
  };
  const Case cases[] = {
      {Format::e4m3, 1 * u4, 0x01},    {Format::e4m3, 3 * u4, 0x03},   {Format::e4m3, 7 * u4, 0x07},
      {Format::e4m3, 0.5 * u4, 0x00},  // tie between 0 and 1: even 0
      {Format::e4m3, 1.5 * u4, 0x02},  // tie between 1 and 2: even 2
      {Format::e4m3, 2.5 * u4, 0x02},  // tie between 2 and 3: even 2
      {Format::e4m3, 7.5 * u4, 0x08},  // tie between the largest subnormal 7 and the smallest normal 8 (2^-6)
      {Format::e4m3, 0.25 * u4, 0x00}, {Format::e4m3, -0.75 * u4, 0x81},
      {Format::e4m3, std::ldexp(1.0, -6), 0x08}, {Format::e4m3, std::ldexp(1.0, -7), 0x04},
      {Format::e5m2, 1 * u5, 0x01},    {Format::e5m2, 3 * u5, 0x03},
      {Format::e5m2, 0.5 * u5, 0x00},  {Format::e5m2, 3.5 * u5, 0x04},  // tie 3|4 -> even 4 = 2^-14, smallest normal
      {Format::e5m2, -2.5 * u5, 0x82}, {Format::e5m2, std::ldexp(1.0, -15), 0x02},
  };
  for (const Case& c : cases) {
    const float x = static_cast<float>(c.x);
    EXPECT_EQ(loom::fp8::encode(x, c.f), c.code) << fmt_name(c.f) << " x=" << x;
    EXPECT_EQ(loom::fp8::encode(x, c.f), brute_force_encode(x, c.f)) << fmt_name(c.f) << " x=" << x;
  }
  for (Format f : kFormats) {
    EXPECT_EQ(loom::fp8::encode(0.0f, f), 0x00) << fmt_name(f);
    EXPECT_EQ(loom::fp8::encode(-0.0f, f), 0x80) << fmt_name(f);
    EXPECT_EQ(loom::fp8::encode(-1e-30f, f), 0x80) << fmt_name(f) << ": a tiny negative is -0";
    EXPECT_EQ(loom::fp8::encode(-1e-45f, f), 0x80) << fmt_name(f) << ": an fp32 subnormal is a signed zero";
    EXPECT_EQ(loom::fp8::encode(1e-45f, f), 0x00) << fmt_name(f);
    const float nz = loom::fp8::decode(0x80, f);
    EXPECT_TRUE(nz == 0.0f && std::signbit(nz)) << fmt_name(f) << " code 0x80 decodes to " << nz << ", not -0";
  }
}

TEST(Fp8Format, BatchedCastsMatchTheScalarOnesWithAScale) {
  std::mt19937_64 gen(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  // Over 2 chunks of the parallel loops, with an odd tail.
  std::vector<float> x(40000 + 17);
  for (auto& v : x) v = normal(gen);
  x[5] = -0.0f;
  x[9] = 1e6f;  // saturates after scaling
  for (Format f : kFormats) {
    float want_amax = 0;
    for (float v : x) want_amax = std::max(want_amax, std::fabs(v));
    const float scale = loom::fp8::max_value(f) / 8.0f;  // 8 ~ 2.7 sigma: the tail saturates
    std::vector<uint8_t> q(x.size());
    EXPECT_EQ(loom::fp8::quantize(x.data(), static_cast<int64_t>(x.size()), scale, f, q.data()), want_amax);
    std::vector<float> y(x.size()), fused(x.size()), inplace = x;
    loom::fp8::dequantize(q.data(), static_cast<int64_t>(q.size()), scale, f, y.data());
    EXPECT_EQ(loom::fp8::quantize_dequantize(x.data(), static_cast<int64_t>(x.size()), scale, f, fused.data()),
              want_amax);
    EXPECT_EQ(loom::fp8::quantize_dequantize(inplace.data(), static_cast<int64_t>(x.size()), scale, f,
                                             inplace.data()),
              want_amax)
        << "in place";
    for (size_t i = 0; i < x.size(); ++i) {
      const uint8_t c = loom::fp8::encode(x[i] * scale, f);
      ASSERT_EQ(q[i], c) << fmt_name(f) << " x[" << i << "]=" << x[i];
      const float want = loom::fp8::decode(c, f) / scale;
      ASSERT_EQ(bits(y[i]), bits(want)) << fmt_name(f) << " x[" << i << "]=" << x[i];
      ASSERT_EQ(bits(fused[i]), bits(want)) << fmt_name(f) << " x[" << i << "]=" << x[i];
      ASSERT_EQ(bits(inplace[i]), bits(want)) << fmt_name(f) << " x[" << i << "]=" << x[i];
    }
    EXPECT_EQ(q[9], loom::fp8::max_code(f)) << "1e6 * scale saturates";
    EXPECT_EQ(q[5], 0x80) << "-0 keeps its sign";
  }
  // amax: NaN anywhere (also in the second chunk) makes it NaN; empty is 0.
  std::vector<float> z(40000, 1.0f);
  z[39000] = kNaN;
  EXPECT_TRUE(std::isnan(loom::fp8::amax(z.data(), static_cast<int64_t>(z.size()))));
  z[39000] = -kInf;
  EXPECT_EQ(loom::fp8::amax(z.data(), static_cast<int64_t>(z.size())), kInf);
  EXPECT_EQ(loom::fp8::amax(z.data(), 0), 0.0f);
}

// ============================== scaling ==============================

ScalingConfig delayed(int len, AmaxAlgo algo, int margin = 0, Formats formats = Formats::hybrid) {
  ScalingConfig c;
  c.scaling = Scaling::delayed;
  c.formats = formats;
  c.amax_history_len = len;
  c.amax_compute_algo = algo;
  c.margin = margin;
  return c;
}

// Runs one linear through steps of (x, w, dy) amaxes; returns the scales after each step.
struct Triple {
  float x, w, dy;
};
std::vector<Triple> run_steps(ScalingState& s, const std::vector<Triple>& amaxes) {
  std::vector<Triple> out;
  for (const Triple& a : amaxes) {
    s.record_amax(0, Role::x, a.x);
    s.record_amax(0, Role::w, a.w);
    s.record_amax(0, Role::dy, a.dy);
    s.update_scales();
    out.push_back({s.scale(0, Role::x), s.scale(0, Role::w), s.scale(0, Role::dy)});
  }
  return out;
}

TEST(Fp8Scaling, DelayedMaxOverTheHistory) {
  ScalingState s(delayed(3, AmaxAlgo::max));
  s.add_linear("layer.0.q_proj");
  // hybrid: x and w are E4M3 (max 448), dy E5M2 (max 57344).
  const auto got = run_steps(s, {{2, 1, 8}, {4, 1, 0.5f}, {1, 1, 0.5f}, {1, 1, 0.5f}, {1, 0.25f, 0.5f}});
  // history len 3: the window is the last 3 steps' amaxes, this one included.
  const Triple want[] = {
      {448.0f / 2, 448.0f / 1, 57344.0f / 8},  // x {2} -> 224; w {1} -> 448; dy {8} -> 7168
      {448.0f / 4, 448.0f / 1, 57344.0f / 8},  // x {2,4} -> 112; dy {8,.5} -> 7168
      {448.0f / 4, 448.0f / 1, 57344.0f / 8},  // x {2,4,1} -> 112; dy {8,.5,.5} -> 7168
      {448.0f / 4, 448.0f / 1, 57344.0f / 0.5f},  // x {4,1,1} -> 112; dy {.5,.5,.5} -> 114688
      {448.0f / 1, 448.0f / 1, 57344.0f / 0.5f},  // x {1,1,1} -> 448; w {1,1,.25} -> 448
  };
  ASSERT_EQ(got.size(), 5u);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].x, want[i].x) << "step " << i + 1 << " x";
    EXPECT_EQ(got[i].w, want[i].w) << "step " << i + 1 << " w";
    EXPECT_EQ(got[i].dy, want[i].dy) << "step " << i + 1 << " dy";
  }
  EXPECT_EQ(s.history(0, Role::x), (std::vector<float>{1, 1, 1})) << "newest first";
  EXPECT_EQ(s.history(0, Role::w), (std::vector<float>{0.25f, 1, 1}));
  EXPECT_EQ(s.scale_inv(0, Role::x), 1.0f / 448.0f);
  EXPECT_EQ(s.steps(), 5);
  EXPECT_EQ(s.skipped_updates(), 0);
}

TEST(Fp8Scaling, DelayedMostRecent) {
  ScalingState s(delayed(3, AmaxAlgo::most_recent));
  s.add_linear("l");
  const auto got = run_steps(s, {{2, 1, 8}, {4, 1, 0.5f}, {1, 1, 0.5f}, {1, 1, 2}});
  // Only this step's amax counts: x 2,4,1,1 -> 224,112,448,448; dy 8,.5,.5,2 -> 7168,114688,114688,28672.
  const float want_x[] = {224, 112, 448, 448}, want_dy[] = {7168, 114688, 114688, 28672};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(got[i].x, want_x[i]) << "step " << i + 1;
    EXPECT_EQ(got[i].dy, want_dy[i]) << "step " << i + 1;
  }
  // The history still records the window (for a later switch of algorithm and for the log).
  EXPECT_EQ(s.history(0, Role::x), (std::vector<float>{1, 1, 4}));
}

TEST(Fp8Scaling, HistoryLengthOneIsTheCurrentStepForBothAlgorithms) {
  for (AmaxAlgo algo : {AmaxAlgo::max, AmaxAlgo::most_recent}) {
    ScalingState s(delayed(1, algo));
    s.add_linear("l");
    const auto got = run_steps(s, {{2, 1, 1}, {4, 1, 1}, {1, 1, 1}});
    // x: 448/2, 448/4, 448/1: nothing older is remembered.
    EXPECT_EQ(got[0].x, 224.0f) << loom::fp8::name(algo);
    EXPECT_EQ(got[1].x, 112.0f) << loom::fp8::name(algo);
    EXPECT_EQ(got[2].x, 448.0f) << loom::fp8::name(algo);
    EXPECT_EQ(s.history(0, Role::x), (std::vector<float>{1}));
  }
}

TEST(Fp8Scaling, MarginDividesByAPowerOfTwo) {
  ScalingState s(delayed(2, AmaxAlgo::max, /*margin=*/2));
  s.add_linear("l");
  const auto got = run_steps(s, {{2, 3, 7}});
  EXPECT_EQ(got[0].x, 56.0f);                  // 448 / 2 / 2^2
  EXPECT_EQ(got[0].w, 448.0f / 3.0f / 4.0f);   // 149.33333 / 4 = 37.333332 (fp32: the /4 is exact)
  EXPECT_EQ(got[0].dy, 2048.0f);               // 57344 / 7 = 8192 exactly, / 4
  // "e4m3" casts the gradient to E4M3 too: 448 / 7 / 2^2 = 16.
  ScalingState e(delayed(2, AmaxAlgo::max, 2, Formats::e4m3));
  e.add_linear("l");
  EXPECT_EQ(run_steps(e, {{2, 3, 7}})[0].dy, 16.0f);
  EXPECT_EQ(e.format(Role::dy), Format::e4m3);
  EXPECT_EQ(s.format(Role::dy), Format::e5m2);
}

TEST(Fp8Scaling, ZeroAndNonFiniteAmaxesKeepTheScaleAndAreCounted) {
  ScalingState s(delayed(2, AmaxAlgo::max));
  s.add_linear("l");
  // Step 1: every amax 0 (a linear that saw only zeros): the scales stay at 1; 3 skips.
  EXPECT_EQ(run_steps(s, {{0, 0, 0}})[0].x, 1.0f);
  EXPECT_EQ(s.skipped_updates(), 3);
  EXPECT_EQ(s.scale_inv(0, Role::dy), 1.0f);
  // Step 2: good amaxes.
  auto g = run_steps(s, {{2, 2, 2}})[0];
  EXPECT_EQ(g.x, 224.0f);
  EXPECT_EQ(s.skipped_updates(), 3);
  // Step 3: x inf, w NaN (recorded as +inf, so the all-reduce buffer holds no NaN),
  // dy NaN written straight into the buffer (as a reduction could): all kept, all counted.
  s.record_amax(0, Role::x, kInf);
  s.record_amax(0, Role::w, kNaN);
  EXPECT_EQ(s.step_amax()[ScalingState::slot(0, Role::w)], kInf);
  s.record_amax(0, Role::w, 5.0f);  // a later micro-batch does not hide the bad one
  EXPECT_EQ(s.step_amax()[ScalingState::slot(0, Role::w)], kInf);
  s.step_amax()[ScalingState::slot(0, Role::dy)] = kNaN;
  EXPECT_EQ(s.update_scales(), 3);
  EXPECT_EQ(s.scale(0, Role::x), 224.0f);
  EXPECT_EQ(s.scale(0, Role::w), 224.0f);
  EXPECT_EQ(s.scale(0, Role::dy), 28672.0f);  // 57344 / 2
  EXPECT_EQ(s.skipped_updates(), 6);
  EXPECT_EQ(s.nonfinite_amaxes(), 3);
  // The bad step entered the history as 0: with window {0, 1} the next scale is 448 / 1,
  // not held at 224 by the inf (nor skipped for the window's length).
  EXPECT_EQ(s.history(0, Role::x), (std::vector<float>{0, 2}));
  EXPECT_EQ(run_steps(s, {{1, 1, 1}})[0].x, 448.0f);
  EXPECT_EQ(s.skipped_updates(), 6);
  for (int64_t t = 0; t < s.tensors(); ++t) {
    EXPECT_TRUE(std::isfinite(s.scales()[t]) && s.scales()[t] > 0) << "scale " << t << " = " << s.scales()[t];
    EXPECT_TRUE(std::isfinite(s.scale_invs()[t]) && s.scale_invs()[t] > 0) << "scale_inv " << t;
  }
}

TEST(Fp8Scaling, ExtremeAmaxesNeverGiveAnInfOrZeroScale) {
  ScalingState s(delayed(1, AmaxAlgo::max, /*margin=*/126));
  s.add_linear("l");
  // x: amax 1e-39 (fp32 subnormal): 448 / 1e-39 overflows, so the scale is FLT_MAX (TE).
  // w: amax FLT_MAX: 448 / 3.4e38 / 2^126 = 1.6e-74 underflows to 0: kept (1) and counted.
  // dy: amax FLT_MIN (2^-126): 57344 / 2^-126 overflows: FLT_MAX.
  run_steps(s, {{1e-39f, FLT_MAX, FLT_MIN}});
  EXPECT_EQ(s.scale(0, Role::x), FLT_MAX);
  EXPECT_EQ(s.scale(0, Role::w), 1.0f);
  EXPECT_EQ(s.scale(0, Role::dy), FLT_MAX);
  EXPECT_EQ(s.skipped_updates(), 1);
  EXPECT_GT(s.scale_inv(0, Role::x), 0.0f) << "1 / FLT_MAX is subnormal, not 0";
  // Without the margin FLT_MAX is an ordinary amax: 448 / FLT_MAX = 1.3e-36, a normal float.
  ScalingState t(delayed(1, AmaxAlgo::max));
  t.add_linear("l");
  run_steps(t, {{1, FLT_MAX, 1}});
  EXPECT_EQ(t.scale(0, Role::w), 448.0f / FLT_MAX);
  EXPECT_GT(t.scale(0, Role::w), 0.0f);
}

TEST(Fp8Scaling, CurrentScalingUsesTheTensorsOwnAmax) {
  ScalingConfig cfg;
  cfg.scaling = Scaling::current;
  ScalingState s(cfg);
  s.add_linear("a");
  s.add_linear("b");
  EXPECT_EQ(s.current_scale(1, Role::x, 2.0f), 224.0f);      // 448 / 2
  EXPECT_EQ(s.current_scale(1, Role::dy, 2.0f), 28672.0f);   // 57344 / 2 (hybrid: E5M2)
  EXPECT_EQ(s.current_scale(1, Role::x, 8.0f), 56.0f);       // just in time: the next cast's own amax
  EXPECT_EQ(s.scale_inv(1, Role::x), 1.0f / 56.0f);
  EXPECT_EQ(s.current_scale(1, Role::x, 0.0f), 56.0f);       // 0: the previous scale, counted
  EXPECT_EQ(s.current_scale(1, Role::x, kNaN), 56.0f);       // NaN: the same, counted as non-finite
  EXPECT_EQ(s.current_scale(0, Role::w, kInf), 1.0f);        // before any good amax: 1
  EXPECT_EQ(s.skipped_updates(), 3);
  EXPECT_EQ(s.nonfinite_amaxes(), 2);
  // The step's amaxes are recorded for the log (max over the casts; NaN as inf) and cleared by the step.
  EXPECT_EQ(s.step_amax()[ScalingState::slot(1, Role::x)], kInf);
  EXPECT_EQ(s.step_amax()[ScalingState::slot(1, Role::dy)], 2.0f);
  EXPECT_EQ(s.update_scales(), 0);
  EXPECT_EQ(s.step_amax()[ScalingState::slot(1, Role::x)], 0.0f);
  EXPECT_TRUE(s.history(1, Role::x).empty());
}

TEST(Fp8Scaling, OneContiguousAmaxBufferReducedAcrossRanksGivesEqualScales) {
  // Two "ranks" see different amaxes; an elementwise max over the one buffer
  // (what one all-reduce does) makes every scale equal on both.
  ScalingState r0(delayed(4, AmaxAlgo::max)), r1(delayed(4, AmaxAlgo::max));
  for (auto* s : {&r0, &r1})
    for (int l = 0; l < 3; ++l) s->add_linear("layer." + std::to_string(l));
  ASSERT_EQ(r0.tensors(), 9);
  EXPECT_EQ(ScalingState::slot(2, Role::dy), 8);  // linear-major: 3 * linear + role
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> u(0.1f, 10.0f);
  for (int step = 0; step < 6; ++step) {
    for (int l = 0; l < 3; ++l)
      for (Role r : {Role::x, Role::w, Role::dy}) {
        r0.record_amax(l, r, u(gen));
        r1.record_amax(l, r, u(gen));
      }
    for (int64_t t = 0; t < 9; ++t) {
      const float m = std::max(r0.step_amax()[t], r1.step_amax()[t]);
      r0.step_amax()[t] = r1.step_amax()[t] = m;
    }
    r0.update_scales();
    r1.update_scales();
    for (int64_t t = 0; t < 9; ++t) ASSERT_EQ(r0.scales()[t], r1.scales()[t]) << "step " << step << " tensor " << t;
  }
  // A slot written through the buffer is the one record_amax writes.
  r0.record_amax(1, Role::w, 42.0f);
  EXPECT_EQ(r0.step_amax()[ScalingState::slot(1, Role::w)], 42.0f);
  EXPECT_EQ(r0.step_amax()[4], 42.0f);
}

TEST(Fp8Scaling, ConfigErrorsNameTheValue) {
  expect_error([] { loom::fp8::parse_formats("e5m2"); }, {"'e5m2'"});
  expect_error([] { loom::fp8::parse_amax_algo("mean"); }, {"'mean'"});
  expect_error([] { loom::fp8::parse_scaling("block"); }, {"'block'"});
  EXPECT_EQ(loom::fp8::parse_formats("hybrid"), Formats::hybrid);
  EXPECT_EQ(loom::fp8::parse_amax_algo("most_recent"), AmaxAlgo::most_recent);
  EXPECT_EQ(loom::fp8::parse_scaling("current"), Scaling::current);
  expect_error([] { ScalingState s(delayed(0, AmaxAlgo::max)); }, {"amax_history_len = 0"});
  expect_error([] { ScalingState s(delayed(1, AmaxAlgo::max, -1)); }, {"margin = -1"});
  expect_error([] { ScalingState s(delayed(1, AmaxAlgo::max, 127)); }, {"margin = 127"});
  expect_error([] {
    ScalingState s(delayed(1, AmaxAlgo::max));
    s.add_linear("a");
    s.update_scales();
    s.add_linear("late");
  }, {"'late'"});
  expect_error([] {
    ScalingState s(delayed(1, AmaxAlgo::max));
    s.add_linear("a");
    s.record_amax(1, Role::x, 1.0f);
  }, {"linear 1"});
}

// ============================== emulated GEMMs ==============================

using Mat = std::vector<float>;

Mat random_matrix(std::mt19937_64& gen, int64_t rows, int64_t ld, float sigma) {
  std::normal_distribution<float> d(0.0f, sigma);
  Mat a(static_cast<size_t>(rows * ld));
  for (auto& v : a) v = d(gen);
  return a;
}

// The quantised operand, computed here with the scalar codec (tested above),
// not with the batched helpers the GEMMs use.
Mat fake_quant(const Mat& a, int64_t rows, int64_t cols, int64_t ld, float scale, Format f) {
  Mat q(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      q[r * cols + c] = loom::fp8::decode(loom::fp8::encode(a[r * ld + c] * scale, f), f) / scale;
  return q;
}

float amax_of(const Mat& a, int64_t rows, int64_t cols, int64_t ld) {
  float m = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) m = std::max(m, std::fabs(a[r * ld + c]));
  return m;
}

// C[i, j] = sum_p A(i, p) B(p, j) in fp64, with accessors for the layouts; also
// sum_p |A(i, p) B(p, j)| for the rounding bound.
template <typename FA, typename FB>
void gemm64(int64_t rows, int64_t cols, int64_t inner, FA a, FB b, std::vector<double>& c, std::vector<double>& abs) {
  c.assign(static_cast<size_t>(rows * cols), 0.0);
  abs.assign(static_cast<size_t>(rows * cols), 0.0);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      double s = 0, sa = 0;
      for (int64_t p = 0; p < inner; ++p) {
        const double t = static_cast<double>(a(i, p)) * static_cast<double>(b(p, j));
        s += t;
        sa += std::fabs(t);
      }
      c[i * cols + j] = s;
      abs[i * cols + j] = sa;
    }
}

// fp32 accumulation of an inner product of length k, in any summation order
// (BLAS blocks and uses FMA), errs by at most gamma_k * sum |a_p b_p| with
// gamma_k = k u / (1 - k u), u = 2^-24 (Higham, Accuracy and Stability, 3.1);
// the product's own rounding and the final beta = 1 add (one more term: the
// residual) are covered by taking k + 2 terms. This is a worst case: the
// observed error is ~sqrt(k) times smaller, so an operand quantised
// differently (errors of ~1e-2 relative) cannot hide inside it.
double gamma(int64_t k) {
  const double u = std::ldexp(1.0, -24);
  return static_cast<double>(k + 2) * u / (1 - static_cast<double>(k + 2) * u);
}

TEST(Fp8EmulatedGemm, MatchesAnFp64GemmOfTheSameQuantisedInputs) {
  std::mt19937_64 gen(11);
  const int64_t m = 37, k = 300, n = 29;  // odd sizes; strided views for x, y, dy, dx
  const int64_t ldx = k + 5, ldy = n + 3, lddy = n + 2, lddx = k + 1;
  const Formats formats = Formats::hybrid;
  const Format fx = loom::fp8::role_format(formats, Role::x), fw = loom::fp8::role_format(formats, Role::w),
               fdy = loom::fp8::role_format(formats, Role::dy);
  ASSERT_EQ(fdy, Format::e5m2) << "hybrid casts gradients to E5M2";
  const Mat x = random_matrix(gen, m, ldx, 1.0f), w = random_matrix(gen, n, k, 0.05f),
            dy = random_matrix(gen, m, lddy, 1e-3f), residual = random_matrix(gen, m, ldy, 1.0f);
  // Delayed-scaling-like scales (not powers of two, so the division in q() rounds).
  const float sx = 448.0f / amax_of(x, m, k, ldx), sw = 448.0f / amax_of(w, n, k, k),
              sdy = 57344.0f / amax_of(dy, m, n, lddy) / 2.0f;
  const Mat qx = fake_quant(x, m, k, ldx, sx, fx), qw = fake_quant(w, n, k, k, sw, fw),
            qdy = fake_quant(dy, m, n, lddy, sdy, fdy);
  std::vector<float> ws(static_cast<size_t>(loom::fp8::emulated_workspace_floats(m, k, n)));
  const loom::fp8::Operand ox{x.data(), ldx, sx, fx}, ow{w.data(), k, sw, fw}, ody{dy.data(), lddy, sdy, fdy};
  std::vector<double> ref, abs;

  // forward, accumulating onto the residual: y = residual + q(x) q(w)^T
  Mat y = residual;
  const auto famax = loom::fp8::emulated_linear_forward(y.data(), ldy, ox, ow, m, k, n, true, ws.data());
  EXPECT_EQ(famax.first, amax_of(x, m, k, ldx));
  EXPECT_EQ(famax.second, amax_of(w, n, k, k));
  gemm64(m, n, k, [&](int64_t i, int64_t p) { return qx[i * k + p]; },
         [&](int64_t p, int64_t j) { return qw[j * k + p]; }, ref, abs);
  double worst = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const double r = residual[i * ldy + j];
      const double err = std::fabs(y[i * ldy + j] - (ref[i * n + j] + r));
      const double tol = gamma(k) * (abs[i * n + j] + std::fabs(r));
      worst = std::max(worst, err / tol);
      ASSERT_LE(err, tol) << "forward y[" << i << "," << j << "]";
    }
  EXPECT_EQ(y[ldy - 1], residual[ldy - 1]) << "padding of y's rows untouched";
  std::printf("forward: worst error / bound = %.3g\n", worst);

  // dgrad: dx = q(dy) q(w)
  Mat dx(static_cast<size_t>(m * lddx), -7.0f);
  const auto damax = loom::fp8::emulated_linear_backward_input(dx.data(), lddx, ody, ow, m, k, n, ws.data());
  EXPECT_EQ(damax.first, amax_of(dy, m, n, lddy));
  gemm64(m, k, n, [&](int64_t i, int64_t p) { return qdy[i * n + p]; },
         [&](int64_t p, int64_t j) { return qw[p * k + j]; }, ref, abs);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < k; ++j)
      ASSERT_LE(std::fabs(dx[i * lddx + j] - ref[i * k + j]), gamma(n) * abs[i * k + j])
          << "dgrad dx[" << i << "," << j << "]";
  EXPECT_EQ(dx[lddx - 1], -7.0f) << "padding of dx's rows untouched";

  // wgrad, accumulating onto an earlier micro-batch's dw: dw = dw0 + q(dy)^T q(x)
  const Mat dw0 = random_matrix(gen, n, k, 1e-3f);
  Mat dw = dw0;
  const auto wamax = loom::fp8::emulated_linear_backward_weight(dw.data(), ody, ox, m, k, n, true, ws.data());
  EXPECT_EQ(wamax.second, amax_of(x, m, k, ldx));
  gemm64(n, k, m, [&](int64_t i, int64_t p) { return qdy[p * n + i]; },
         [&](int64_t p, int64_t j) { return qx[p * k + j]; }, ref, abs);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < k; ++j) {
      const double r = dw0[i * k + j];
      ASSERT_LE(std::fabs(dw[i * k + j] - (ref[i * k + j] + r)), gamma(m) * (abs[i * k + j] + std::fabs(r)))
          << "wgrad dw[" << i << "," << j << "]";
    }
}

// |q(a) - a| for one element: round to nearest in the normal range errs by at
// most 2^-(M+1) relative (M mantissa bits: 2^-4 for E4M3, 2^-3 for E5M2); in
// the subnormal range by half the subnormal unit, over the scale. The fp32
// product a * s and quotient / s add 2^-24 relative each (2^-22 covers both).
double quant_error_bound(double a, float scale, Format f) {
  const double rel = f == Format::e4m3 ? std::ldexp(1.0, -4) : std::ldexp(1.0, -3);
  return (rel + std::ldexp(1.0, -22)) * std::fabs(a) + 0.5 * loom::fp8::subnormal_unit(f) / scale * (1 + 1e-6);
}

TEST(Fp8EmulatedGemm, QuantisationErrorIsWithinTheE4M3Bound) {
  std::mt19937_64 gen(12);
  const int64_t m = 64, k = 512, n = 48;
  const Mat x = random_matrix(gen, m, k, 1.0f), w = random_matrix(gen, n, k, 0.02f);
  const float sx = 448.0f / amax_of(x, m, k, k), sw = 448.0f / amax_of(w, n, k, k);
  std::vector<float> ws(static_cast<size_t>(loom::fp8::emulated_workspace_floats(m, k, n)));
  Mat y(static_cast<size_t>(m * n));
  loom::fp8::emulated_linear_forward(y.data(), n, {x.data(), k, sx, Format::e4m3}, {w.data(), k, sw, Format::e4m3},
                                     m, k, n, false, ws.data());
  std::vector<double> exact, abs;
  gemm64(m, n, k, [&](int64_t i, int64_t p) { return x[i * k + p]; },
         [&](int64_t p, int64_t j) { return w[j * k + p]; }, exact, abs);
  // Elementwise, a rigorous bound: |q(x)q(w) - xw| <= ex |w| + |x| ew + ex ew per
  // term, plus the fp32 accumulation of the quantised products (gamma above).
  double err2 = 0, ref2 = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double bound = 0, qabs = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double a = x[i * k + p], b = w[j * k + p];
        const double ea = quant_error_bound(a, sx, Format::e4m3), eb = quant_error_bound(b, sw, Format::e4m3);
        bound += ea * std::fabs(b) + std::fabs(a) * eb + ea * eb;
        qabs += (std::fabs(a) + ea) * (std::fabs(b) + eb);
      }
      bound += gamma(k) * qabs;
      const double err = std::fabs(y[i * n + j] - exact[i * n + j]);
      ASSERT_LE(err, bound) << "y[" << i << "," << j << "] = " << y[i * n + j] << ", exact " << exact[i * n + j];
      err2 += err * err;
      ref2 += exact[i * n + j] * exact[i * n + j];
    }
  // In the aggregate. Rounding errors of Gaussian inputs are spread evenly
  // over [-half ulp, +half ulp]: an E4M3 operand with significand s in [1, 2)
  // errs by 2^-4 / s relative at most, RMS 2^-4 / (sqrt(3) s). Independent
  // errors of the two operands add in quadrature, and the sum over k of
  // independent terms keeps the ratio, so the relative Frobenius error of the
  // product is
  //   at most  sqrt(2) * 2^-4 / sqrt(3) = 0.051      (s = 1 everywhere), and
  //   about    0.051 * sqrt(E[1/s^2]) = 0.051 * 0.736 = 0.0375
  // for significands spread log-uniformly over the binade (E[1/s^2] =
  // (1/2 - 1/8) / ln 2 = 0.541). The lower end, 0.030, fails a GEMM that
  // quantised one operand only (0.0375 / sqrt(2) = 0.0265) or none (~1e-7);
  // the upper end one that used E5M2 for either (0.059 and up).
  const double rel = std::sqrt(err2 / ref2);
  std::printf("relative Frobenius error of the E4M3 GEMM: %.4f (expected about 0.0375)\n", rel);
  EXPECT_LE(rel, std::sqrt(2.0) * std::ldexp(1.0, -4) / std::sqrt(3.0));
  EXPECT_GE(rel, 0.030);
}

TEST(Fp8EmulatedGemm, BadArgumentsAreRefusedWithTheirValues) {
  std::vector<float> a(16, 1.0f), ws(64);
  expect_error([&] {
    loom::fp8::emulated_linear_forward(a.data(), 2, {a.data(), 2, 0.0f, Format::e4m3},
                                       {a.data(), 2, 1.0f, Format::e4m3}, 2, 2, 2, false, ws.data());
  }, {"scale of x is 0"});
  expect_error([&] {
    loom::fp8::emulated_linear_forward(a.data(), 2, {a.data(), 1, 1.0f, Format::e4m3},
                                       {a.data(), 2, 1.0f, Format::e4m3}, 2, 2, 2, false, ws.data());
  }, {"row stride of x is 1"});
  expect_error([&] {
    loom::fp8::emulated_linear_backward_weight(a.data(), {a.data(), 2, 1.0f, Format::e5m2},
                                               {a.data(), 2, 1.0f, Format::e4m3}, 2, 2, 2, false, nullptr);
  }, {"needs 8 floats"});
}

}  // namespace
