// CPU reference kernels, the fp32 GEMM helpers and the naive attention:
// analytic gradients against float64 central finite differences, float
// kernels against their double versions, hand-written references for the
// forward-only kernels, and bitwise determinism across thread counts.
//
// Tolerances. Gradients are checked as ||g - g_fd|| / ||g_fd|| <= 1e-6 where
// g_fd comes from central differences of the double kernels with h = 1e-6 on
// inputs of order 1: truncation error is O(h^2 |L'''|) ~ 1e-12 and rounding
// error O(eps |L| / h) ~ 1e-16 * 10 / 1e-6 = 1e-9, so the measured errors are
// ~1e-9..1e-8, leaving two orders of margin while any wrong term in a gradient
// (errors of order 1e-2 and up) fails. Float kernels are compared with their
// double versions at <= 1e-5 relative: fp32 rounding (6e-8 per operation) over
// the few dozen operations per output stays near 1e-7..1e-6.
#include <gtest/gtest.h>
#include <omp.h>

#include <array>
#include <boost/dll/shared_library.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "alloc_counter.hpp"
#include "attention/naive/attention_naive_cpu.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "kernels/cpu/gemm_paths.hpp"
#include "loom/attention.hpp"
#include "loom/error.hpp"
#include "loom/plugin.hpp"
#include "loom/precision.hpp"
#include "loom/cpu_gemm.hpp"

namespace {

using Vec = std::vector<double>;
using FVec = std::vector<float>;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kGradTol = 1e-6;   // analytic vs central differences (see the top of the file)
constexpr double kFloatTol = 1e-5;  // float kernel vs double kernel

// A seed per test, derived from the test's name (FNV-1a, stable across
// platforms), so each test draws its own numbers and a failure reproduces.
uint64_t test_seed() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(info->test_suite_name()) + "." + info->name();
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return h;
}

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed) : gen(seed) {}
  Vec uniform(size_t n, double lo = -1.0, double hi = 1.0) {
    std::uniform_real_distribution<double> d(lo, hi);
    Vec v(n);
    for (double& x : v) x = d(gen);
    return v;
  }
  int64_t integer(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(gen); }
};

FVec to_float(const Vec& v) { return FVec(v.begin(), v.end()); }
Vec to_double(const FVec& v) { return Vec(v.begin(), v.end()); }

double norm(const Vec& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}
// ||a - b|| / ||b||; NaN anywhere (an unwritten, poisoned element) gives NaN, which fails every <=.
double rel_err(const Vec& a, const Vec& b) {
  EXPECT_EQ(a.size(), b.size());
  Vec d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return norm(d) / norm(b);
}
double rel_err(const FVec& a, const Vec& b) { return rel_err(to_double(a), b); }

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central differences of f() with respect to every element of x (perturbed in place).
Vec numeric_grad(Vec& x, const std::function<double()>& f, double h = 1e-6) {
  Vec g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + h;
    const double fp = f();
    x[i] = saved - h;
    const double fm = f();
    x[i] = saved;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

Vec minus(const Vec& a, const Vec& b) {
  Vec d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

bool bitwise_equal(const FVec& a, const FVec& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const loom::Error& e) {
    return e.what();
  }
  return "(no loom::Error thrown)";
}

// Runs f with the given OpenMP thread count, restoring the previous one.
template <typename F>
void with_threads(int n, F&& f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(n);
  f();
  omp_set_num_threads(saved);
}

// ---------------------------------------------------------------------------
// Embedding
// ---------------------------------------------------------------------------
TEST(CpuKernels, EmbeddingForwardGathersRows) {
  Rng rng(test_seed());
  const int64_t V = 9, h = 70, N = 13;
  Vec wte = rng.uniform(V * h);
  std::vector<int32_t> tok(N);
  for (auto& t : tok) t = static_cast<int32_t>(rng.integer(0, V - 1));
  Vec out(N * h, kNaN);
  loom::cpu::embedding_forward(out.data(), tok.data(), wte.data(), N, h);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < h; ++j) ASSERT_EQ(out[n * h + j], wte[tok[n] * h + j]) << "n=" << n << " j=" << j;
  FVec outf(N * h, NAN), wtef = to_float(wte);
  loom::cpu::embedding_forward(outf.data(), tok.data(), wtef.data(), N, h);
  for (int64_t n = 0; n < N; ++n)  // a copy: exact
    for (int64_t j = 0; j < h; ++j) ASSERT_EQ(outf[n * h + j], wtef[tok[n] * h + j]) << "n=" << n << " j=" << j;
  EXPECT_LE(rel_err(outf, out), kFloatTol);
}

TEST(CpuKernels, CheckTokensNamesTheFirstBadToken) {
  const std::vector<int32_t> good = {0, 3, 9}, bad = {0, 10, -1};
  EXPECT_NO_THROW(loom::cpu::check_tokens(good.data(), 3, 10));
  EXPECT_TRUE(std::string(error_of([&] { loom::cpu::check_tokens(bad.data(), 3, 10); })).find(
                  "token id 10 at position 1") != std::string::npos);
  const std::vector<int32_t> neg = {4, -1};
  EXPECT_THROW(loom::cpu::check_tokens(neg.data(), 2, 10), loom::Error);
}

TEST(CpuKernels, EmbeddingBackwardMatchesFiniteDifferences) {
  Rng rng(test_seed());
  const int64_t V = 6, h = 67, N = 11;  // h > 64: several column blocks
  Vec wte = rng.uniform(V * h), R = rng.uniform(N * h), g0 = rng.uniform(V * h);
  std::vector<int32_t> tok(N);
  for (auto& t : tok) t = static_cast<int32_t>(rng.integer(0, V - 2));  // repeats; row V-1 never hit
  tok[3] = tok[7];
  auto loss = [&] {
    Vec out(N * h);
    loom::cpu::embedding_forward(out.data(), tok.data(), wte.data(), N, h);
    return dot(out, R);
  };
  // The kernel adds onto dwte: start from g0 and check the increment.
  Vec dwte = g0;
  loom::cpu::embedding_backward(dwte.data(), R.data(), tok.data(), N, h);
  const double err = rel_err(minus(dwte, g0), numeric_grad(wte, loss));
  EXPECT_LE(err, kGradTol);
  for (int64_t j = 0; j < h; ++j) EXPECT_EQ(dwte[(V - 1) * h + j], g0[(V - 1) * h + j]);
}

TEST(CpuKernels, EmbeddingBackwardIsBitwiseDeterministic) {
  Rng rng(test_seed());
  const int64_t V = 5, h = 300, N = 257;  // many repeats per row, many column blocks
  FVec dout = to_float(rng.uniform(N * h));
  std::vector<int32_t> tok(N);
  for (auto& t : tok) t = static_cast<int32_t>(rng.integer(0, V - 1));
  FVec a(V * h, 0.f), b(V * h, 0.f);
  with_threads(1, [&] { loom::cpu::embedding_backward(a.data(), dout.data(), tok.data(), N, h); });
  with_threads(2, [&] { loom::cpu::embedding_backward(b.data(), dout.data(), tok.data(), N, h); });
  EXPECT_TRUE(bitwise_equal(a, b));
}

// ---------------------------------------------------------------------------
// RMSNorm
// ---------------------------------------------------------------------------
TEST(CpuKernels, RmsnormForwardMatchesDefinition) {
  Rng rng(test_seed());
  const int64_t N = 5, h = 37;
  const double eps = 1e-5;
  Vec x = rng.uniform(N * h), w = rng.uniform(h, 0.5, 1.5), out(N * h, kNaN), rstd(N, kNaN);
  loom::cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, h, eps);
  Vec ref(N * h);
  for (int64_t n = 0; n < N; ++n) {
    double ms = 0;
    for (int64_t j = 0; j < h; ++j) ms += x[n * h + j] * x[n * h + j] / h;
    for (int64_t j = 0; j < h; ++j) ref[n * h + j] = x[n * h + j] / std::sqrt(ms + eps) * w[j];
    EXPECT_NEAR(rstd[n], 1 / std::sqrt(ms + eps), 1e-12);
  }
  EXPECT_LE(rel_err(out, ref), 1e-14);
  FVec outf(N * h, NAN), rstdf(N, NAN), xf = to_float(x), wf = to_float(w);
  loom::cpu::rmsnorm_forward(outf.data(), rstdf.data(), xf.data(), wf.data(), N, h, static_cast<float>(eps));
  EXPECT_LE(rel_err(outf, out), kFloatTol);
  EXPECT_LE(rel_err(rstdf, rstd), kFloatTol);
}

TEST(CpuKernels, RmsnormBackwardMatchesFiniteDifferences) {
  Rng rng(test_seed());
  const int64_t N = 4, h = 70;  // h > 64: dw spans two column blocks
  const double eps = 1e-5;
  Vec x = rng.uniform(N * h), w = rng.uniform(h, 0.5, 1.5), R = rng.uniform(N * h);
  auto loss = [&] {
    Vec out(N * h), rstd(N);
    loom::cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, h, eps);
    return dot(out, R);
  };
  Vec out(N * h), rstd(N);
  loom::cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, h, eps);
  // Both dx and dw accumulate: start from random values and check the increments.
  Vec dx0 = rng.uniform(N * h), dw0 = rng.uniform(h), dx = dx0, dw = dw0;
  loom::cpu::rmsnorm_backward(dx.data(), dw.data(), R.data(), x.data(), w.data(), rstd.data(), N, h);
  const double ex = rel_err(minus(dx, dx0), numeric_grad(x, loss));
  const double ew = rel_err(minus(dw, dw0), numeric_grad(w, loss));
  EXPECT_LE(ex, kGradTol);
  EXPECT_LE(ew, kGradTol);
  // float backward against double backward
  FVec xf = to_float(x), wf = to_float(w), Rf = to_float(R), rf = to_float(rstd), dxf(N * h, 0.f), dwf(h, 0.f);
  loom::cpu::rmsnorm_backward(dxf.data(), dwf.data(), Rf.data(), xf.data(), wf.data(), rf.data(), N, h);
  EXPECT_LE(rel_err(dxf, minus(dx, dx0)), kFloatTol);
  EXPECT_LE(rel_err(dwf, minus(dw, dw0)), kFloatTol);
}

