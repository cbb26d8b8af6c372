// The MoE routing kernels (kernels/cuda/moe.cu) against the CPU reference
// (kernels/cpu/moe.hpp) on random inputs, kernel by kernel, at several shapes:
// N = 37, E = 4, k = 2; N = 4096, E = 8, k = 2; E = 5, k = 3; k = E; an expert
// that no token chooses (forced through the router weights); exact ties.
// Every output is poisoned (0xFF bytes: NaN for fp32/bf16, -1 for indices)
// before the call, so an element a kernel forgets to write fails.
//
// Where the reference comes from: the router test feeds the logits to
// cpu::moe_route as its input with an identity router (h = E: every logit is
// one exact product), the sort test runs cpu::moe_sort, and the rest runs
// cpu::moe_forward and cpu::moe_backward (fp32) and takes their saved
// activations and scratch. The reference has no bf16 instantiation, so the
// bf16 paths are compared with the reference's loops (the same sums in the
// same order, written out here) on the bf16-rounded inputs.
//
// Tolerances (per element; |a| the reference value):
// - indices (experts, counts, offsets, perm, row_of), the gather (a copy) and
//   d_eout (one fp32 product, rounded once) are compared exactly.
// - probs: one ulp, |d| <= 2^-23 |a| (+ the smallest normal for underflow).
//   Both sides compute the softmax in double and round once to fp32; only
//   CUDA's double exp may differ from the host's in the last bit of a double
//   (both are within 1 ulp of double), which moves the fp32 result by at most
//   one ulp, and only when the double lands next to a rounding boundary.
//   weights: two ulps (a probability one ulp off, then one rounded division).
// - combine, scatter-add: the same fp32 operations in the same order (the
//   kernels round each product and sum separately, like the reference's
//   baseline x86-64 build), so the results are expected to be bitwise equal;
//   against the reference the bound allows each of the k + 1 roundings one
//   ulp of the magnitudes summed, (k + 1) 2^-23 sum |terms|, so a host
//   compiler that fuses a multiply-add does not fail the test, while a
//   missing, doubled or wrongly weighted slot (an error of order |term|)
//   does. The order itself is checked bitwise where no product can be fused:
//   the scatter-add (additions only) and the combine with power-of-two
//   weights (exact products), against the reference's loop written out.
// - d_weights: a dot product of h exact double products, summed in double in
//   another order (a block reduction), rounded once to fp32: one fp32 ulp of
//   the result plus h 2^-52 sum |terms| for the double sums.
// - d_logits (renormalisation and softmax backward): the same double
//   operations in the same order, rounded to fp32 at the same places; a
//   probability that differs by one ulp (see above) does not enter here (the
//   test feeds the reference's probs), so the bound is 4 fp32 ulps of
//   max(|a|, p sum|dp|) for the cancellation in p (dp - <p, dp>).
// - aux statistics: counts exact; probability sums in another double order:
//   N 2^-52 relative; the aux gradient bitwise (one serial formula on the same
//   counts); the aux loss 1e-12 relative (it takes the probability sums).
// - bf16 paths: the fp32 bound above plus one bf16 rounding, 2^-8 |a|.
// Determinism: at N = 32768 (64 chunks of the sort, every expert split over
// many warps) every kernel runs twice on the same inputs and every output is
// compared bitwise.
#include <gtest/gtest.h>

#ifdef LOOM_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "hf/safetensors.hpp"
#include "kernels/cpu/moe.hpp"
#include "kernels/cuda/moe_kernels.hpp"
#include "loom/error.hpp"