TEST(CpuKernels, RmsnormIsBitwiseDeterministic) {
  Rng rng(test_seed());
  const int64_t N = 301, h = 200;
  FVec x = to_float(rng.uniform(N * h)), w = to_float(rng.uniform(h)), dout = to_float(rng.uniform(N * h));
  FVec out[2], rstd[2], dx[2], dw[2];
  for (int t = 0; t < 2; ++t) {
    out[t].assign(N * h, NAN), rstd[t].assign(N, NAN), dx[t].assign(N * h, 0.f), dw[t].assign(h, 0.f);
    with_threads(t + 1, [&] {
      loom::cpu::rmsnorm_forward(out[t].data(), rstd[t].data(), x.data(), w.data(), N, h, 1e-6f);
      loom::cpu::rmsnorm_backward(dx[t].data(), dw[t].data(), dout.data(), x.data(), w.data(), rstd[t].data(), N, h);
    });
  }
  EXPECT_TRUE(bitwise_equal(out[0], out[1]));
  EXPECT_TRUE(bitwise_equal(dx[0], dx[1]));
  EXPECT_TRUE(bitwise_equal(dw[0], dw[1]));
}

// ---------------------------------------------------------------------------
// RoPE
// ---------------------------------------------------------------------------
TEST(CpuKernels, RopeBackwardMatchesFiniteDifferences) {
  Rng rng(test_seed());
  const int64_t B = 2, S = 5, nh = 3, D = 8, row_stride = nh * D + 5;  // padded rows, as in a fused buffer
  const double theta = 10000.0;
  Vec x = rng.uniform(B * S * row_stride), R = rng.uniform(B * S * row_stride);
  // The padding is not part of the tensor: mark it, and give it no weight in L.
  for (int64_t r = 0; r < B * S; ++r)
    for (int64_t c = nh * D; c < row_stride; ++c) x[r * row_stride + c] = 123.0, R[r * row_stride + c] = 0.0;
  auto loss = [&] {
    Vec y = x;
    loom::cpu::rope_forward(y.data(), B, S, nh, D, row_stride, theta);
    return dot(y, R);
  };
  Vec y = x;
  loom::cpu::rope_forward(y.data(), B, S, nh, D, row_stride, theta);
  for (int64_t r = 0; r < B * S; ++r)
    for (int64_t c = nh * D; c < row_stride; ++c) ASSERT_EQ(y[r * row_stride + c], 123.0) << "padding written";
  Vec g = R;
  loom::cpu::rope_backward(g.data(), B, S, nh, D, row_stride, theta);
  EXPECT_LE(rel_err(g, numeric_grad(x, loss)), kGradTol);
  // Position 0 is the identity; backward undoes forward.
  for (int64_t c = 0; c < nh * D; ++c) EXPECT_EQ(y[c], x[c]);
  Vec back = y;
  loom::cpu::rope_backward(back.data(), B, S, nh, D, row_stride, theta);
  EXPECT_LE(rel_err(back, x), 1e-15);
  FVec xf = to_float(x);
  loom::cpu::rope_forward(xf.data(), B, S, nh, D, row_stride, theta);
  EXPECT_LE(rel_err(xf, y), kFloatTol);
}

// RoPE at given positions (train.reset_position_ids: positions restart at
// every document): row (b, s) at position p is rotated exactly as the plain
// kernel rotates a row at index p, bit for bit (the same angle table), for
// positions that restart anywhere, in float and double; positions s give the
// plain kernel's bits; backward undoes forward; a position outside [0, S)
// is refused before anything is written.
TEST(CpuKernels, RopeAtPositionsIsTheRotationOfThatIndex) {
  Rng rng(test_seed());
  std::mt19937 gen(static_cast<uint32_t>(test_seed()));
  const int64_t B = 3, S = 11, nh = 2, D = 8, row_stride = nh * D + 3;
  const double theta = 10000.0;
  for (int trial = 0; trial < 4; ++trial) {
    std::vector<int32_t> pos(B * S);
    for (int64_t b = 0; b < B; ++b) {  // documents of random lengths: positions restart at their starts
      int32_t p = 0;
      for (int64_t i = 0; i < S; ++i) pos[b * S + i] = (i > 0 && gen() % 3 == 0) ? (p = 0) : (i == 0 ? 0 : ++p);
    }
    const Vec x = rng.uniform(B * S * row_stride);
    Vec y = x;
    loom::cpu::rope_forward(y.data(), B, S, nh, D, row_stride, theta, pos.data());
    FVec yf = to_float(x);
    loom::cpu::rope_forward(yf.data(), B, S, nh, D, row_stride, theta, pos.data());
    for (int64_t r = 0; r < B * S; ++r) {
      // The plain kernel on one row placed at index pos[r] of an otherwise zero sequence.
      Vec one(S * row_stride, 0.0);
      FVec onef(S * row_stride, 0.f);
      const int64_t p = pos[r];
      for (int64_t c = 0; c < row_stride; ++c) one[p * row_stride + c] = x[r * row_stride + c];
      for (int64_t c = 0; c < row_stride; ++c) onef[p * row_stride + c] = static_cast<float>(x[r * row_stride + c]);
      loom::cpu::rope_forward(one.data(), 1, S, nh, D, row_stride, theta);
      loom::cpu::rope_forward(onef.data(), 1, S, nh, D, row_stride, theta);
      for (int64_t c = 0; c < row_stride; ++c) {
        ASSERT_EQ(y[r * row_stride + c], one[p * row_stride + c]) << "row " << r << " at " << p << " col " << c;
        ASSERT_EQ(yf[r * row_stride + c], onef[p * row_stride + c]) << "row " << r << " at " << p << " col " << c;
      }
    }
    Vec back = y;
    loom::cpu::rope_backward(back.data(), B, S, nh, D, row_stride, theta, pos.data());
    EXPECT_LE(rel_err(back, x), 1e-15);
  }
  std::vector<int32_t> ident(B * S);
  for (int64_t i = 0; i < B * S; ++i) ident[i] = static_cast<int32_t>(i % S);
  FVec a = to_float(rng.uniform(B * S * row_stride)), b = a;
  loom::cpu::rope_forward(a.data(), B, S, nh, D, row_stride, theta);
  loom::cpu::rope_forward(b.data(), B, S, nh, D, row_stride, theta, ident.data());
  EXPECT_TRUE(bitwise_equal(a, b));
  ident[5] = static_cast<int32_t>(S);
  FVec c = a;
  const std::string msg =
      error_of([&] { loom::cpu::rope_forward(c.data(), B, S, nh, D, row_stride, theta, ident.data()); });
  EXPECT_NE(msg.find("rope: position 11 of row 5 is outside [0, S = 11)"), std::string::npos) << msg;
  EXPECT_TRUE(bitwise_equal(c, a)) << "a refused call wrote";
}

// HF transformers builds the rotary table in fp32 (LlamaRotaryEmbedding):
//   inv_freq = 1.0 / (theta ** (arange(0, D, 2).float() / D)); freqs = pos * inv_freq;
//   cos/sin in fp32; q * cos + rotate_half(q) * sin in fp32.
// Written here step by step in float as an independent reference.
void rope_hf_fp32(float* x, int64_t S, int64_t D, double theta) {
  const int64_t half = D / 2;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = 0; i < half; ++i) {
      const float inv_freq = 1.0f / std::pow(static_cast<float>(theta), static_cast<float>(2 * i) / static_cast<float>(D));
      const float ang = static_cast<float>(s) * inv_freq;
      const float c = std::cos(ang), sn = std::sin(ang);
      float* v = x + s * D;
      const float x1 = v[i], x2 = v[i + half];
      v[i] = x1 * c + (-x2) * sn;
      v[i + half] = x2 * c + x1 * sn;
    }
}

TEST(CpuKernels, RopeMatchesHfFp32AtLongPositions) {
  Rng rng(test_seed());
  for (double theta : {10000.0, 500000.0}) {
    for (int64_t D : {64, 128}) {
      const int64_t S = 4096;
      FVec x = to_float(rng.uniform(S * D)), hf = x, ours = x;
      rope_hf_fp32(hf.data(), S, D, theta);
      loom::cpu::rope_forward(ours.data(), 1, S, 1, D, D, theta);
      const double err = rel_err(ours, to_double(hf));
      EXPECT_LE(err, 1e-6) << "theta=" << theta << " D=" << D;
      // The premise of the fp32 table: exact angles would miss HF by far more.
      Vec exact = to_double(x);
      const int64_t half = D / 2;
      for (int64_t s = 0; s < S; ++s)
        for (int64_t i = 0; i < half; ++i) {
          const double a = s * std::pow(theta, -2.0 * i / D);
          const double x1 = exact[s * D + i], x2 = exact[s * D + i + half];
          exact[s * D + i] = x1 * std::cos(a) - x2 * std::sin(a);
          exact[s * D + i + half] = x2 * std::cos(a) + x1 * std::sin(a);
        }
      EXPECT_GT(rel_err(exact, to_double(hf)), 1e-5) << "theta=" << theta << " D=" << D;
    }
  }
}