namespace loom {
namespace {

using cpu::MoeAuxStats;
using cpu::MoeBuffers;
using cpu::MoeDims;
using cpu::MoeGrads;
using cpu::MoeWeights;

constexpr double kUlp32 = 1.0 / (1 << 23);     // 2^-23
constexpr double kUlpBf16 = 1.0 / (1 << 8);    // 2^-8: a bf16 rounding is at most half of it
constexpr double kTiny = 1.1754943508222875e-38;  // smallest normal fp32

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(cudaGetLastError())

std::vector<float> rnd(size_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

float round_bf16(float x) { return hf::bf16_to_f32(hf::f32_to_bf16(x)); }
std::vector<float> rounded_bf16(std::vector<float> v) {
  for (auto& x : v) x = round_bf16(x);
  return v;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::string dims_str(const MoeDims& d) {
  return cat("N=", d.N, " h=", d.h, " E=", d.E, " k=", d.k);
}

class CudaMoe : public ::testing::Test {
 protected:
  void SetUp() override {
    LOOM_REQUIRE_GPU();
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    for (void* p : allocs_) cudaFree(p);
  }

  // Device memory for n elements of T, poisoned with 0xFF bytes. The memset
  // and the uploads below run on the legacy default stream, which a
  // non-blocking stream_ does not wait for (and a pageable upload returns
  // before its DMA lands): each waits for the device before the kernels
  // under test, launched on stream_, may touch the memory.
  template <typename T>
  T* alloc(size_t n) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(n * sizeof(T), 16)), cudaSuccess);
    allocs_.push_back(p);
    EXPECT_EQ(cudaMemset(p, 0xFF, std::max<size_t>(n * sizeof(T), 16)), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return static_cast<T*>(p);
  }
  template <typename T>
  T* put(const std::vector<T>& v) {
    T* p = alloc<T>(v.size());
    EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return p;
  }
  // Waits for the stream, then copies.
  template <typename T>
  std::vector<T> get(const T* p, size_t n) {
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    std::vector<T> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  // A poisoned [rows, cols] device tensor of dtype t.
  Tensor tensor(DType t, int64_t rows, int64_t cols) {
    void* p = t == DType::f32 ? static_cast<void*>(alloc<float>(rows * cols)) : alloc<uint16_t>(rows * cols);
    return Tensor(p, t, Device::cuda, {rows, cols});
  }
  // Host fp32 values stored as dtype t (bf16: rounded to nearest even).
  Tensor tput(const std::vector<float>& v, DType t, int64_t rows, int64_t cols) {
    Tensor x = tensor(t, rows, cols);
    EXPECT_EQ(static_cast<int64_t>(v.size()), rows * cols);
    if (t == DType::f32) {
      EXPECT_EQ(cudaMemcpy(x.data, v.data(), v.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    } else {
      std::vector<uint16_t> b(v.size());
      for (size_t i = 0; i < v.size(); ++i) b[i] = hf::f32_to_bf16(v[i]);
      EXPECT_EQ(cudaMemcpy(x.data, b.data(), b.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // see alloc()
    return x;
  }
  std::vector<float> tget(const Tensor& x) {
    const size_t n = static_cast<size_t>(x.numel());
    if (x.dtype == DType::f32) return get(static_cast<const float*>(x.data), n);
    std::vector<uint16_t> b = get(static_cast<const uint16_t*>(x.data), n);
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = hf::bf16_to_f32(b[i]);
    return v;
  }
  template <typename T>
  std::vector<uint8_t> bytes(const T* p, size_t n) {
    std::vector<T> v = get(p, n);
    std::vector<uint8_t> b(n * sizeof(T));
    std::memcpy(b.data(), v.data(), b.size());
    return b;
  }

  cudaStream_t stream_ = nullptr;
  std::vector<void*> allocs_;
};

// Every element of got within tol(i) of want; a non-finite got fails.
void expect_close(const std::vector<float>& got, const std::vector<float>& want,
                  const std::function<double(size_t)>& tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(std::isfinite(got[i]) && d <= tol(i))) {
      ADD_FAILURE() << what << " element " << i << ": gpu " << got[i] << " cpu " << want[i] << " |d| " << d
                    << " > " << tol(i);
      if (++bad >= 5) return;
    }
  }
}

template <typename T>
void expect_equal(const std::vector<T>& got, const std::vector<T>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      ADD_FAILURE() << what << " element " << i << ": gpu " << got[i] << " cpu " << want[i];
      if (++bad >= 5) return;
    }
  }
}

// ---- router ---------------------------------------------------------------------

// Logits for a case: uniform(-3, 3); `quantised` rounds them to multiples of
// 0.5 so that exact ties are frequent; `zero_expert` >= 0 pushes that
// expert's logit to -30 on every token, so no token picks it (k < E).
std::vector<float> make_logits(const MoeDims& d, uint32_t seed, bool quantised, int zero_expert) {
  std::vector<float> l = rnd(static_cast<size_t>(d.N * d.E), seed, -3.f, 3.f);
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t e = 0; e < d.E; ++e) {
      float& v = l[n * d.E + e];
      if (quantised) v = std::round(v * 2.f) / 2.f;
      if (e == zero_expert) v = -30.f;
    }
  return l;
}

struct RouteRef {
  std::vector<float> probs, weights;
  std::vector<int32_t> experts;
};

// cpu::moe_route on xin = logits with the identity router (h = E): every
// logit it recomputes is one product by 1 plus products by 0, exact.
RouteRef route_ref(const std::vector<float>& logits, const MoeDims& d) {
  MoeDims r = d;
  r.h = d.E;
  std::vector<float> eye(static_cast<size_t>(d.E * d.E), 0.f);
  for (int64_t e = 0; e < d.E; ++e) eye[e * d.E + e] = 1.f;
  std::vector<float> lg(logits.size());
  RouteRef ref;
  ref.probs.resize(logits.size());
  ref.weights.resize(static_cast<size_t>(d.N * d.k));
  ref.experts.resize(static_cast<size_t>(d.N * d.k));
  cpu::moe_route(lg.data(), ref.probs.data(), ref.experts.data(), ref.weights.data(), logits.data(), eye.data(), r);
  EXPECT_EQ(lg, logits) << "the identity router reproduces the logits";
  return ref;
}

struct Shape {
  int64_t N, E, k;
  bool quantised;
  int zero_expert;
};

const Shape kRouteShapes[] = {
    {37, 4, 2, false, -1},   {4096, 8, 2, false, -1}, {203, 5, 3, false, -1}, {64, 4, 4, false, -1},
    {301, 6, 2, false, 5},   {513, 8, 2, true, -1},   {129, 5, 5, true, -1},  {77, 64, 8, false, 0},
};

TEST_F(CudaMoe, RouteMatchesReferenceFp32AndBf16Logits) {
  uint32_t seed = 100;
  for (const Shape& s : kRouteShapes) {
    for (DType dt : {DType::f32, DType::bf16}) {
      const MoeDims d{s.N, s.E, 1, s.E, s.k};
      const std::string what = cat(dims_str(d), " logits ", dtype_name(dt), s.quantised ? " (ties)" : "",
                                   s.zero_expert >= 0 ? cat(" (expert ", s.zero_expert, " unused)") : "");
      std::vector<float> logits = make_logits(d, ++seed, s.quantised, s.zero_expert);
      if (dt == DType::bf16) logits = rounded_bf16(logits);
      const RouteRef ref = route_ref(logits, d);
      Tensor tl = tput(logits, dt, d.N, d.E);
      float* probs = alloc<float>(d.N * d.E);
      float* weights = alloc<float>(d.N * d.k);
      int32_t* experts = alloc<int32_t>(d.N * d.k);
      gpu::moe_route(probs, experts, weights, tl, d, stream_);
      expect_equal(get(experts, d.N * d.k), ref.experts, what + " experts");
      expect_close(get(probs, d.N * d.E), ref.probs,
                   [&](size_t i) { return kUlp32 * std::fabs(ref.probs[i]) + kTiny; }, what + " probs");
      expect_close(get(weights, d.N * d.k), ref.weights,
                   [&](size_t i) { return 2 * kUlp32 * std::fabs(ref.weights[i]) + kTiny; }, what + " weights");
      if (s.zero_expert >= 0)
        for (int32_t e : ref.experts) ASSERT_NE(e, s.zero_expert) << what << ": the forced expert was chosen";
    }
  }
}

// ---- sort -------------------------------------------------------------------------

struct SortCase {
  int64_t N, E, k;
  int skew;  // 0: uniform experts; 1: 90% of the pairs to expert 0; 2: expert E - 1 never used
};

TEST_F(CudaMoe, SortMatchesReferenceAndIsStable) {
  const SortCase cases[] = {{37, 4, 2, 0},    {4096, 8, 2, 0},  {5000, 5, 3, 0}, {300, 4, 4, 0},
                            {3001, 6, 2, 2},  {2500, 8, 2, 1},  {1, 3, 1, 0},    {0, 4, 2, 0},
                            {20000, 64, 6, 0}, {513, 1, 1, 0}};
  uint32_t seed = 7;
  for (const SortCase& c : cases) {
    const MoeDims d{c.N, 8, 1, c.E, c.k};
    const int64_t R = d.rows();
    // Each token's k experts distinct (as top-k makes them), in random order.
    std::mt19937 gen(++seed);
    std::vector<int32_t> experts(static_cast<size_t>(R));
    std::vector<int32_t> all(static_cast<size_t>(c.E));
    for (int64_t t = 0; t < c.N; ++t) {
      for (int64_t e = 0; e < c.E; ++e) all[e] = static_cast<int32_t>(e);
      std::shuffle(all.begin(), all.end(), gen);
      if (c.skew == 1 && gen() % 10 != 0) std::swap(all[0], *std::find(all.begin(), all.end(), 0));
      if (c.skew == 2 && c.k < c.E) {
        auto last = std::find(all.begin(), all.end(), static_cast<int32_t>(c.E - 1));
        std::swap(*last, all.back());  // E - 1 goes to the end, past the k taken
      }
      for (int64_t j = 0; j < c.k; ++j) experts[t * c.k + j] = all[j];
    }
    std::vector<int64_t> counts(c.E), offsets(c.E + 1);
    std::vector<int32_t> perm(R), row_of(R);
    cpu::moe_sort(counts.data(), offsets.data(), perm.data(), row_of.data(), experts.data(), d);
    if (c.skew == 2) ASSERT_EQ(counts[c.E - 1], 0);

    const std::string what = cat(dims_str(d), " skew ", c.skew);
    const int32_t* dex = put(experts);
    int64_t* dcounts = alloc<int64_t>(c.E);
    int64_t* doffsets = alloc<int64_t>(c.E + 1);
    int32_t* dperm = alloc<int32_t>(R);
    int32_t* drow = alloc<int32_t>(R);
    const int64_t ns = gpu::moe_sort_scratch_elems(d);
    int32_t* scratch = alloc<int32_t>(ns);
    gpu::moe_sort(dcounts, doffsets, dperm, drow, dex, scratch, ns, d, stream_);
    expect_equal(get(dcounts, c.E), counts, what + " counts");
    expect_equal(get(doffsets, c.E + 1), offsets, what + " offsets");
    expect_equal(get(dperm, R), perm, what + " perm");
    expect_equal(get(drow, R), row_of, what + " row_of");

    // A scratch shorter than moe_sort_scratch_elems (E counters for a third
    // of the chunks, or for one chunk) takes longer chunks, multiples of
    // kMoeSortChunk: the same stable sort.
    for (const int64_t short_ns : {c.E * std::max<int64_t>(1, ns / c.E / 3), c.E}) {
      if (short_ns >= ns) continue;
      int32_t* short_scratch = alloc<int32_t>(short_ns);
      int32_t* dperm2 = alloc<int32_t>(R);
      int32_t* drow2 = alloc<int32_t>(R);
      gpu::moe_sort(dcounts, doffsets, dperm2, drow2, dex, short_scratch, short_ns, d, stream_);
      const std::string w2 = cat(what, " scratch ", short_ns, " of ", ns);
      expect_equal(get(dcounts, c.E), counts, w2 + " counts");
      expect_equal(get(doffsets, c.E + 1), offsets, w2 + " offsets");
      expect_equal(get(dperm2, R), perm, w2 + " perm");
      expect_equal(get(drow2, R), row_of, w2 + " row_of");
    }
  }
}

// An expert index outside [0, E) (moe_route never makes one) is skipped: no
// write outside the arrays, row_of -1, and the valid pairs sorted as if it
// were absent (their rows then end before R, the rest of perm untouched).
// Padded runs (MoeDims::row_align, what the CUDA backend's MoE block uses so
// that FP8 expert GEMMs get row counts in multiples of 16): the sort with
// row_align a against the packed sort (a = 1) of the same experts. Every
// expert's run starts at a multiple of a and spans its count rounded up to a;
// the pairs keep their packed order inside it; every other row of perm is -1.
// The gather gives the packed rows at their padded places and zeros between
// (into a NaN-poisoned buffer: a row left unwritten fails); the combine and
// the scatter-add, reading through row_of, equal the packed ones bitwise; the
// combine backward gives the packed d_eout rows, zeros on the padding (whose
// eout rows hold garbage here), and the same d_weights. Alignments 16 (the
// block's), 5 and 128; an expert no token picks; N = 0.
TEST_F(CudaMoe, PaddedRunsHoldThePackedRowsAndZeros) {
  struct Case {
    int64_t N, h, E, k;
  };
  uint32_t seed = 900;
  for (const int64_t align : {int64_t{16}, int64_t{5}, int64_t{128}}) {
    for (const Case c : {Case{300, 24, 8, 2}, Case{61, 17, 4, 4}, Case{4096, 64, 8, 2}, Case{77, 40, 6, 1},
                         Case{0, 8, 4, 2}}) {
      MoeDims d1{c.N, c.h, 1, c.E, c.k};
      MoeDims da = d1;
      da.row_align = align;
      const int64_t N = c.N, h = c.h, E = c.E, k = c.k, R = d1.rows(), Rp = da.padded_rows();
      const std::string what = cat(dims_str(d1), " row_align ", align);
      std::mt19937 gen(++seed);
      std::vector<int32_t> experts(static_cast<size_t>(R)), all(static_cast<size_t>(E));
      for (int64_t t = 0; t < N; ++t) {
        for (int64_t e = 0; e < E; ++e) all[e] = static_cast<int32_t>(e);
        std::shuffle(all.begin(), all.end(), gen);
        if (k < E) std::swap(*std::find(all.begin(), all.end(), static_cast<int32_t>(E - 1)), all.back());
        for (int64_t j = 0; j < k; ++j) experts[t * k + j] = all[j];  // expert E - 1 unused when k < E
      }
      const int32_t* dex = put(experts);
      auto sort = [&](const MoeDims& d, int64_t* counts, int64_t* offsets, int32_t* perm, int32_t* row_of) {
        const int64_t ns = gpu::moe_sort_scratch_elems(d);
        gpu::moe_sort(counts, offsets, perm, row_of, dex, alloc<int32_t>(ns), ns, d, stream_);
      };
      int64_t *c1 = alloc<int64_t>(E), *o1 = alloc<int64_t>(E + 1), *ca = alloc<int64_t>(E), *oa = alloc<int64_t>(E + 1);
      int32_t *p1 = alloc<int32_t>(R), *r1 = alloc<int32_t>(R), *pa = alloc<int32_t>(Rp), *ra = alloc<int32_t>(R);
      sort(d1, c1, o1, p1, r1);
      sort(da, ca, oa, pa, ra);
      const std::vector<int64_t> counts = get(c1, E), offsets = get(o1, E + 1), offs = get(oa, E + 1);
      const std::vector<int32_t> perm1 = get(p1, R), row1 = get(r1, R), perma = get(pa, Rp), rowa = get(ra, R);
      expect_equal(get(ca, E), counts, what + " counts");
      std::vector<int32_t> want_perm(static_cast<size_t>(Rp), -1);
      std::vector<int64_t> want_offs(static_cast<size_t>(E + 1), 0);
      for (int64_t e = 0; e < E; ++e) {
        want_offs[e + 1] = want_offs[e] + (counts[e] + align - 1) / align * align;
        for (int64_t i = 0; i < counts[e]; ++i) want_perm[want_offs[e] + i] = perm1[offsets[e] + i];
      }
      expect_equal(offs, want_offs, what + " offsets");
      expect_equal(perma, want_perm, what + " perm");
      std::vector<int32_t> want_row(static_cast<size_t>(R));
      for (int64_t r = 0; r < Rp; ++r)
        if (want_perm[r] >= 0) want_row[want_perm[r]] = static_cast<int32_t>(r);
      expect_equal(rowa, want_row, what + " row_of");
      if (k < E && N > 0) EXPECT_EQ(counts[E - 1], 0) << what;

      // The gather: packed rows at their places, zeros between.
      const std::vector<float> x = rnd(static_cast<size_t>(N * h), seed + 1);
      Tensor tx = tput(x, DType::f32, N, h), xs1 = tensor(DType::f32, R, h), xsa = tensor(DType::f32, Rp, h);
      gpu::moe_gather(xs1, tx, p1, d1, stream_);
      gpu::moe_gather(xsa, tx, pa, da, stream_);
      const auto g1 = tget(xs1);
      std::vector<float> want_xs(static_cast<size_t>(Rp * h), 0.f);
      for (int64_t r = 0; r < Rp; ++r)
        if (want_perm[r] >= 0)
          for (int64_t j = 0; j < h; ++j) want_xs[r * h + j] = g1[row1[want_perm[r]] * h + j];
      expect_equal(tget(xsa), want_xs, what + " gather");

      // Expert outputs: the packed rows at their places, garbage (large) on the padding.
      const std::vector<float> eout1 = rnd(static_cast<size_t>(R * h), seed + 2);
      std::vector<float> eouta(static_cast<size_t>(Rp * h), 1e30f);
      for (int64_t p = 0; p < R; ++p)
        for (int64_t j = 0; j < h; ++j) eouta[want_row[p] * h + j] = eout1[row1[p] * h + j];
      const float* w = put(rnd(static_cast<size_t>(R), seed + 3, 0.f, 1.f));
      Tensor te1 = tput(eout1, DType::f32, R, h), tea = tput(eouta, DType::f32, Rp, h);
      Tensor y1 = tensor(DType::f32, N, h), ya = tensor(DType::f32, N, h);
      gpu::moe_combine(y1, te1, w, r1, d1, stream_);
      gpu::moe_combine(ya, tea, w, ra, da, stream_);
      expect_equal(tget(ya), tget(y1), what + " combine");
      Tensor dx1 = tensor(DType::f32, N, h), dxa = tensor(DType::f32, N, h);
      gpu::moe_scatter_add(dx1, te1, r1, false, d1, stream_);
      gpu::moe_scatter_add(dxa, tea, ra, false, da, stream_);
      expect_equal(tget(dxa), tget(dx1), what + " scatter-add");

      // The combine backward: packed d_eout rows at their places, zeros on the padding.
      Tensor dy = tput(rnd(static_cast<size_t>(N * h), seed + 4), DType::f32, N, h);
      Tensor de1 = tensor(DType::f32, R, h), dea = tensor(DType::f32, Rp, h);
      float *dw1 = alloc<float>(R), *dwa = alloc<float>(R);
      gpu::moe_combine_backward(de1, dw1, dy, te1, w, p1, d1, stream_);
      gpu::moe_combine_backward(dea, dwa, dy, tea, w, pa, da, stream_);
      const auto gde1 = tget(de1);
      std::vector<float> want_de(static_cast<size_t>(Rp * h), 0.f);
      for (int64_t p = 0; p < R; ++p)
        for (int64_t j = 0; j < h; ++j) want_de[want_row[p] * h + j] = gde1[row1[p] * h + j];
      expect_equal(tget(dea), want_de, what + " d_eout");
      expect_equal(get(dwa, R), get(dw1, R), what + " d_weights");
    }
  }
  // A misuse: row_align outside [1, 1024] is refused naming it.
  MoeDims bad{4, 8, 1, 2, 1};
  bad.row_align = 0;
  EXPECT_NE(error_of([&] { cpu::moe_check(bad); }).find("row_align = 0"), std::string::npos);
}

TEST_F(CudaMoe, SortSkipsInvalidExperts) {
  const MoeDims d{300, 8, 1, 4, 2};
  const int64_t R = d.rows();
  std::mt19937 gen(5);
  std::vector<int32_t> experts(R);
  for (auto& e : experts) e = static_cast<int32_t>(gen() % 4);
  experts[7] = 4;
  experts[250] = -3;
  experts[599] = 1000;
  std::vector<int64_t> counts(4, 0), offsets(5, 0);
  std::vector<int32_t> perm(R, -1), row_of(R, -1);
  for (int32_t e : experts)
    if (e >= 0 && e < 4) ++counts[e];
  for (int e = 0; e < 4; ++e) offsets[e + 1] = offsets[e] + counts[e];
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
  for (int64_t i = 0; i < R; ++i) {
    const int32_t e = experts[i];
    if (e < 0 || e >= 4) continue;
    perm[fill[e]] = static_cast<int32_t>(i);
    row_of[i] = static_cast<int32_t>(fill[e]++);
  }
  ASSERT_EQ(offsets[4], R - 3);
  const int64_t ns = gpu::moe_sort_scratch_elems(d);
  int64_t* dc = alloc<int64_t>(4);
  int64_t* doff = alloc<int64_t>(5);
  int32_t* dp = alloc<int32_t>(R);
  int32_t* dr = alloc<int32_t>(R);
  gpu::moe_sort(dc, doff, dp, dr, put(experts), alloc<int32_t>(ns), ns, d, stream_);
  expect_equal(get(dc, 4), counts, "counts");
  expect_equal(get(doff, 5), offsets, "offsets");
  expect_equal(get(dp, R), perm, "perm (the last 3 rows untouched: -1)");
  expect_equal(get(dr, R), row_of, "row_of");
}

// ---- the block around the experts -------------------------------------------------

struct Layer {
  MoeDims d;
  std::vector<float> x, router, dy, aux_g;
  std::vector<std::vector<float>> w1, w2, w3;
  MoeBuffers<float> buf;
  std::vector<float> y, dx, dx_router;  // dx_router: d_logits Wr, the part of dx before the scatter-add
  MoeAuxStats stats;

  explicit Layer(const MoeDims& dims) : d(dims), buf(dims), stats(dims.E) {}
};

// A layer with random inputs and weights (uniform(-1, 1), the experts'
// weights scaled by 0.3), through cpu::moe_forward and cpu::moe_backward with
// the aux gradient (coef 0.02) of its own statistics. zero_expert >= 0: the
// last input feature is 1 on every token and that expert's router weight on it
// is -50 (the others' 0), so its logit is ~50 below the others' and no token
// chooses it.
std::unique_ptr<Layer> make_layer(const MoeDims& d, uint32_t seed, int zero_expert) {
  auto L = std::make_unique<Layer>(d);
  L->x = rnd(d.N * d.h, seed);
  L->router = rnd(d.E * d.h, seed + 1);
  if (zero_expert >= 0) {
    for (int64_t t = 0; t < d.N; ++t) L->x[t * d.h + d.h - 1] = 1.f;
    for (int64_t e = 0; e < d.E; ++e) L->router[e * d.h + d.h - 1] = e == zero_expert ? -50.f : 0.f;
  }
  MoeWeights<float> w;
  w.router = L->router.data();
  MoeGrads<float> g;
  std::vector<float> gr(d.E * d.h, 0.f);
  g.router = gr.data();
  std::vector<std::vector<float>> g1, g2, g3;
  for (int64_t e = 0; e < d.E; ++e) {
    L->w1.push_back(rnd(d.f * d.h, seed + 10 + 3 * e, -0.3f, 0.3f));
    L->w2.push_back(rnd(d.h * d.f, seed + 11 + 3 * e, -0.3f, 0.3f));
    L->w3.push_back(rnd(d.f * d.h, seed + 12 + 3 * e, -0.3f, 0.3f));
    g1.emplace_back(d.f * d.h, 0.f);
    g2.emplace_back(d.h * d.f, 0.f);
    g3.emplace_back(d.f * d.h, 0.f);
  }
  for (int64_t e = 0; e < d.E; ++e) {
    w.w1.push_back(L->w1[e].data());
    w.w2.push_back(L->w2[e].data());
    w.w3.push_back(L->w3[e].data());
    g.w1.push_back(g1[e].data());
    g.w2.push_back(g2[e].data());
    g.w3.push_back(g3[e].data());
  }
  L->y.assign(d.N * d.h, 0.f);
  L->dx.assign(d.N * d.h, 0.f);
  cpu::moe_forward(L->y.data(), L->x.data(), static_cast<const float*>(nullptr), w, L->buf.acts, d);
  cpu::moe_aux_accumulate(L->stats, L->buf.acts.probs, L->buf.acts.experts, d);
  L->aux_g.assign(d.E, 0.f);
  cpu::moe_aux_grad(L->aux_g.data(), L->stats, 0.02);
  L->dy = rnd(d.N * d.h, seed + 2);
  cpu::moe_backward(L->dx.data(), g, L->dy.data(), L->x.data(), static_cast<const float*>(nullptr), w, L->buf.acts, L->buf.scratch,
                    L->aux_g.data(), d);
  // The reference's router term of dx (lin_dx: one double sum per element, rounded once).
  L->dx_router.assign(d.N * d.h, 0.f);
  const float* dl = L->buf.scratch.d_logits;
  for (int64_t t = 0; t < d.N; ++t)
    for (int64_t c = 0; c < d.h; ++c) {
      double acc = 0.0;
      for (int64_t e = 0; e < d.E; ++e) acc += static_cast<double>(dl[t * d.E + e]) * L->router[e * d.h + c];
      L->dx_router[t * d.h + c] = static_cast<float>(acc);
    }
  return L;
}

template <typename T>
std::vector<T> vec(const T* p, int64_t n) {
  return std::vector<T>(p, p + n);
}

struct LayerCase {
  MoeDims d;
  int zero_expert;
};

const LayerCase kLayerCases[] = {
    {{37, 24, 16, 4, 2}, -1},   {{4096, 16, 8, 8, 2}, -1}, {{203, 20, 12, 5, 3}, -1},
    {{61, 17, 9, 4, 4}, -1},    {{150, 24, 8, 6, 2}, 3},   {{90, 13, 7, 3, 1}, -1},
};

TEST_F(CudaMoe, GatherCombineAndBackwardMatchReferenceFp32) {
  uint32_t seed = 1000;
  for (const LayerCase& lc : kLayerCases) {
    const MoeDims d = lc.d;
    const int64_t N = d.N, h = d.h, E = d.E, k = d.k, R = d.rows();
    auto L = make_layer(d, seed += 100, lc.zero_expert);
    const auto& a = L->buf.acts;
    const auto& s = L->buf.scratch;
    const std::string what = dims_str(d) + (lc.zero_expert >= 0 ? " (one expert unused)" : "");
    if (lc.zero_expert >= 0) ASSERT_EQ(a.counts[lc.zero_expert], 0) << what;

    const int32_t* perm = put(vec(a.perm, R));
    const int32_t* row_of = put(vec(a.row_of, R));
    const float* weights = put(vec(a.weights, N * k));
    const float* probs = put(vec(a.probs, N * E));
    const int32_t* experts = put(vec(a.experts, N * k));
    const auto xs_ref = vec(a.xs, R * h), eout = vec(a.eout, R * h);

    // Gather: a copy, exact.
    Tensor x = tput(L->x, DType::f32, N, h), xs = tensor(DType::f32, R, h);
    gpu::moe_gather(xs, x, perm, d, stream_);
    expect_equal(tget(xs), xs_ref, what + " gather");

    // Combine.
    Tensor te = tput(eout, DType::f32, R, h), y = tensor(DType::f32, N, h);
    gpu::moe_combine(y, te, weights, row_of, d, stream_);
    std::vector<double> mag(N * h, 0.0);
    for (int64_t p = 0; p < R; ++p)
      for (int64_t c = 0; c < h; ++c)
        mag[(p / k) * h + c] += std::fabs(static_cast<double>(a.weights[p]) * eout[a.row_of[p] * h + c]);
    expect_close(tget(y), L->y, [&](size_t i) { return (k + 1) * kUlp32 * mag[i] + kTiny; }, what + " combine");

    // Combine backward.
    Tensor tdy = tput(L->dy, DType::f32, N, h), de = tensor(DType::f32, R, h);
    float* dw = alloc<float>(R);
    gpu::moe_combine_backward(de, dw, tdy, te, weights, perm, d, stream_);
    expect_equal(tget(de), vec(s.d_eout, R * h), what + " d_eout");
    std::vector<double> dmag(R, 0.0);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < h; ++c)
        dmag[a.perm[r]] += std::fabs(static_cast<double>(L->dy[(a.perm[r] / k) * h + c]) * eout[r * h + c]);
    const auto dw_ref = vec(s.d_weights, R);
    expect_close(get(dw, R), dw_ref,
                 [&](size_t i) { return kUlp32 * std::fabs(dw_ref[i]) + h * 0x1p-52 * dmag[i] + kTiny; },
                 what + " d_weights");

    // Renormalisation and softmax backward, with the aux gradient, from the
    // reference's d_weights.
    const float* dwr = put(dw_ref);
    const float* aux = put(L->aux_g);
    float* dl = alloc<float>(N * E);
    gpu::moe_route_backward(dl, dwr, probs, experts, weights, aux, d, stream_);
    const auto dl_ref = vec(s.d_logits, N * E);
    const auto dp_ref = vec(s.d_probs, N * E);
    std::vector<double> lmag(N * E);
    for (int64_t t = 0; t < N; ++t) {
      double pd = 0.0;
      for (int64_t e = 0; e < E; ++e) pd += std::fabs(static_cast<double>(a.probs[t * E + e]) * dp_ref[t * E + e]);
      for (int64_t e = 0; e < E; ++e)
        lmag[t * E + e] = std::max<double>(std::fabs(dl_ref[t * E + e]),
                                           std::fabs(a.probs[t * E + e]) * (std::fabs(dp_ref[t * E + e]) + pd));
    }
    expect_close(get(dl, N * E), dl_ref, [&](size_t i) { return 4 * kUlp32 * lmag[i] + kTiny; },
                 what + " d_logits");
    // And without the aux term: the reference's formula with aux = 0 written out.
    float* dl0 = alloc<float>(N * E);
    gpu::moe_route_backward(dl0, dwr, probs, experts, weights, nullptr, d, stream_);
    const auto got0 = get(dl0, N * E), got_aux = get(dl, N * E);
    // The reference's loop (moe_backward's renormalisation and softmax step) with aux = 0.
    std::vector<float> dl0_ref(N * E);
    for (int64_t t = 0; t < N; ++t) {
      std::vector<float> dp(E, 0.f);
      double S = 0.0, dot = 0.0;
      for (int64_t j = 0; j < k; ++j) {
        S += a.probs[t * E + a.experts[t * k + j]];
        dot += static_cast<double>(dw_ref[t * k + j]) * a.weights[t * k + j];
      }
      for (int64_t j = 0; j < k; ++j)
        dp[a.experts[t * k + j]] += static_cast<float>((dw_ref[t * k + j] - dot) / S);
      double pd = 0.0;
      for (int64_t e = 0; e < E; ++e) pd += static_cast<double>(a.probs[t * E + e]) * dp[e];
      for (int64_t e = 0; e < E; ++e) dl0_ref[t * E + e] = static_cast<float>(a.probs[t * E + e] * (dp[e] - pd));
    }
    expect_close(got0, dl0_ref, [&](size_t i) { return 4 * kUlp32 * lmag[i] + kTiny; }, what + " d_logits (no aux)");
    double moved = 0.0;
    for (size_t i = 0; i < got0.size(); ++i) moved = std::max(moved, std::fabs(double(got0[i]) - got_aux[i]));
    EXPECT_GT(moved, 0.0) << what << ": the aux gradient must change d_logits";
    // Scatter-add onto the router's term: the reference's dx.
    Tensor dx = tput(L->dx_router, DType::f32, N, h), dxs = tput(vec(s.d_xs, R * h), DType::f32, R, h);
    gpu::moe_scatter_add(dx, dxs, row_of, true, d, stream_);
    std::vector<double> smag(N * h);
    for (int64_t i = 0; i < N * h; ++i) smag[i] = std::fabs(L->dx_router[i]);
    for (int64_t p = 0; p < R; ++p)
      for (int64_t c = 0; c < h; ++c) smag[(p / k) * h + c] += std::fabs(s.d_xs[a.row_of[p] * h + c]);
    expect_close(tget(dx), L->dx, [&](size_t i) { return (k + 1) * kUlp32 * smag[i] + kTiny; },
                 what + " scatter-add");
    // Written instead of accumulated: the d_xs rows alone.
    Tensor dx_only = tensor(DType::f32, N, h);
    gpu::moe_scatter_add(dx_only, dxs, row_of, false, d, stream_);
    std::vector<float> only_ref(N * h, 0.f);
    for (int64_t t = 0; t < N; ++t) {
      std::vector<int32_t> rows(a.row_of + t * k, a.row_of + (t + 1) * k);
      std::sort(rows.begin(), rows.end());
      for (int32_t r : rows)
        for (int64_t c = 0; c < h; ++c) only_ref[t * h + c] += s.d_xs[r * h + c];
    }
    // Pure fp32 additions in ascending row order: no product a compiler could
    // fuse, so the reference's order gives the same bits, and any other order
    // shows (k >= 3, or k = 2 onto a non-zero dx) in the last bits.
    expect_equal(tget(dx_only), only_ref, what + " scatter (written), bitwise");
    std::vector<float> acc_ref = L->dx_router;
    for (int64_t t = 0; t < N; ++t) {
      std::vector<int32_t> rows(a.row_of + t * k, a.row_of + (t + 1) * k);
      std::sort(rows.begin(), rows.end());
      for (int32_t r : rows)
        for (int64_t c = 0; c < h; ++c) acc_ref[t * h + c] += s.d_xs[r * h + c];
    }
    expect_equal(tget(dx), acc_ref, what + " scatter-add onto dx, bitwise");

    // The combine's order, bitwise: weights that are powers of two make every
    // product exact (fused or not), so only the order of the fp32 sums, from
    // zero in ascending row order as in the reference, decides the bits.
    std::vector<float> w2(R);
    for (int64_t p = 0; p < R; ++p) w2[p] = std::ldexp(1.f, -static_cast<int>(1 + p % 3));
    const float* dw2 = put(w2);
    Tensor y2 = tensor(DType::f32, N, h);
    gpu::moe_combine(y2, te, dw2, row_of, d, stream_);
    std::vector<float> y2_ref(N * h, 0.f);
    for (int64_t t = 0; t < N; ++t) {
      std::vector<std::pair<int32_t, int64_t>> slots;
      for (int64_t j = 0; j < k; ++j) slots.emplace_back(a.row_of[t * k + j], j);
      std::sort(slots.begin(), slots.end());
      for (auto [r, j] : slots)
        for (int64_t c = 0; c < h; ++c) y2_ref[t * h + c] += eout[r * h + c] * w2[t * k + j];
    }
    expect_equal(tget(y2), y2_ref, what + " combine with exact products, bitwise");
  }
}

// The same kernels on bf16 rows, against the reference's loops on the
// bf16-rounded inputs (the reference has no bf16 instantiation).
TEST_F(CudaMoe, GatherCombineAndBackwardBf16) {
  uint32_t seed = 5000;
  for (const LayerCase& lc : kLayerCases) {
    const MoeDims d = lc.d;
    const int64_t N = d.N, h = d.h, k = d.k, R = d.rows();
    auto L = make_layer(d, seed += 100, lc.zero_expert);
    const auto& a = L->buf.acts;
    const std::string what = dims_str(d) + " bf16";
    const int32_t* perm = put(vec(a.perm, R));
    const int32_t* row_of = put(vec(a.row_of, R));
    const float* weights = put(vec(a.weights, N * k));
    const auto x = rounded_bf16(L->x), eout = rounded_bf16(vec(a.eout, R * h)), dy = rounded_bf16(L->dy);

    Tensor tx = tput(x, DType::bf16, N, h), xs = tensor(DType::bf16, R, h);
    gpu::moe_gather(xs, tx, perm, d, stream_);
    std::vector<float> xs_ref(R * h);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < h; ++c) xs_ref[r * h + c] = x[(a.perm[r] / k) * h + c];
    expect_equal(tget(xs), xs_ref, what + " gather");

    Tensor te = tput(eout, DType::bf16, R, h), y = tensor(DType::bf16, N, h);
    gpu::moe_combine(y, te, weights, row_of, d, stream_);
    std::vector<float> y_ref(N * h, 0.f);
    std::vector<double> mag(N * h, 0.0);
    for (int64_t t = 0; t < N; ++t) {
      std::vector<std::pair<int32_t, int64_t>> slots;
      for (int64_t j = 0; j < k; ++j) slots.emplace_back(a.row_of[t * k + j], j);
      std::sort(slots.begin(), slots.end());
      for (auto [r, j] : slots)
        for (int64_t c = 0; c < h; ++c) {
          y_ref[t * h + c] += eout[r * h + c] * a.weights[t * k + j];
          mag[t * h + c] += std::fabs(static_cast<double>(eout[r * h + c]) * a.weights[t * k + j]);
        }
    }
    expect_close(tget(y), y_ref,
                 [&](size_t i) { return kUlpBf16 * std::fabs(y_ref[i]) + (k + 1) * kUlp32 * mag[i] + kTiny; },
                 what + " combine");

    Tensor tdy = tput(dy, DType::bf16, N, h), de = tensor(DType::bf16, R, h);
    float* dw = alloc<float>(R);
    gpu::moe_combine_backward(de, dw, tdy, te, weights, perm, d, stream_);
    std::vector<float> de_ref(R * h), dw_ref(R);
    std::vector<double> dmag(R, 0.0);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t p = a.perm[r], t = p / k;
      double acc = 0.0;
      for (int64_t c = 0; c < h; ++c) {
        acc += static_cast<double>(dy[t * h + c]) * eout[r * h + c];
        dmag[p] += std::fabs(static_cast<double>(dy[t * h + c]) * eout[r * h + c]);
        de_ref[r * h + c] = round_bf16(a.weights[p] * dy[t * h + c]);
      }
      dw_ref[p] = static_cast<float>(acc);
    }
    expect_equal(tget(de), de_ref, what + " d_eout");  // one fp32 product, rounded once to bf16: exact
    expect_close(get(dw, R), dw_ref,
                 [&](size_t i) { return kUlp32 * std::fabs(dw_ref[i]) + h * 0x1p-52 * dmag[i] + kTiny; },
                 what + " d_weights");