// ---------------------------------------------------------------------------
// SwiGLU, residual
// ---------------------------------------------------------------------------
TEST(CpuKernels, SwigluMatchesDefinitionAndFiniteDifferences) {
  Rng rng(test_seed());
  const int64_t n = 53;
  Vec gate = rng.uniform(n, -4, 4), up = rng.uniform(n, -2, 2), R = rng.uniform(n);
  Vec out(n, kNaN);
  loom::cpu::swiglu_forward(out.data(), gate.data(), up.data(), n);
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(out[i], gate[i] / (1 + std::exp(-gate[i])) * up[i], 1e-15);
  auto loss = [&] {
    Vec o(n);
    loom::cpu::swiglu_forward(o.data(), gate.data(), up.data(), n);
    return dot(o, R);
  };
  Vec dg(n, kNaN), du(n, kNaN);
  loom::cpu::swiglu_backward(dg.data(), du.data(), R.data(), gate.data(), up.data(), n);
  EXPECT_LE(rel_err(dg, numeric_grad(gate, loss)), kGradTol);
  EXPECT_LE(rel_err(du, numeric_grad(up, loss)), kGradTol);
  FVec gf = to_float(gate), uf = to_float(up), of(n, NAN);
  loom::cpu::swiglu_forward(of.data(), gf.data(), uf.data(), n);
  EXPECT_LE(rel_err(of, out), kFloatTol);
}

TEST(CpuKernels, ResidualAndAccumulate) {
  Rng rng(test_seed());
  const int64_t n = 1001;
  FVec a = to_float(rng.uniform(n)), b = to_float(rng.uniform(n)), out(n, NAN);
  loom::cpu::residual_forward(out.data(), a.data(), b.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[i], a[i] + b[i]);
  FVec alias = a;
  loom::cpu::residual_forward(alias.data(), alias.data(), b.data(), n);  // out aliases a
  EXPECT_TRUE(bitwise_equal(alias, out));
  FVec dst = a;
  loom::cpu::accumulate(dst.data(), b.data(), n);
  EXPECT_TRUE(bitwise_equal(dst, out));
  Vec ad = to_double(a), bd = to_double(b), od(n, kNaN);
  loom::cpu::residual_forward(od.data(), ad.data(), bd.data(), n);
  loom::cpu::accumulate(ad.data(), bd.data(), n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(od[i], ad[i]);
  EXPECT_LE(rel_err(out, od), kFloatTol);
}

// ---------------------------------------------------------------------------
// Cross-entropy
// ---------------------------------------------------------------------------
// -log softmax(l)[t] the plain way (no max subtraction: fine for |l| ~ 3).
double naive_ce(const Vec& l, const std::vector<int32_t>& t, int64_t N, int64_t V) {
  double total = 0;
  for (int64_t n = 0; n < N; ++n) {
    if (t[n] < 0) continue;
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(l[n * V + j]);
    total += std::log(s) - l[n * V + t[n]];
  }
  return total;
}

TEST(CpuKernels, CrossEntropyLossMatchesNaiveLogSoftmax) {
  Rng rng(test_seed());
  const int64_t N = 9, V = 31;
  Vec logits = rng.uniform(N * V, -3, 3);
  std::vector<int32_t> t(N);
  for (auto& x : t) x = static_cast<int32_t>(rng.integer(0, V - 1));
  t[2] = -1;  // ignored
  t[5] = -100;
  Vec copy = logits;
  const double loss = loom::cpu::cross_entropy(copy.data(), t.data(), N, V, 0.0);
  EXPECT_NEAR(loss, naive_ce(logits, t, N, V), 1e-12);
  EXPECT_EQ(rel_err(copy, logits), 0.0) << "scale 0 must leave the logits untouched";
  FVec lf = to_float(logits);
  EXPECT_NEAR(loom::cpu::cross_entropy(lf.data(), t.data(), N, V, 0.f), loss, 1e-5 * std::abs(loss));
  // Stability: a shift of +1000 would overflow a plain exp; the loss is shift-invariant.
  Vec shifted = logits;
  for (double& x : shifted) x += 1000.0;
  EXPECT_NEAR(loom::cpu::cross_entropy(shifted.data(), t.data(), N, V, 0.0), loss, 1e-9);
  FVec shiftedf = to_float(shifted);
  const double lossf = loom::cpu::cross_entropy(shiftedf.data(), t.data(), N, V, 0.f);
  EXPECT_TRUE(std::isfinite(lossf));
  EXPECT_NEAR(lossf, loss, 1e-3 * N);  // inputs rounded to fp32 at 1000 (ulp 6e-5): loss moves by ~1e-4 per row
}

TEST(CpuKernels, CrossEntropyGradientMatchesFiniteDifferences) {
  Rng rng(test_seed());
  const int64_t N = 6, V = 13;
  const double scale = 1.0 / 5;  // e.g. 1 / (number of counted tokens)
  Vec logits = rng.uniform(N * V, -3, 3);
  std::vector<int32_t> t(N);
  for (auto& x : t) x = static_cast<int32_t>(rng.integer(0, V - 1));
  t[4] = -1;
  auto loss = [&] {
    Vec c = logits;
    return scale * loom::cpu::cross_entropy(c.data(), t.data(), N, V, 0.0);
  };
  Vec g = logits;
  const double l = loom::cpu::cross_entropy(g.data(), t.data(), N, V, scale);
  EXPECT_NEAR(l * scale, loss(), 1e-14);
  EXPECT_LE(rel_err(g, numeric_grad(logits, loss)), kGradTol);
  for (int64_t j = 0; j < V; ++j) EXPECT_EQ(g[4 * V + j], 0.0) << "ignored row must get a zero gradient";
  FVec gf = to_float(logits);
  loom::cpu::cross_entropy(gf.data(), t.data(), N, V, static_cast<float>(scale));
  EXPECT_LE(rel_err(gf, g), kFloatTol);
}

TEST(CpuKernels, CrossEntropyRejectsTargetOutsideVocabulary) {
  const int64_t N = 3, V = 4;
  FVec logits(N * V, 0.5f), before = logits;
  std::vector<int32_t> t = {1, 4, 0};
  try {
    loom::cpu::cross_entropy(logits.data(), t.data(), N, V, 1.f);
    FAIL() << "expected loom::Error";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("target 4 at row 1"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(bitwise_equal(logits, before));
}

TEST(CpuKernels, CrossEntropyIsBitwiseDeterministic) {
  Rng rng(test_seed());
  const int64_t N = 700, V = 50;  // more rows than one staging batch (256)
  FVec logits = to_float(rng.uniform(N * V, -5, 5));
  std::vector<int32_t> t(N);
  for (auto& x : t) x = static_cast<int32_t>(rng.integer(-1, V - 1));
  FVec g1 = logits, g2 = logits;
  double l1 = 0, l2 = 0;
  with_threads(1, [&] { l1 = loom::cpu::cross_entropy(g1.data(), t.data(), N, V, 1.f / N); });
  with_threads(2, [&] { l2 = loom::cpu::cross_entropy(g2.data(), t.data(), N, V, 1.f / N); });
  EXPECT_EQ(std::memcmp(&l1, &l2, sizeof l1), 0) << l1 << " vs " << l2;
  EXPECT_TRUE(bitwise_equal(g1, g2));
}

// ---------------------------------------------------------------------------
// AdamW, norms
// ---------------------------------------------------------------------------
TEST(CpuKernels, AdamwMatchesScalarReference) {
  Rng rng(test_seed());
  const int64_t n = 37, steps = 6;
  const double lr = 3e-3, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1, gs = 0.5;
  Vec p = rng.uniform(n), m(n, 0.0), v(n, 0.0);
  const Vec p_init = p;
  Vec rp = p, rm = m, rv = v;
  FVec pf = to_float(p), mf(n, 0.f), vf(n, 0.f);
  for (int64_t step = 1; step <= steps; ++step) {
    Vec g = rng.uniform(n);
    // Reference, one scalar at a time, straight from the paper's algorithm.
    for (int64_t i = 0; i < n; ++i) {
      const double gi = g[i] * gs;
      rm[i] = b1 * rm[i] + (1 - b1) * gi;
      rv[i] = b2 * rv[i] + (1 - b2) * gi * gi;
      const double mh = rm[i] / (1 - std::pow(b1, step)), vh = rv[i] / (1 - std::pow(b2, step));
      rp[i] = rp[i] - lr * wd * rp[i] - lr * mh / (std::sqrt(vh) + eps);
    }
    loom::cpu::adamw(p.data(), g.data(), m.data(), v.data(), n, lr, b1, b2, eps, wd, step, gs);
    FVec gf = to_float(g);
    loom::cpu::adamw(pf.data(), gf.data(), mf.data(), vf.data(), n, static_cast<float>(lr), static_cast<float>(b1),
                     static_cast<float>(b2), static_cast<float>(eps), static_cast<float>(wd), step,
                     static_cast<float>(gs));
    EXPECT_LE(rel_err(p, rp), 1e-14) << "step " << step;
    EXPECT_LE(rel_err(m, rm), 1e-14) << "step " << step;
    EXPECT_LE(rel_err(v, rv), 1e-14) << "step " << step;
    EXPECT_LE(rel_err(pf, rp), kFloatTol) << "step " << step;
  }
  // The parameters moved by far more than the tolerances: a skipped update would show.
  EXPECT_GT(rel_err(p, p_init), 1e-3);
  // step is 1-based: step 0 would divide by 1 - beta^0 = 0.
  Vec g(n, 0.1);
  EXPECT_THROW(loom::cpu::adamw(p.data(), g.data(), m.data(), v.data(), n, lr, b1, b2, eps, wd, 0, gs), loom::Error);
}

TEST(CpuKernels, SqNormAndScale) {
  Rng rng(test_seed());
  const int64_t n = 300000 + 123;  // 74 chunks of 4096, the last one partial
  FVec x = to_float(rng.uniform(n));
  long double ref = 0;
  for (float v : x) ref += static_cast<long double>(v) * v;
  double s1 = 0, s2 = 0;
  with_threads(1, [&] { s1 = loom::cpu::sq_norm(x.data(), n); });
  with_threads(2, [&] { s2 = loom::cpu::sq_norm(x.data(), n); });
  EXPECT_NEAR(s1, static_cast<double>(ref), 1e-12 * s1);
  EXPECT_EQ(std::memcmp(&s1, &s2, sizeof s1), 0) << s1 << " vs " << s2;
  // A length past one staging batch (256 chunks of 4096).
  const int64_t big = 256 * 4096 + 4097;
  FVec y(big, 0.5f);
  EXPECT_EQ(loom::cpu::sq_norm(y.data(), big), 0.25 * big);
  Vec xd = to_double(x);
  EXPECT_NEAR(loom::cpu::sq_norm(xd.data(), n), s1, 1e-12 * s1);
  FVec xs = x;
  loom::cpu::scale(xs.data(), 0.25f, n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(xs[i], x[i] * 0.25f);
  loom::cpu::scale(xd.data(), 0.25, n);
  EXPECT_EQ(rel_err(xs, xd), 0.0);  // a power-of-two scale is exact
}

// ---------------------------------------------------------------------------
// Linear layer GEMMs (loom/cpu_gemm.hpp)
// ---------------------------------------------------------------------------
// Packs a [rows, cols] matrix into a buffer with row stride ld, padding = fill.
Vec pad_rows(const Vec& a, int64_t rows, int64_t cols, int64_t ld, double fill) {
  Vec b(rows * ld, fill);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) b[r * ld + c] = a[r * cols + c];
  return b;
}
Vec unpad_rows(const Vec& b, int64_t rows, int64_t cols, int64_t ld) {
  Vec a(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) a[r * cols + c] = b[r * ld + c];
  return a;
}
bool padding_is(const Vec& b, int64_t rows, int64_t cols, int64_t ld, double fill) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = cols; c < ld; ++c) {
      const double v = b[r * ld + c];
      if (!(std::isnan(fill) ? std::isnan(v) : v == fill)) return false;
    }
  return true;
}

TEST(Fp32Gemm, LinearForwardBackwardMatchFiniteDifferences) {
  Rng rng(test_seed());
  const int64_t m = 7, k = 5, n = 6;
  // Row strides wider than the rows: the helpers must honour views.
  const int64_t ldx = k + 3, ldy = n + 2, lddy = n + 1, lddx = k + 2;
  Vec x = rng.uniform(m * k), w = rng.uniform(n * k), R = rng.uniform(m * n);
  auto loss = [&] {
    Vec xb = pad_rows(x, m, k, ldx, 9.0), yb(m * ldy, 7.0);
    loom::cpu::linear_forward(yb.data(), ldy, xb.data(), ldx, w.data(), m, k, n);
    return dot(unpad_rows(yb, m, n, ldy), R);
  };
  // Forward against the definition y[i, o] = sum_c x[i, c] w[o, c].
  // y: NaN where the kernel must write, 7 in the padding it must leave alone.
  Vec xb = pad_rows(x, m, k, ldx, 9.0), yb = pad_rows(Vec(m * n, kNaN), m, n, ldy, 7.0);
  loom::cpu::linear_forward(yb.data(), ldy, xb.data(), ldx, w.data(), m, k, n);
  Vec y = unpad_rows(yb, m, n, ldy), yref(m * n, 0.0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t o = 0; o < n; ++o)
      for (int64_t c = 0; c < k; ++c) yref[r * n + o] += x[r * k + c] * w[o * k + c];
  EXPECT_LE(rel_err(y, yref), 1e-14);
  EXPECT_TRUE(padding_is(yb, m, n, ldy, 7.0)) << "y padding written";

  Vec dyb = pad_rows(R, m, n, lddy, 5.0), dxb(m * lddx, kNaN);
  loom::cpu::linear_backward_input(dxb.data(), lddx, dyb.data(), lddy, w.data(), m, k, n);
  EXPECT_LE(rel_err(unpad_rows(dxb, m, k, lddx), numeric_grad(x, loss)), kGradTol);
  EXPECT_TRUE(padding_is(dxb, m, k, lddx, kNaN)) << "dx padding written";

  const Vec dw_fd = numeric_grad(w, loss);
  Vec dw(n * k, kNaN);  // accumulate = false must overwrite (beta = 0 ignores NaN)
  loom::cpu::linear_backward_weight(dw.data(), dyb.data(), lddy, xb.data(), ldx, m, k, n, false);
  EXPECT_LE(rel_err(dw, dw_fd), kGradTol);
  Vec g0 = rng.uniform(n * k), dwa = g0;  // accumulate = true adds (micro-batches)
  loom::cpu::linear_backward_weight(dwa.data(), dyb.data(), lddy, xb.data(), ldx, m, k, n, true);
  EXPECT_LE(rel_err(minus(dwa, g0), dw_fd), kGradTol);

  // float against double
  FVec xf = to_float(xb), wf = to_float(w), yf(m * ldy, 7.f);
  loom::cpu::linear_forward(yf.data(), ldy, xf.data(), ldx, wf.data(), m, k, n);
  EXPECT_LE(rel_err(unpad_rows(to_double(yf), m, n, ldy), y), kFloatTol);
}

TEST(Fp32Gemm, RejectsRowStrideSmallerThanRow) {
  FVec x(12, 1.f), w(6, 1.f), y(8, 0.f);
  EXPECT_THROW(loom::cpu::linear_forward(y.data(), 2, x.data(), 2, w.data(), 4, 3, 2), loom::Error);  // ldx 2 < k 3
}

// The CPU GEMMs' definition (core/src/kernels/cpu/cpu_gemm.cpp): every output
// element is c = (accumulate ? C : 0), then c = fma(a_p, b_p, c) for p = 0..k-1,
// one rounding per step. fma is exactly specified by IEEE 754, so a plain loop of
// std::fma computes the same bits on any processor; the kernels must equal it
// bit for bit on each path (AVX2/FMA where the processor has it, and the portable
// one), with 1 and 2 threads, for shapes that leave partial tiles in m and n, k
// spanning several K blocks (256), strided views, and accumulate on and off. This
// is what makes CPU runs bitwise the same on Intel and AMD machines: an exact
// comparison, no tolerance.
namespace gemm_def {
template <typename T>
std::vector<T> rand_vec(Rng& rng, int64_t n) {
  std::uniform_real_distribution<double> d(-1.0, 1.0);
  std::vector<T> v(static_cast<size_t>(n));
  for (T& x : v) x = static_cast<T>(d(rng.gen));
  return v;
}
// C (ldc) = (acc ? C : 0) + A B by the definition, A(i, p) = a[i * ars + p * acs], B(p, j) = b[p * brs + j * bcs].
template <typename T>
void reference(T* c, int64_t ldc, const T* a, int64_t ars, int64_t acs, const T* b, int64_t brs, int64_t bcs,
               int64_t m, int64_t k, int64_t n, bool acc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      T v = acc ? c[i * ldc + j] : T(0);
      for (int64_t p = 0; p < k; ++p) v = std::fma(a[i * ars + p * acs], b[p * brs + j * bcs], v);
      c[i * ldc + j] = v;
    }
}
template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}
template <typename T>
void check_all_three(Rng& rng, int64_t m, int64_t k, int64_t n, const std::string& what) {
  SCOPED_TRACE(what + " m=" + std::to_string(m) + " k=" + std::to_string(k) + " n=" + std::to_string(n));
  const int64_t ldx = k + 3, ldy = n + 1, lddy = n + 2, lddx = k + 1;
  const std::vector<T> x = rand_vec<T>(rng, m * ldx), w = rand_vec<T>(rng, n * k), dy = rand_vec<T>(rng, m * lddy);
  for (const bool acc : {false, true}) {
    std::vector<T> y = rand_vec<T>(rng, m * ldy), yr = y;
    loom::cpu::linear_forward(y.data(), ldy, x.data(), ldx, w.data(), m, k, n, acc);
    reference(yr.data(), ldy, x.data(), ldx, 1, w.data(), 1, k, m, k, n, acc);
    EXPECT_TRUE(same_bits(y, yr)) << "forward, accumulate " << acc;
    std::vector<T> dw = rand_vec<T>(rng, n * k), dwr = dw;
    loom::cpu::linear_backward_weight(dw.data(), dy.data(), lddy, x.data(), ldx, m, k, n, acc);
    reference(dwr.data(), k, dy.data(), 1, lddy, x.data(), ldx, 1, n, m, k, acc);
    EXPECT_TRUE(same_bits(dw, dwr)) << "wgrad, accumulate " << acc;
  }
  std::vector<T> dx = rand_vec<T>(rng, m * lddx), dxr = dx;
  loom::cpu::linear_backward_input(dx.data(), lddx, dy.data(), lddy, w.data(), m, k, n);
  reference(dxr.data(), lddx, dy.data(), lddy, 1, w.data(), k, 1, m, n, k, false);
  EXPECT_TRUE(same_bits(dx, dxr)) << "dgrad";
}
struct PathGuard {
  loom::cpu::detail::GemmPath saved = loom::cpu::detail::gemm_path();
  ~PathGuard() { loom::cpu::detail::set_gemm_path(saved); }
};
}  // namespace gemm_def