    const auto dx0 = rounded_bf16(L->dx_router), dxs = rounded_bf16(vec(L->buf.scratch.d_xs, R * h));
    Tensor dx = tput(dx0, DType::bf16, N, h), tdxs = tput(dxs, DType::bf16, R, h);
    gpu::moe_scatter_add(dx, tdxs, row_of, true, d, stream_);
    std::vector<float> dx_ref = dx0;
    std::vector<double> smag(N * h);
    for (int64_t i = 0; i < N * h; ++i) smag[i] = std::fabs(dx0[i]);
    for (int64_t t = 0; t < N; ++t) {
      std::vector<int32_t> rows(a.row_of + t * k, a.row_of + (t + 1) * k);
      std::sort(rows.begin(), rows.end());
      for (int32_t r : rows)
        for (int64_t c = 0; c < h; ++c) {
          dx_ref[t * h + c] += dxs[r * h + c];
          smag[t * h + c] += std::fabs(dxs[r * h + c]);
        }
    }
    expect_close(tget(dx), dx_ref,
                 [&](size_t i) { return kUlpBf16 * std::fabs(dx_ref[i]) + (k + 1) * kUlp32 * smag[i] + kTiny; },
                 what + " scatter-add");
  }
}

// ---- aux statistics -------------------------------------------------------------------

TEST_F(CudaMoe, AuxStatisticsMatchReferenceOverTwoLayers) {
  for (const LayerCase& lc : {kLayerCases[0], kLayerCases[1], kLayerCases[4]}) {
    const MoeDims d = lc.d;
    const int64_t E = d.E;
    auto L1 = make_layer(d, 9000, lc.zero_expert);
    auto L2 = make_layer(d, 9500, lc.zero_expert);
    MoeAuxStats ref(E);
    int64_t* acounts = put(std::vector<int64_t>(E, 0));
    double* asum = put(std::vector<double>(E, 0.0));
    for (Layer* L : {L1.get(), L2.get()}) {
      cpu::moe_aux_accumulate(ref, L->buf.acts.probs, L->buf.acts.experts, d);
      const int64_t* counts = put(vec(L->buf.acts.counts, E));
      const float* probs = put(vec(L->buf.acts.probs, d.N * E));
      gpu::moe_aux_accumulate(acounts, asum, counts, probs, d, stream_);
    }
    const std::string what = dims_str(d);
    expect_equal(get(acounts, E), ref.counts, what + " aux counts");
    const auto sums = get(asum, E);
    for (int64_t e = 0; e < E; ++e)
      EXPECT_NEAR(sums[e], ref.prob_sum[e], 2.0 * d.N * 0x1p-52 * ref.prob_sum[e] + 1e-300) << what << " prob sum " << e;
    // The finish on the reference's own sums: the gradient bitwise, the loss to 1e-12.
    const double coef = 0.02;
    double* loss = alloc<double>(1);
    float* grad = alloc<float>(E);
    const double* rsum = put(ref.prob_sum);
    const int64_t* rcounts = put(ref.counts);
    gpu::moe_aux_finish(loss, grad, rcounts, rsum, ref.rows, coef, E, stream_);
    std::vector<float> grad_ref(E);
    cpu::moe_aux_grad(grad_ref.data(), ref, coef);
    expect_equal(get(grad, E), grad_ref, what + " aux grad");
    const double l = get(loss, 1)[0], l_ref = cpu::moe_aux_loss(ref);
    EXPECT_NEAR(l, l_ref, 1e-12 * std::fabs(l_ref)) << what << " aux loss";
    // No rows yet: zero loss and gradient.
    gpu::moe_aux_finish(loss, grad, rcounts, rsum, 0, coef, E, stream_);
    EXPECT_EQ(get(loss, 1)[0], 0.0);
    expect_equal(get(grad, E), std::vector<float>(E, 0.f), what + " aux grad with no rows");
  }
}