TEST(CpuGemm, EveryElementIsTheFixedFmaChainOnEveryPath) {
  using loom::cpu::detail::GemmPath;
  gemm_def::PathGuard guard;
  std::vector<GemmPath> paths = {GemmPath::portable};
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) paths.push_back(GemmPath::avx2_fma);
  else std::printf("this processor has no AVX2 + FMA: only the portable path runs here\n");
  Rng rng(test_seed());
  // Shapes: single elements, partial tiles (6 rows, 16 / 8 columns), several jobs
  // (96 rows, 256 columns), several K blocks (k > 256), k = 1, and one random shape per path.
  std::vector<std::array<int64_t, 3>> shapes = {{1, 1, 1}, {5, 7, 3}, {6, 16, 16}, {7, 300, 17}, {97, 33, 257},
                                                {13, 513, 9}, {200, 64, 40}, {1, 1000, 1}};
  for (const GemmPath path : paths) {
    loom::cpu::detail::set_gemm_path(path);
    const std::string name = path == GemmPath::portable ? "portable" : "avx2_fma";
    auto shape = shapes;
    shape.push_back({rng.integer(1, 150), rng.integer(1, 600), rng.integer(1, 300)});
    for (const int threads : {1, 2}) {
      omp_set_num_threads(threads);
      for (const auto& s : shape) {
        gemm_def::check_all_three<float>(rng, s[0], s[1], s[2], name + " float, " + std::to_string(threads) + " thread(s)");
        gemm_def::check_all_three<double>(rng, s[0], s[1], s[2], name + " double, " + std::to_string(threads) + " thread(s)");
      }
    }
  }
  omp_set_num_threads(2);
}

// k = 0 writes zeros (or leaves C when accumulating); m or n = 0 writes nothing.
TEST(CpuGemm, EmptyDimensions) {
  FVec y(6, 7.f), x(3, 1.f), w(2, 1.f);
  loom::cpu::linear_forward(y.data(), 2, x.data(), 1, w.data(), 3, 0, 2, false);
  EXPECT_EQ(y, FVec(6, 0.f));
  y.assign(6, 7.f);
  loom::cpu::linear_forward(y.data(), 2, x.data(), 1, w.data(), 3, 0, 2, true);
  EXPECT_EQ(y, FVec(6, 7.f));
  loom::cpu::linear_forward(y.data(), 2, x.data(), 1, w.data(), 0, 1, 2, false);
  EXPECT_EQ(y, FVec(6, 7.f));
}

// The same bits on every machine, recorded: a fixed integer-generated problem
// (no library random numbers) whose result bits were recorded once (on an AMD
// EPYC, and found equal on the Intel Xeon of an H200 machine, 2026-11-28); any
// processor, path or thread count that rounds differently fails here first,
// naming the GEMM, rather than as a drifting training run elsewhere.
TEST(CpuGemm, RecordedBitsOfAFixedProblem) {
  const int64_t m = 37, k = 301, n = 29;
  auto val = [](uint64_t i, uint64_t salt) {  // exactly representable values in [-1, 1)
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ salt;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 32;
    return static_cast<float>(static_cast<int64_t>(h % 65536) - 32768) / 32768.0f;
  };
  FVec x(m * k), w(n * k), dy(m * n);
  for (int64_t i = 0; i < m * k; ++i) x[i] = val(i, 1);
  for (int64_t i = 0; i < n * k; ++i) w[i] = val(i, 2);
  for (int64_t i = 0; i < m * n; ++i) dy[i] = val(i, 3);
  FVec y(m * n), dx(m * k), dw(n * k);
  loom::cpu::linear_forward(y.data(), n, x.data(), k, w.data(), m, k, n);
  loom::cpu::linear_backward_input(dx.data(), k, dy.data(), n, w.data(), m, k, n);
  loom::cpu::linear_backward_weight(dw.data(), dy.data(), n, x.data(), k, m, k, n, false);
  auto digest = [](const FVec& v) {  // FNV-1a over the bytes
    uint64_t h = 1469598103934665603ull;
    for (float f : v) {
      uint32_t u;
      std::memcpy(&u, &f, 4);
      for (int b = 0; b < 4; ++b) h = (h ^ ((u >> (8 * b)) & 0xFF)) * 1099511628211ull;
    }
    return h;
  };
  std::printf("digests: forward %016llx dgrad %016llx wgrad %016llx\n", (unsigned long long)digest(y),
              (unsigned long long)digest(dx), (unsigned long long)digest(dw));
  EXPECT_EQ(digest(y), 0xc99dcb1028a99761ull) << "forward";
  EXPECT_EQ(digest(dx), 0xec02d8ac22cbb297ull) << "dgrad";
  EXPECT_EQ(digest(dw), 0xcf09f83e459edec7ull) << "wgrad";
}

// ---------------------------------------------------------------------------
// Naive attention (plugins/attention/naive/attention_naive_cpu)
// ---------------------------------------------------------------------------
using loom::naive::AttnDims;
using loom::naive::Bshd;

// Independent reference: the full [S, S] score matrix per (b, h), masked with
// -inf above the diagonal, softmax, times V. Packed BSHD inputs.
Vec reference_attention(const AttnDims& d, const Vec& q, const Vec& k, const Vec& v, Vec* lse) {
  const int64_t S = d.S, D = d.D, g = d.H / d.Hkv;
  Vec out(d.B * S * d.H * D, 0.0);
  lse->assign(d.B * d.H * S, 0.0);
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t h = 0; h < d.H; ++h) {
      const int64_t hk = h / g;
      std::vector<Vec> sc(S, Vec(S));
      for (int64_t i = 0; i < S; ++i) {
        double mx = -INFINITY;
        for (int64_t j = 0; j < S; ++j) {
          double s = 0;
          for (int64_t c = 0; c < D; ++c)
            s += q[((b * S + i) * d.H + h) * D + c] * k[((b * S + j) * d.Hkv + hk) * D + c];
          sc[i][j] = (d.causal && j > i) ? -INFINITY : s * d.scale;
          mx = std::max(mx, sc[i][j]);
        }
        double z = 0;
        for (int64_t j = 0; j < S; ++j) z += std::exp(sc[i][j] - mx);
        (*lse)[(b * d.H + h) * S + i] = mx + std::log(z);
        for (int64_t j = 0; j < S; ++j) {
          const double p = std::exp(sc[i][j] - mx) / z;
          for (int64_t c = 0; c < D; ++c)
            out[((b * S + i) * d.H + h) * D + c] += p * v[((b * S + j) * d.Hkv + hk) * D + c];
        }
      }
    }
  return out;
}

struct AttnRun {
  AttnDims d;
  int workers = 2;
  std::vector<double> scratch;
  explicit AttnRun(AttnDims dims, int w = 2) : d(dims), workers(w) {
    scratch.resize(static_cast<size_t>(
        w * std::max(loom::naive::forward_scratch_doubles(d), loom::naive::backward_scratch_doubles(d))));
  }
  // Packed tensors in, packed out.
  template <typename T>
  void forward(std::vector<T>& out, std::vector<T>& lse, const std::vector<T>& q, const std::vector<T>& k,
               const std::vector<T>& v) {
    const Bshd pq = Bshd::packed(d.S, d.H, d.D), pk = Bshd::packed(d.S, d.Hkv, d.D);
    out.assign(d.B * d.S * d.H * d.D, static_cast<T>(kNaN));
    lse.assign(d.B * d.H * d.S, static_cast<T>(kNaN));
    loom::naive::attention_forward<T>(d, out.data(), pq, lse.data(), q.data(), pq, k.data(), pk, v.data(), pk,
                                      scratch.data(), workers);
  }
  template <typename T>
  void backward(std::vector<T>& dq, std::vector<T>& dk, std::vector<T>& dv, const std::vector<T>& dout,
                const std::vector<T>& q, const std::vector<T>& k, const std::vector<T>& v, const std::vector<T>& lse) {
    const Bshd pq = Bshd::packed(d.S, d.H, d.D), pk = Bshd::packed(d.S, d.Hkv, d.D);
    dq.assign(q.size(), static_cast<T>(kNaN));
    dk.assign(k.size(), static_cast<T>(kNaN));
    dv.assign(v.size(), static_cast<T>(kNaN));
    loom::naive::attention_backward<T>(d, dq.data(), pq, dk.data(), pk, dv.data(), pk, dout.data(), pq, q.data(), pq,
                                       k.data(), pk, v.data(), pk, lse.data(), scratch.data(), workers);
  }
};

TEST(NaiveAttention, ForwardMatchesReference) {
  Rng rng(test_seed());
  struct Case { int64_t B, S, H, Hkv, D; bool causal; };
  for (Case c : {Case{2, 7, 4, 2, 6, true}, Case{1, 5, 3, 3, 4, true}, Case{2, 6, 4, 1, 8, true},
                 Case{1, 9, 2, 1, 5, false}}) {
    AttnDims d{c.B, c.S, c.H, c.Hkv, c.D, 1.0 / std::sqrt(static_cast<double>(c.D)), c.causal};
    Vec q = rng.uniform(d.B * d.S * d.H * d.D, -2, 2), k = rng.uniform(d.B * d.S * d.Hkv * d.D, -2, 2),
        v = rng.uniform(d.B * d.S * d.Hkv * d.D);
    Vec out, lse, ref_lse;
    AttnRun run(d);
    run.forward(out, lse, q, k, v);
    const Vec ref = reference_attention(d, q, k, v, &ref_lse);
    EXPECT_LE(rel_err(out, ref), 1e-13) << "S=" << c.S << " H=" << c.H << " Hkv=" << c.Hkv;
    EXPECT_LE(rel_err(lse, ref_lse), 1e-13);
    // float against double
    FVec outf, lsef;
    run.forward(outf, lsef, to_float(q), to_float(k), to_float(v));
    EXPECT_LE(rel_err(outf, out), kFloatTol);
    EXPECT_LE(rel_err(lsef, lse), kFloatTol);
  }
}