// ---- the CUDA backend's other MoE steps: router GEMM, jitter, flat aux statistics ----------
//
// Router forward and backward against double-precision sums of the same
// (for bf16: bf16-rounded) inputs. An fp32 sum of n products with fused
// multiply-adds is within n 2^-23 sum |terms| of the exact sum (the standard
// gamma_n bound); bf16 outputs add one bf16 rounding, 2^-8 |a|. The router's
// weight gradient is accumulated into a non-zero start (it is +=): n = N + the
// chunks' sum + the start. Jitter and scale are one double->float rounding and
// one fp32 product on both sides: bitwise. Flat aux statistics as the
// two-layer test above (counts and rows exact, sums N 2^-52, gradient bitwise).

std::vector<double> router_ref(const std::vector<float>& x, const std::vector<float>& w, const MoeDims& d,
                               std::vector<double>* abs_sum) {
  std::vector<double> l(static_cast<size_t>(d.N * d.E));
  abs_sum->assign(l.size(), 0.0);
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t e = 0; e < d.E; ++e) {
      double acc = 0, a = 0;
      for (int64_t j = 0; j < d.h; ++j) {
        const double t = static_cast<double>(x[n * d.h + j]) * w[e * d.h + j];
        acc += t;
        a += std::fabs(t);
      }
      l[n * d.E + e] = acc;
      (*abs_sum)[n * d.E + e] = a;
    }
  return l;
}

// Hidden sizes that are multiples of 8 take the 16-byte (packed) kernels,
// 101 and 37 the scalar ones; 13, 41 and 21 experts leave a partial group of
// the 8 a pass takes. The mixtral-small shape (8192 tokens, h 2048, 8 experts)
// is one of them. The two cases with a scratch argument give the weight
// gradient a scratch that cannot hold one token chunk's [E h] partials (as
// the backend's 16 MiB cannot for E = 4096, h = 4096): the experts are
// reduced in slices, 2 at a time over 16 chunks (41 experts: the last slice
// has one) and 1 at a time over 5 chunks.
TEST_F(CudaMoe, RouterGemmForwardAndBackwardMatchDoubleSums) {
  struct Case {
    int64_t N, h, E;
    size_t scratch_bytes = size_t{16} << 20;
  };
  for (const Case c : {Case{37, 48, 4}, Case{300, 96, 8}, Case{4096, 512, 8}, Case{129, 200, 5},
                       Case{70, 101, 6}, Case{333, 37, 21}, Case{8192, 2048, 8},
                       Case{1500, 96, 41, 32 * 96 * 4}, Case{300, 200, 13, 5 * 200 * 4 + 100}}) {
    for (DType t : {DType::f32, DType::bf16}) {
      MoeDims d;
      d.N = c.N;
      d.h = c.h;
      d.E = c.E;
      d.k = 2;
      d.f = 1;
      const std::string what =
          dims_str(d) + " " + std::string(dtype_name(t)) + " scratch " + std::to_string(c.scratch_bytes);
      const bool bf = t == DType::bf16;
      std::vector<float> x = rnd(static_cast<size_t>(d.N * d.h), 101, -1.f, 1.f);
      std::vector<float> w = rnd(static_cast<size_t>(d.E * d.h), 202, -0.5f, 0.5f);
      std::vector<float> dl = rnd(static_cast<size_t>(d.N * d.E), 303, -1.f, 1.f);
      std::vector<float> dw0 = rnd(static_cast<size_t>(d.E * d.h), 404, -0.1f, 0.1f);
      if (bf) {
        x = rounded_bf16(x);
        w = rounded_bf16(w);
        dw0 = rounded_bf16(dw0);
      }
      const Tensor xt = tput(x, t, d.N, d.h), wt = tput(w, t, d.E, d.h);
      float* logits = alloc<float>(static_cast<size_t>(d.N * d.E));
      gpu::moe_router_forward(logits, xt, wt, d, stream_);
      std::vector<double> abs_l;
      const std::vector<double> ref_l = router_ref(x, w, d, &abs_l);
      const std::vector<float> got_l = get(logits, static_cast<size_t>(d.N * d.E));
      std::vector<float> want_l(ref_l.begin(), ref_l.end());
      expect_close(got_l, want_l, [&](size_t i) { return (d.h + 1) * kUlp32 * abs_l[i] + kTiny; },
                   what + " logits");

      // Backward: dx = dl W (written), dW += dl^T x.
      const float* dlp = put(dl);
      Tensor dx = tensor(t, d.N, d.h);
      Tensor dW = tput(dw0, t, d.E, d.h);
      const size_t scratch_bytes = c.scratch_bytes;
      void* scratch = alloc<uint8_t>(scratch_bytes);
      gpu::moe_router_backward(dx, dW, dlp, xt, wt, scratch, scratch_bytes, d, stream_);
      std::vector<float> want_dx(static_cast<size_t>(d.N * d.h)), want_dw(static_cast<size_t>(d.E * d.h));
      std::vector<double> abs_dx(want_dx.size()), abs_dw(want_dw.size());
      for (int64_t n = 0; n < d.N; ++n)
        for (int64_t j = 0; j < d.h; ++j) {
          double acc = 0, a = 0;
          for (int64_t e = 0; e < d.E; ++e) {
            const double tm = static_cast<double>(dl[n * d.E + e]) * w[e * d.h + j];
            acc += tm;
            a += std::fabs(tm);
          }
          want_dx[n * d.h + j] = static_cast<float>(acc);
          abs_dx[n * d.h + j] = a;
        }
      for (int64_t e = 0; e < d.E; ++e)
        for (int64_t j = 0; j < d.h; ++j) {
          double acc = dw0[e * d.h + j], a = std::fabs(acc);
          for (int64_t n = 0; n < d.N; ++n) {
            const double tm = static_cast<double>(dl[n * d.E + e]) * x[n * d.h + j];
            acc += tm;
            a += std::fabs(tm);
          }
          want_dw[e * d.h + j] = static_cast<float>(acc);
          abs_dw[e * d.h + j] = a;
        }
      const double extra = bf ? kUlpBf16 : 0.0;
      expect_close(tget(dx), want_dx,
                   [&](size_t i) { return (d.E + 1) * kUlp32 * abs_dx[i] + extra * std::fabs(want_dx[i]) + kTiny; },
                   what + " router dx");
      const std::vector<float> got_dw = tget(dW);
      expect_close(got_dw, want_dw,
                   [&](size_t i) {
                     return (d.N + 1100) * kUlp32 * abs_dw[i] + extra * std::fabs(want_dw[i]) + kTiny;
                   },
                   what + " router dW");
      // Same inputs again: the same bits (no atomics; the chunking is a function of the shape).
      Tensor dW2 = tput(dw0, t, d.E, d.h);
      gpu::moe_router_backward(dx, dW2, dlp, xt, wt, scratch, scratch_bytes, d, stream_);
      EXPECT_EQ(tget(dW2), got_dw) << what << " router dW is not reproducible";
    }
  }
}