// q, k, v are views into one fused [B, S, H + 2 Hkv, D] buffer (as the fused
// QKV GEMM writes it), the gradients go into a fused buffer of the same shape,
// and out has padded heads: every stride differs from the packed one.
TEST(NaiveAttention, BackwardMatchesFiniteDifferencesGqaFusedViews) {
  Rng rng(test_seed());
  for (bool causal : {true, false}) {
    const AttnDims d{2, 7, 4, 2, 6, 1.0 / std::sqrt(6.0), causal};  // GQA groups of 2, S not a power of two
    const int64_t W = (d.H + 2 * d.Hkv) * d.D;                    // fused row width
    const Bshd fq{d.S * W, W, d.D}, fk = fq, fv = fq;
    const int64_t koff = d.H * d.D, voff = (d.H + d.Hkv) * d.D;
    const int64_t hp = d.D + 3;  // padded head stride of out
    const Bshd os{d.S * d.H * hp, d.H * hp, hp};
    Vec qkv = rng.uniform(d.B * d.S * W, -1.5, 1.5);
    Vec R = rng.uniform(d.B * d.S * d.H * hp);
    AttnRun run(d);
    auto forward = [&](Vec& out, Vec& lse) {
      out.assign(d.B * d.S * d.H * hp, 0.0);
      lse.assign(d.B * d.H * d.S, kNaN);
      loom::naive::attention_forward<double>(d, out.data(), os, lse.data(), qkv.data(), fq, qkv.data() + koff, fk,
                                             qkv.data() + voff, fv, run.scratch.data(), run.workers);
    };
    auto loss = [&] {
      Vec out, lse;
      forward(out, lse);
      return dot(out, R);
    };
    Vec out, lse;
    forward(out, lse);
    for (int64_t r = 0; r < d.B * d.S * d.H; ++r)
      for (int64_t c = d.D; c < hp; ++c) ASSERT_EQ(out[r * hp + c], 0.0) << "out padding written";
    Vec dqkv(qkv.size(), kNaN);
    loom::naive::attention_backward<double>(d, dqkv.data(), fq, dqkv.data() + koff, fk, dqkv.data() + voff, fv,
                                            R.data(), os, qkv.data(), fq, qkv.data() + koff, fk, qkv.data() + voff, fv,
                                            lse.data(), run.scratch.data(), run.workers);
    const Vec fd = numeric_grad(qkv, loss);
    // Per part, so that a failure names q, k or v.
    for (auto [name, off, width] : {std::tuple{"dq", int64_t{0}, koff}, std::tuple{"dk", koff, d.Hkv * d.D},
                                    std::tuple{"dv", voff, d.Hkv * d.D}}) {
      Vec a, b;
      for (int64_t r = 0; r < d.B * d.S; ++r)
        for (int64_t c = 0; c < width; ++c) a.push_back(dqkv[r * W + off + c]), b.push_back(fd[r * W + off + c]);
      EXPECT_LE(rel_err(a, b), kGradTol) << name << " causal=" << causal;
    }
  }
}

TEST(NaiveAttention, CausalMaskHidesFuturePositions) {
  Rng rng(test_seed());
  const AttnDims d{1, 6, 2, 1, 4, 0.5, true};
  Vec q = rng.uniform(d.S * d.H * d.D), k = rng.uniform(d.S * d.Hkv * d.D), v = rng.uniform(d.S * d.Hkv * d.D);
  AttnRun run(d);
  Vec out0, lse0;
  run.forward(out0, lse0, q, k, v);
  // Change key and value at position j: outputs of rows i < j must not move (bitwise), row j must.
  const int64_t j = 3;
  for (int64_t c = 0; c < d.D; ++c) k[j * d.D + c] += 0.7, v[j * d.D + c] -= 0.9;
  Vec out1, lse1;
  run.forward(out1, lse1, q, k, v);
  const int64_t row = d.H * d.D;
  for (int64_t i = 0; i < d.S; ++i) {
    bool same = std::equal(out0.begin() + i * row, out0.begin() + (i + 1) * row, out1.begin() + i * row);
    if (i < j) EXPECT_TRUE(same) << "row " << i << " sees position " << j;
    else EXPECT_FALSE(same) << "row " << i << " does not see position " << j;
  }
  // Backward: a gradient only at query row i0 reaches keys and values j <= i0 only.
  const int64_t i0 = 2;
  Vec dout(out0.size(), 0.0);
  for (int64_t c = 0; c < row; ++c) dout[i0 * row + c] = 1.0;
  Vec dq, dk, dv;
  run.backward(dq, dk, dv, dout, q, k, v, lse1);
  for (int64_t jj = 0; jj < d.S; ++jj)
    for (int64_t c = 0; c < d.D; ++c) {
      if (jj > i0) {
        EXPECT_EQ(dk[jj * d.D + c], 0.0) << "j=" << jj;
        EXPECT_EQ(dv[jj * d.D + c], 0.0) << "j=" << jj;
      } else {
        EXPECT_NE(dv[jj * d.D + c], 0.0) << "j=" << jj;
      }
    }
}

TEST(NaiveAttention, FloatMatchesDoubleAndIsBitwiseDeterministic) {
  Rng rng(test_seed());
  const AttnDims d{2, 11, 6, 2, 8, 1.0 / std::sqrt(8.0), true};
  Vec q = rng.uniform(d.B * d.S * d.H * d.D, -2, 2), k = rng.uniform(d.B * d.S * d.Hkv * d.D, -2, 2),
      v = rng.uniform(d.B * d.S * d.Hkv * d.D), dout = rng.uniform(d.B * d.S * d.H * d.D);
  AttnRun run(d);
  Vec out, lse, dq, dk, dv;
  run.forward(out, lse, q, k, v);
  run.backward(dq, dk, dv, dout, q, k, v, lse);
  FVec qf = to_float(q), kf = to_float(k), vf = to_float(v), df = to_float(dout);
  FVec outf[2], lsef[2], dqf[2], dkf[2], dvf[2];
  for (int w = 1; w <= 2; ++w) {
    AttnRun rw(d, w);
    rw.forward(outf[w - 1], lsef[w - 1], qf, kf, vf);
    rw.backward(dqf[w - 1], dkf[w - 1], dvf[w - 1], df, qf, kf, vf, lsef[w - 1]);
  }
  EXPECT_LE(rel_err(outf[0], out), kFloatTol);
  EXPECT_LE(rel_err(dqf[0], dq), kFloatTol);
  EXPECT_LE(rel_err(dkf[0], dk), kFloatTol);
  EXPECT_LE(rel_err(dvf[0], dv), kFloatTol);
  EXPECT_TRUE(bitwise_equal(outf[0], outf[1]));
  EXPECT_TRUE(bitwise_equal(lsef[0], lsef[1]));
  EXPECT_TRUE(bitwise_equal(dqf[0], dqf[1]));
  EXPECT_TRUE(bitwise_equal(dkf[0], dkf[1]));
  EXPECT_TRUE(bitwise_equal(dvf[0], dvf[1]));
}

TEST(NaiveAttention, RejectsBadDims) {
  EXPECT_THROW(loom::naive::check_dims({1, 4, 6, 4, 8, 0.3, true}), loom::Error);  // 6 % 4 != 0
  EXPECT_THROW(loom::naive::check_dims({1, 4, 4, 2, 8, 0.0, true}), loom::Error);  // scale unset
  EXPECT_THROW(loom::naive::check_dims({1, 0, 4, 2, 8, 0.3, true}), loom::Error);
  EXPECT_NO_THROW(loom::naive::check_dims({1, 4, 4, 2, 8, 0.3, true}));
}

// ---------------------------------------------------------------------------
// The plugins, loaded from their shared libraries as the host loads them.
// ---------------------------------------------------------------------------
const loom::PluginDescriptor* load_plugin(const std::string& file) {
  // Plugins are never unloaded (objects' vtables live in the library).
  static auto* libs = new std::vector<std::unique_ptr<boost::dll::shared_library>>();
  const std::filesystem::path path = std::filesystem::path(LOOM_TEST_PLUGIN_DIR) / file;
  if (!std::filesystem::exists(path)) {
    ADD_FAILURE() << path << " is missing: build the plugin targets (ninja loom-precision-fp32 loom-attention-naive)";
    return nullptr;
  }
  libs->push_back(std::make_unique<boost::dll::shared_library>(path));
  auto& entry = libs->back()->get_alias<const loom::PluginDescriptor*()>("loom_plugin_entry");
  return entry();
}