TEST_F(CudaMoe, JitterScaleAndFlatAuxMatchReference) {
  // Jitter: the CPU's noise bitwise (the same counter hash), xin = x * noise bitwise.
  for (const double eps : {0.0, 0.01, 0.3}) {
    const int64_t n = 10007;
    const uint64_t seed = 0x1234567890ABCDEFull ^ static_cast<uint64_t>(eps * 1000);
    std::vector<float> x = rnd(static_cast<size_t>(n), 77);
    std::vector<float> noise(static_cast<size_t>(n)), xin(static_cast<size_t>(n));
    cpu::moe_jitter_noise(noise.data(), n, eps, seed);
    cpu::moe_jitter_apply(xin.data(), x.data(), noise.data(), n);
    Tensor xt = tput(x, DType::f32, 1, n), nt = tensor(DType::f32, 1, n), it = tensor(DType::f32, 1, n);
    gpu::moe_jitter(it, nt, xt, eps, seed, stream_);
    expect_equal(tget(nt), noise, "jitter noise eps=" + std::to_string(eps));
    expect_equal(tget(it), xin, "jitter xin eps=" + std::to_string(eps));
    // Its backward: dx *= noise.
    std::vector<float> dx = rnd(static_cast<size_t>(n), 78), want(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) want[i] = dx[i] * noise[i];
    Tensor dxt = tput(dx, DType::f32, 1, n);
    gpu::moe_scale_by(dxt, nt, stream_);
    expect_equal(tget(dxt), want, "scale by noise eps=" + std::to_string(eps));
  }
  // bf16: the noise is the fp32 noise rounded to bf16; xin the fp32 product of the bf16 values, rounded.
  {
    const int64_t n = 4099;
    std::vector<float> x = rounded_bf16(rnd(static_cast<size_t>(n), 79));
    std::vector<float> noise(static_cast<size_t>(n));
    cpu::moe_jitter_noise(noise.data(), n, 0.05, 99);
    std::vector<float> want_n(static_cast<size_t>(n)), want_x(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      want_n[i] = round_bf16(noise[i]);
      want_x[i] = round_bf16(x[i] * want_n[i]);
    }
    Tensor xt = tput(x, DType::bf16, 1, n), nt = tensor(DType::bf16, 1, n), it = tensor(DType::bf16, 1, n);
    gpu::moe_jitter(it, nt, xt, 0.05, 99, stream_);
    expect_equal(tget(nt), want_n, "bf16 jitter noise");
    expect_equal(tget(it), want_x, "bf16 jitter xin");
  }
  // Flat aux statistics over two layers of random routing.
  for (const int64_t E : {4, 8}) {
    MoeDims d;
    d.N = 777;
    d.E = E;
    d.k = 2;
    d.h = 1;
    d.f = 1;
    const std::string what = dims_str(d);
    std::vector<double> ref(static_cast<size_t>(2 * E + 1), 0.0);
    double* stats = put(ref);
    std::mt19937 gen(static_cast<uint32_t>(E));
    for (int layer = 0; layer < 2; ++layer) {
      std::vector<float> probs = rnd(static_cast<size_t>(d.N * E), 500 + static_cast<uint32_t>(layer), 0.f, 1.f);
      std::vector<int32_t> experts(static_cast<size_t>(d.N * d.k));
      std::vector<int64_t> counts(static_cast<size_t>(E), 0);
      for (int64_t t = 0; t < d.N; ++t) {
        const int32_t a = static_cast<int32_t>(gen() % E);
        const int32_t b = static_cast<int32_t>((a + 1 + gen() % (E - 1)) % E);
        experts[t * 2] = a;
        experts[t * 2 + 1] = b;
        ++counts[a];
        ++counts[b];
      }
      cpu::moe_aux_accumulate_flat(ref.data(), probs.data(), experts.data(), d);
      gpu::moe_aux_accumulate_flat(stats, put(counts), put(probs), d, stream_);
    }
    const std::vector<double> got = get(stats, ref.size());
    for (int64_t e = 0; e < E; ++e) {
      EXPECT_EQ(got[e], ref[e]) << what << " selections of expert " << e;
      EXPECT_NEAR(got[E + e], ref[E + e], 2.0 * d.N * 0x1p-52 * ref[E + e]) << what << " prob sum " << e;
    }
    EXPECT_EQ(got[2 * E], ref[2 * E]) << what << " rows";
    float* aux = alloc<float>(1);
    float* grad = alloc<float>(static_cast<size_t>(E));
    const double coef = 0.02 * 0.125;
    gpu::moe_aux_finish_flat(aux, grad, stats, coef, E, stream_);
    std::vector<float> grad_ref(static_cast<size_t>(E));
    cpu::moe_aux_grad_flat(grad_ref.data(), ref.data(), E, coef);
    expect_equal(get(grad, static_cast<size_t>(E)), grad_ref, what + " flat aux grad");
    const double l = get(aux, 1)[0], l_ref = static_cast<float>(cpu::moe_aux_loss_flat(ref.data(), E));
    EXPECT_NEAR(l, l_ref, 2 * kUlp32 * std::fabs(l_ref)) << what << " flat aux loss";
  }
}

// ---- determinism ------------------------------------------------------------------------

TEST_F(CudaMoe, EveryKernelIsBitwiseReproducible) {
  struct Big {
    MoeDims d;
  };
  for (const Big& b : {Big{{32768, 64, 1, 8, 2}}, Big{{16411, 40, 1, 16, 4}}}) {
    const MoeDims d = b.d;
    const int64_t N = d.N, h = d.h, E = d.E, k = d.k, R = d.rows();
    const std::string what = dims_str(d);
    Tensor logits = tput(make_logits(d, 77, false, -1), DType::f32, N, E);
    Tensor x = tput(rnd(N * h, 78), DType::bf16, N, h);
    Tensor eout = tput(rnd(R * h, 79), DType::bf16, R, h);
    Tensor dy = tput(rnd(N * h, 80), DType::bf16, N, h);
    Tensor dxs = tput(rnd(R * h, 81), DType::f32, R, h);
    const float* aux = put(rnd(E, 82, 0.f, 0.01f));
    const int64_t ns = gpu::moe_sort_scratch_elems(d);
    std::vector<std::vector<uint8_t>> runs[2];
    for (auto& out : runs) {
      float* probs = alloc<float>(N * E);
      float* weights = alloc<float>(N * k);
      int32_t* experts = alloc<int32_t>(N * k);
      int64_t* counts = alloc<int64_t>(E);
      int64_t* offsets = alloc<int64_t>(E + 1);
      int32_t* perm = alloc<int32_t>(R);
      int32_t* row_of = alloc<int32_t>(R);
      int32_t* scratch = alloc<int32_t>(ns);
      Tensor xs = tensor(DType::bf16, R, h), y = tensor(DType::bf16, N, h), de = tensor(DType::bf16, R, h);
      Tensor dx = tensor(DType::f32, N, h);
      float* dw = alloc<float>(R);
      float* dl = alloc<float>(N * E);
      int64_t* acounts = put(std::vector<int64_t>(E, 0));
      double* asum = put(std::vector<double>(E, 0.0));
      gpu::moe_route(probs, experts, weights, logits, d, stream_);
      gpu::moe_sort(counts, offsets, perm, row_of, experts, scratch, ns, d, stream_);
      gpu::moe_gather(xs, x, perm, d, stream_);
      gpu::moe_combine(y, eout, weights, row_of, d, stream_);
      gpu::moe_combine_backward(de, dw, dy, eout, weights, perm, d, stream_);
      gpu::moe_route_backward(dl, dw, probs, experts, weights, aux, d, stream_);
      gpu::moe_scatter_add(dx, dxs, row_of, false, d, stream_);
      gpu::moe_aux_accumulate(acounts, asum, counts, probs, d, stream_);
      out = {bytes(probs, N * E),   bytes(weights, N * k), bytes(experts, N * k),
             bytes(counts, E),      bytes(offsets, E + 1), bytes(perm, R),
             bytes(row_of, R),      bytes(static_cast<uint16_t*>(xs.data), R * h),
             bytes(static_cast<uint16_t*>(y.data), N * h), bytes(static_cast<uint16_t*>(de.data), R * h),
             bytes(dw, R),          bytes(dl, N * E),      bytes(static_cast<float*>(dx.data), N * h),
             bytes(acounts, E),     bytes(asum, E)};
      // The sort agrees with the reference on the experts the router chose.
      if (&out == &runs[0]) {
        const auto ex = get(experts, N * k);
        std::vector<int64_t> rc(E), ro(E + 1);
        std::vector<int32_t> rp(R), rr(R);
        cpu::moe_sort(rc.data(), ro.data(), rp.data(), rr.data(), ex.data(), d);
        expect_equal(get(perm, R), rp, what + " perm");
        expect_equal(get(row_of, R), rr, what + " row_of");
      }
    }
    const char* names[] = {"probs", "weights", "experts", "counts", "offsets", "perm", "row_of", "xs",
                           "y",     "d_eout",  "d_weights", "d_logits", "dx", "aux counts", "aux prob sums"};
    for (size_t i = 0; i < runs[0].size(); ++i) EXPECT_EQ(runs[0][i], runs[1][i]) << what << " " << names[i];
  }
}

// ---- refusals (host-side checks, before any launch) ---------------------------------------

TEST(CudaMoeChecks, RefusesBadShapesDtypesAndScratch) {
  // Fake device addresses: every call below must throw before it touches them.
  alignas(16) static char fake[64];
  auto dev = [](DType t, int64_t r, int64_t c) { return Tensor(fake, t, Device::cuda, {r, c}); };
  float* f = reinterpret_cast<float*>(fake);
  int32_t* i32 = reinterpret_cast<int32_t*>(fake);
  int64_t* i64 = reinterpret_cast<int64_t*>(fake);
  const MoeDims d{10, 8, 4, 4, 2};
  cudaStream_t s = nullptr;
  Tensor logits = dev(DType::f32, 10, 4);
  EXPECT_NE(error_of([&] { gpu::moe_route(f, i32, f, logits, MoeDims{10, 8, 4, 4, 5}, s); }).find("exceeds num_experts"),
            std::string::npos);
  EXPECT_NE(error_of([&] { gpu::moe_route(f, i32, f, logits, MoeDims{10, 8, 4, 4, 0}, s); }).find("top_k = 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { gpu::moe_route(f, i32, f, dev(DType::f32, 10, 5), d, s); }).find("expected [10, 4]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { gpu::moe_route(f, i32, f, dev(DType::i32, 10, 4), d, s); }).find("not supported"),
            std::string::npos);
  EXPECT_NE(error_of([&] { gpu::moe_route(nullptr, i32, f, logits, d, s); }).find("null device pointer"),
            std::string::npos);
  Tensor host = Tensor(fake, DType::f32, Device::cpu, {10, 4});
  EXPECT_NE(error_of([&] { gpu::moe_route(f, i32, f, host, d, s); }).find("device memory"), std::string::npos);
  const int64_t ns = gpu::moe_sort_scratch_elems(d);
  EXPECT_EQ(ns, 4);  // 20 pairs: one chunk, one counter per expert
  EXPECT_NE(error_of([&] { gpu::moe_sort(i64, i64, i32, i32, i32, i32, ns - 1, d, s); }).find("moe_sort_scratch_elems"),
            std::string::npos);
  Tensor x32 = dev(DType::f32, 10, 8), xs16 = dev(DType::bf16, 20, 8), xs32 = dev(DType::f32, 20, 8);
  EXPECT_NE(error_of([&] { gpu::moe_gather(xs16, x32, i32, d, s); }).find("expected fp32"), std::string::npos);
  Tensor xs_short = dev(DType::f32, 19, 8);
  EXPECT_NE(error_of([&] { gpu::moe_gather(xs_short, x32, i32, d, s); }).find("expected [20, 8]"), std::string::npos);
  Tensor y16 = dev(DType::bf16, 10, 8);
  EXPECT_NE(error_of([&] { gpu::moe_combine(y16, xs32, f, i32, d, s); }).find("moe_combine y is bf16"),
            std::string::npos);
  EXPECT_NE(error_of([&] { gpu::moe_scatter_add(x32, xs32, nullptr, true, d, s); }).find("row_of: null"),
            std::string::npos);
  EXPECT_NE(error_of([&] { gpu::moe_combine_backward(xs32, f, y16, xs32, f, i32, d, s); }).find("dy is bf16"),
            std::string::npos);
  EXPECT_NE(error_of([&] { gpu::moe_aux_finish(nullptr, f, i64, nullptr, 5, 0.01, 4, s); }).find("aux_prob_sum"),
            std::string::npos);
  EXPECT_NE(error_of([&] { gpu::moe_aux_finish(nullptr, f, i64, reinterpret_cast<double*>(fake), -1, 0.01, 4, s); })
                .find("rows = -1"),
            std::string::npos);
}

}  // namespace
}  // namespace loom

#else  // built without CUDA

TEST(CudaMoe, SkippedWithoutCuda) { GTEST_SKIP() << "built without CUDA"; }

#endif