template <typename T>
std::unique_ptr<T> create(const loom::PluginDescriptor* desc, loom::Device device = loom::Device::cpu) {
  loom::PluginInit init;
  init.device = device;
  return std::unique_ptr<T>(static_cast<T*>(desc->create(&init)));
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(Fp32Plugin, GemmsThroughThePluginMatchTheHelpers) {
  const loom::PluginDescriptor* desc = load_plugin("libloom-precision-fp32.so");
  ASSERT_NE(desc, nullptr);
  EXPECT_EQ(desc->kind, static_cast<uint32_t>(loom::PluginKind::precision));
  EXPECT_STREQ(desc->name, "fp32");
  auto p = create<loom::Precision>(desc);
  const loom::PrecisionDTypes t = p->dtypes();
  EXPECT_TRUE(t.param == loom::DType::f32 && t.master == loom::DType::f32 && t.grad == loom::DType::f32 &&
              t.optim_state == loom::DType::f32 && t.activation == loom::DType::f32 && !t.has_master);

  Rng rng(test_seed());
  const int64_t B = 2, S = 3, in = 5, out = 4;
  EXPECT_EQ(p->register_linear({"layer.0.q_proj", 7, 7, B * S}), 0);
  const int id = p->register_linear({"layer.0.o_proj", in, out, B * S});
  EXPECT_EQ(id, 1);
  FVec x = to_float(rng.uniform(B * S * in)), w = to_float(rng.uniform(out * in)),
       dy = to_float(rng.uniform(B * S * out)), y(B * S * out, NAN), dx(B * S * in, NAN), dw(out * in, NAN);
  using loom::DType;
  using loom::Device;
  loom::Tensor tx(x.data(), DType::f32, Device::cpu, {B, S, in}), tw(w.data(), DType::f32, Device::cpu, {out, in}),
      ty(y.data(), DType::f32, Device::cpu, {B, S, out}), tdy(dy.data(), DType::f32, Device::cpu, {B * S, out}),
      tdx(dx.data(), DType::f32, Device::cpu, {B * S, in}), tdw(dw.data(), DType::f32, Device::cpu, {out, in});
  const loom::ExecContext ctx;
  p->linear_forward(ctx, id, tx, tw, ty, nullptr);
  FVec yr(B * S * out);
  loom::cpu::linear_forward(yr.data(), out, x.data(), in, w.data(), B * S, in, out);
  EXPECT_TRUE(bitwise_equal(y, yr));

  p->linear_backward(ctx, id, tx, tw, tdy, &tdx, tdw, /*accumulate=*/false);
  FVec dxr(B * S * in), dwr(out * in);
  loom::cpu::linear_backward_input(dxr.data(), in, dy.data(), out, w.data(), B * S, in, out);
  loom::cpu::linear_backward_weight(dwr.data(), dy.data(), out, x.data(), in, B * S, in, out, false);
  EXPECT_TRUE(bitwise_equal(dx, dxr));
  EXPECT_TRUE(bitwise_equal(dw, dwr));
  // accumulate: a second micro-batch adds the same gradient again; dx may be skipped.
  p->linear_backward(ctx, id, tx, tw, tdy, nullptr, tdw, /*accumulate=*/true);
  for (size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(dw[i], 2 * dwr[i], 1e-6f * (1 + std::abs(dwr[i])));

  // Errors name what is wrong.
  loom::Tensor bad = tx;
  bad.dtype = DType::bf16;
  EXPECT_TRUE(contains(error_of([&] { p->linear_forward(ctx, id, bad, tw, ty, nullptr); }), "must be fp32, got bf16"));
  loom::Tensor wide(x.data(), DType::f32, Device::cpu, {B * S, in - 1});
  EXPECT_TRUE(contains(error_of([&] { p->linear_forward(ctx, id, wide, tw, ty, nullptr); }), "expected in=5"));
  EXPECT_TRUE(contains(error_of([&] { p->linear_forward(ctx, 9, tx, tw, ty, nullptr); }), "linear id 9 was never registered"));
  loom::Tensor wt = tw;  // a transposed view of W is not the registered [out, in] matrix
  std::swap(wt.shape[0], wt.shape[1]);
  EXPECT_TRUE(contains(error_of([&] { p->linear_forward(ctx, id, tx, wt, ty, nullptr); }), "[out, in] = [4,5]"));
  FVec big(4 * B * S * in);
  loom::Tensor many(big.data(), DType::f32, Device::cpu, {4 * B * S, in});
  EXPECT_TRUE(contains(error_of([&] { p->linear_forward(ctx, id, many, tw, ty, nullptr); }), "max_rows=6"));
  loom::ExecContext cuda_ctx;
  cuda_ctx.device = Device::cuda;
  EXPECT_TRUE(contains(error_of([&] { p->linear_forward(cuda_ctx, id, tx, tw, ty, nullptr); }), "CUDA backend"));
#ifndef LOOM_HAVE_CUDA
  // Without CUDA the plugin has no device path; with it, device cuda is the
  // cuBLASLt GPU reference (tested in test_cuda_gemm).
  EXPECT_TRUE(contains(error_of([&] { create<loom::Precision>(desc, Device::cuda); }), "CUDA backend"));
#endif
}

// y = x W^T + residual through the plugin (the fused layer's residual add as
// the GEMM's C input), against a double reference computed from the same float
// inputs. fp32 products over k = 5 terms plus one add round at ~1e-7 relative,
// so kFloatTol (1e-5) holds with margin and any wrong or missing term fails.
TEST(Fp32Plugin, ResidualIsTheCInput) {
  const loom::PluginDescriptor* desc = load_plugin("libloom-precision-fp32.so");
  ASSERT_NE(desc, nullptr);
  auto p = create<loom::Precision>(desc);
  using loom::DType;
  using loom::Device;
  Rng rng(test_seed());
  const int64_t B = 2, S = 3, m = B * S, in = 5, out = 4;
  const int id = p->register_linear({"layer.2.o_proj", in, out, m});
  const FVec x = to_float(rng.uniform(m * in)), w = to_float(rng.uniform(out * in)), r = to_float(rng.uniform(m * out));
  Vec ref(m * out);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t o = 0; o < out; ++o) {
      double acc = r[i * out + o];
      for (int64_t c = 0; c < in; ++c) acc += static_cast<double>(x[i * in + c]) * w[o * in + c];
      ref[i * out + o] = acc;
    }
  FVec xb = x, wb = w;
  const loom::Tensor tx(xb.data(), DType::f32, Device::cpu, {B, S, in}),
      tw(wb.data(), DType::f32, Device::cpu, {out, in});
  const loom::ExecContext ctx;
  // A [rows, cols] view starting `off` elements into `buf`, with row stride ld.
  auto rows_view = [&](FVec& buf, int64_t off, int64_t ld) {
    loom::Tensor t(buf.data() + off, DType::f32, Device::cpu, {m, out});
    t.stride[0] = ld;
    return t;
  };
  auto read = [&](const FVec& buf, int64_t off, int64_t ld) {
    Vec v(m * out);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t o = 0; o < out; ++o) v[i * out + o] = buf[off + i * ld + o];
    return v;
  };

  {  // residual distinct from y; y poisoned, so an element the GEMM skipped stays NaN
    FVec y(m * out, NAN), res = r;
    loom::Tensor ty(y.data(), DType::f32, Device::cpu, {B, S, out}), tr(res.data(), DType::f32, Device::cpu, {m, out});
    p->linear_forward(ctx, id, tx, tw, ty, &tr);
    EXPECT_LE(rel_err(y, ref), kFloatTol) << "residual distinct from y";
    EXPECT_TRUE(bitwise_equal(res, r)) << "the residual was written";
  }
  {  // residual == y: in place, y holds the residual stream before the call
    FVec y = r;
    loom::Tensor ty(y.data(), DType::f32, Device::cpu, {B, S, out});
    p->linear_forward(ctx, id, tx, tw, ty, &ty);
    EXPECT_LE(rel_err(y, ref), kFloatTol) << "residual is y";
  }
  {  // residual a row view of a wider buffer (row stride 9, 2 elements in), y another one
    const int64_t ldr = out + 5, ldy = out + 3;
    FVec rbuf(2 + m * ldr, 3.f), ybuf(1 + m * ldy, 7.f);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t o = 0; o < out; ++o) rbuf[2 + i * ldr + o] = r[i * out + o];
    const FVec rbuf0 = rbuf;
    loom::Tensor tr = rows_view(rbuf, 2, ldr), ty = rows_view(ybuf, 1, ldy);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t o = 0; o < out; ++o) ybuf[1 + i * ldy + o] = NAN;
    p->linear_forward(ctx, id, tx, tw, ty, &tr);
    EXPECT_LE(rel_err(read(ybuf, 1, ldy), ref), kFloatTol) << "residual as a row view";
    EXPECT_TRUE(bitwise_equal(rbuf, rbuf0)) << "the residual's buffer was written";
    bool padding_kept = ybuf[0] == 7.f;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t o = out; o < ldy && 1 + i * ldy + o < static_cast<int64_t>(ybuf.size()); ++o)
        padding_kept = padding_kept && ybuf[1 + i * ldy + o] == 7.f;
    EXPECT_TRUE(padding_kept) << "y's padding was written";
  }
  {  // y and the residual as two column ranges of one buffer: no shared element, so allowed
    const int64_t ld = 2 * out + 1;
    FVec buf(m * ld, NAN);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t o = 0; o < out; ++o) buf[i * ld + out + 1 + o] = r[i * out + o];
    loom::Tensor ty = rows_view(buf, 0, ld), tr = rows_view(buf, out + 1, ld);
    p->linear_forward(ctx, id, tx, tw, ty, &tr);
    EXPECT_LE(rel_err(read(buf, 0, ld), ref), kFloatTol) << "y and residual side by side";
    EXPECT_LE(rel_err(read(buf, out + 1, ld), to_double(r)), 0.0) << "the residual columns were written";
  }

  // Refusals name the linear and what is wrong.
  FVec y(m * out, 0.f), res = r, big((m + 1) * (out + 2), 0.f);
  loom::Tensor ty(y.data(), DType::f32, Device::cpu, {m, out}), tr(res.data(), DType::f32, Device::cpu, {m, out});
  auto refused = [&](const loom::Tensor& bad) {
    return error_of([&] { p->linear_forward(ctx, id, tx, tw, ty, &bad); });
  };
  loom::Tensor narrow(res.data(), DType::f32, Device::cpu, {m, out - 1});
  std::string e = refused(narrow);
  EXPECT_TRUE(contains(e, "layer.2.o_proj: residual is [6, 3] but y is [6, 4]")) << e;
  loom::Tensor bf = tr;
  bf.dtype = DType::bf16;
  e = refused(bf);
  EXPECT_TRUE(contains(e, "layer.2.o_proj: residual must be fp32, got bf16")) << e;
  loom::Tensor dev = tr;
  dev.device = Device::cuda;
  e = refused(dev);
  EXPECT_TRUE(contains(e, "layer.2.o_proj: residual is on cuda")) << e;
  loom::Tensor none = tr;
  none.data = nullptr;
  e = refused(none);
  EXPECT_TRUE(contains(e, "layer.2.o_proj: residual has no data")) << e;
  loom::Tensor shifted(y.data() + 1, DType::f32, Device::cpu, {m, out});  // overlaps y one element off
  e = refused(shifted);
  EXPECT_TRUE(contains(e, "layer.2.o_proj: residual overlaps y without being y")) << e;
  ty = loom::Tensor(big.data(), DType::f32, Device::cpu, {m, out});
  loom::Tensor same_start(big.data(), DType::f32, Device::cpu, {m, out});  // y's start, another row stride
  same_start.stride[0] = out + 2;
  e = refused(same_start);
  EXPECT_TRUE(contains(e, "layer.2.o_proj: residual overlaps y without being y")) << e;
  EXPECT_TRUE(contains(e, "row stride 6, y at")) << e;
}

// The linear wrappers run a few hundred times a step: after the first call of a
// shape they must not allocate (tests/alloc_counter.hpp counts operator new and
// delete in the whole process while a window is open).
TEST(Fp32Plugin, HotPathAllocatesNothing) {
  const loom::PluginDescriptor* desc = load_plugin("libloom-precision-fp32.so");
  ASSERT_NE(desc, nullptr);
  auto p = create<loom::Precision>(desc);
  using loom::DType;
  using loom::Device;
  Rng rng(test_seed());
  const int64_t m = 16, in = 24, out = 32;
  const int id = p->register_linear({"layer.0.down_proj", in, out, m});
  FVec x = to_float(rng.uniform(m * in)), w = to_float(rng.uniform(out * in)), dy = to_float(rng.uniform(m * out)),
       y(m * out), r = to_float(rng.uniform(m * out)), dx(m * in), dw(out * in);
  loom::Tensor tx(x.data(), DType::f32, Device::cpu, {2, m / 2, in}), tw(w.data(), DType::f32, Device::cpu, {out, in}),
      ty(y.data(), DType::f32, Device::cpu, {m, out}), tr(r.data(), DType::f32, Device::cpu, {m, out}),
      tdy(dy.data(), DType::f32, Device::cpu, {m, out}), tdx(dx.data(), DType::f32, Device::cpu, {m, in}),
      tdw(dw.data(), DType::f32, Device::cpu, {out, in});
  const loom::ExecContext ctx;
  auto step = [&] {
    p->linear_forward(ctx, id, tx, tw, ty, nullptr);
    p->linear_forward(ctx, id, tx, tw, ty, &tr);
    p->linear_forward(ctx, id, tx, tw, ty, &ty);
    p->linear_backward(ctx, id, tx, tw, tdy, &tdx, tdw, false);
    p->linear_backward(ctx, id, tx, tw, tdy, nullptr, tdw, true);
  };
  step();  // warm-up: the first call of each shape may set things up

  loom_test::AllocCounter counter;
  counter.start();
  for (int i = 0; i < 100; ++i) step();
  const loom_test::AllocCounts c = counter.stop();
  EXPECT_EQ(c.ours_new, 0) << "500 linear calls allocated; the first allocation came from:" << c.first_ours;
  EXPECT_EQ(c.ours_delete, 0);
  EXPECT_EQ(c.vendor_new, 0) << "nothing NVIDIA's is loaded on the CPU path";

  // The counter sees what the plugin allocates: a refused call formats its message.
  counter.start();
  try {
    p->linear_forward(ctx, id + 1, tx, tw, ty, nullptr);
  } catch (const loom::Error&) {
  }
  const loom_test::AllocCounts err = counter.stop();
  EXPECT_GT(err.ours_new, 0) << "the counting operator new does not see the plugin's allocations";
}

TEST(NaiveAttentionPlugin, SupportsAndMatchesTheKernel) {
  const loom::PluginDescriptor* desc = load_plugin("libloom-attention-naive.so");
  ASSERT_NE(desc, nullptr);
  EXPECT_EQ(desc->kind, static_cast<uint32_t>(loom::PluginKind::attention));
  EXPECT_STREQ(desc->name, "naive");
  auto a = create<loom::Attention>(desc);
  using loom::DType;
  using loom::Device;
  loom::AttentionShape sh{2, 5, 4, 2, 8, true, static_cast<float>(1 / std::sqrt(8.0))};
  EXPECT_TRUE(a->supports(sh, DType::f32, Device::cpu).ok);
  const loom::Support cu = a->supports(sh, DType::f32, Device::cuda);
#ifdef LOOM_HAVE_CUDA
  // With the CUDA backend the plugin runs on cuda too (tests/test_cuda_attention.cpp).
  EXPECT_TRUE(cu.ok) << cu.reason;
#else
  EXPECT_FALSE(cu.ok);
  EXPECT_TRUE(contains(cu.reason, "CUDA backend")) << cu.reason;
#endif
  const loom::Support bf = a->supports(sh, DType::bf16, Device::cpu);
  EXPECT_FALSE(bf.ok);
  EXPECT_TRUE(contains(bf.reason, "fp32 only, got bf16")) << bf.reason;
  loom::AttentionShape odd = sh;
  odd.kv_heads = 3;
  const loom::Support od = a->supports(odd, DType::f32, Device::cpu);
  EXPECT_FALSE(od.ok);
  EXPECT_TRUE(contains(od.reason, "heads=4 is not a multiple of kv_heads=3")) << od.reason;

  // Fused QKV views through Tensors, against the kernel called directly.
  Rng rng(test_seed());
  const int64_t B = sh.batch, S = sh.seq, H = sh.heads, Hkv = sh.kv_heads, D = sh.head_dim, W = (H + 2 * Hkv) * D;
  FVec qkv = to_float(rng.uniform(B * S * W)), dout = to_float(rng.uniform(B * S * H * D));
  FVec out(B * S * H * D, NAN), stats(B * H * S, NAN), dqkv(qkv.size(), NAN);
  auto view = [&](float* base, int64_t off, int64_t heads) {
    loom::Tensor t(base + off, DType::f32, Device::cpu, {B, S, heads, D});
    t.stride = {S * W, W, D, 1};
    return t;
  };
  loom::Tensor q = view(qkv.data(), 0, H), k = view(qkv.data(), H * D, Hkv), v = view(qkv.data(), (H + Hkv) * D, Hkv);
  loom::Tensor dq = view(dqkv.data(), 0, H), dk = view(dqkv.data(), H * D, Hkv),
               dv = view(dqkv.data(), (H + Hkv) * D, Hkv);
  loom::Tensor to(out.data(), DType::f32, Device::cpu, {B, S, H, D}), tdo(dout.data(), DType::f32, Device::cpu, {B, S, H, D}),
      ts(stats.data(), DType::f32, Device::cpu, {B, H, S});
  std::vector<double> ws(a->workspace_bytes(sh, DType::f32, Device::cpu) / sizeof(double));
  ASSERT_FALSE(ws.empty());
  const loom::ExecContext ctx;
  a->forward(ctx, sh, q, k, v, to, ts, ws.data());
  a->backward(ctx, sh, q, k, v, to, tdo, ts, dq, dk, dv, ws.data());

  const AttnDims d{B, S, H, Hkv, D, static_cast<double>(sh.scale), true};
  const Bshd f{S * W, W, D}, p = Bshd::packed(S, H, D);
  AttnRun run(d, 1);
  FVec out_r(out.size()), stats_r(stats.size()), dqkv_r(qkv.size(), NAN);
  loom::naive::attention_forward<float>(d, out_r.data(), p, stats_r.data(), qkv.data(), f, qkv.data() + H * D, f,
                                        qkv.data() + (H + Hkv) * D, f, run.scratch.data(), 1);
  loom::naive::attention_backward<float>(d, dqkv_r.data(), f, dqkv_r.data() + H * D, f, dqkv_r.data() + (H + Hkv) * D,
                                         f, dout.data(), p, qkv.data(), f, qkv.data() + H * D, f,
                                         qkv.data() + (H + Hkv) * D, f, stats_r.data(), run.scratch.data(), 1);
  EXPECT_TRUE(bitwise_equal(out, out_r));
  EXPECT_TRUE(bitwise_equal(stats, stats_r));
  EXPECT_TRUE(bitwise_equal(dqkv, dqkv_r));

  loom::Tensor short_k = k;
  short_k.shape[1] = S - 1;
  EXPECT_TRUE(contains(error_of([&] { a->forward(ctx, sh, q, short_k, v, to, ts, ws.data()); }), "k must have shape"));
  EXPECT_TRUE(contains(error_of([&] { a->forward(ctx, sh, q, k, v, to, ts, nullptr); }), "needs a workspace"));
  loom::Tensor bad_stats(stats.data(), DType::f32, Device::cpu, {B, S, H});
  EXPECT_TRUE(contains(error_of([&] { a->forward(ctx, sh, q, k, v, to, bad_stats, ws.data()); }), "stats must be"));
}

}  // namespace
