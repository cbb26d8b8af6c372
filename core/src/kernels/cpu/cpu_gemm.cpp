// The three GEMMs of a linear layer on the CPU, in a fixed order of
// arithmetic that gives the same bits on every x86-64 processor.
//
// Why not a BLAS: an optimised BLAS picks its kernels per processor model
// (OpenBLAS has Haswell, SkylakeX and Zen kernels, each with its own
// unrolling, K splitting and small-matrix paths), so the same run rounds
// differently on an Intel and an AMD machine, and a training run, being
// chaotic, ends somewhere else. The CPU path is Loom's reference: its result
// must depend on the inputs alone.
//
// The definition, for every output element and every processor, SIMD width
// and thread count:
//
//   c = accumulate ? C[i, j] : 0
//   for p = 0, 1, ..., K - 1:   c = fma(A[i, p], B[p, j], c)      (one rounding per step)
//   C[i, j] = c
//
// fma is exactly specified by IEEE 754 (the exact a*b + c rounded once), so
// the AVX2/FMA kernel below, which runs 96 such chains at once in SIMD lanes,
// and the portable kernel, which calls std::fma, give identical bits
// (CpuGemm.* in tests/test_cpu_kernels.cpp checks both against a plain loop of
// std::fma). Blocking over K keeps the order: a tile's partial sums are stored
// to C (exactly, in the element type) and reloaded for the next K block, which
// continues the same chain. Threads split the output tiles, never K.
//
// m = rows (tokens), k = in features, n = out features.
#include "loom/cpu_gemm.hpp"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels/cpu/gemm_paths.hpp"
#include "loom/error.hpp"

namespace loom::cpu {
namespace {

using detail::GemmPath;

void check_ld(int64_t ld, int64_t cols, const char* what) {
  LOOM_CHECK(ld >= cols && ld >= 1, "cpu gemm: row stride of ", what, " is ", ld, ", smaller than its ", cols,
             " columns");
}

void check_dims(int64_t m, int64_t k, int64_t n) {
  LOOM_CHECK(m >= 0 && k >= 0 && n >= 0, "cpu gemm: negative size m=", m, " k=", k, " n=", n);
}

// A strided matrix view: element (r, c) is at p[r * rs + c * cs]. Lets one
// driver read x, W, W^T, dy and dy^T without copies.
template <typename T>
struct View {
  const T* p;
  int64_t rs, cs;
  const T& at(int64_t r, int64_t c) const { return p[r * rs + c * cs]; }
};

// Tile shapes: MR rows of A by NR columns of B, held in registers. AVX2 has 16
// ymm registers: 12 accumulators (6 rows x 2 vectors), 2 of B, 1 broadcast of A.
constexpr int kMR = 6;
template <typename T>
constexpr int kNR = 64 / static_cast<int>(sizeof(T));  // two 32-byte vectors: 16 floats, 8 doubles
// K block: a packed B panel of kKB x NR (16 KiB: 64 bytes a row) stays in L1 across the M tiles.
constexpr int64_t kKB = 256;
// A job's rows (a multiple of kMR: its packed A block, 96 KiB of floats, stays in L2) and columns.
constexpr int64_t kMJob = 16 * kMR;
constexpr int64_t kNJob = 256;

std::atomic<int> g_path{-1};  // -1: not chosen yet; else a GemmPath

GemmPath detect_path() {
  if (const char* e = std::getenv("LOOM_CPU_GEMM")) {
    if (std::strcmp(e, "portable") == 0) return GemmPath::portable;
  }
  __builtin_cpu_init();
  return (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? GemmPath::avx2_fma : GemmPath::portable;
}

GemmPath current_path() {
  int p = g_path.load(std::memory_order_relaxed);
  if (p < 0) {
    p = static_cast<int>(detect_path());
    g_path.store(p, std::memory_order_relaxed);
  }
  return static_cast<GemmPath>(p);
}

// --- portable kernel: std::fma, element by element, in the defined order ---
// ap: the tile's A rows packed [kc][kMR]; bp: its B columns packed [kc][NR];
// c: the tile [kMR][NR], holding the chains' values so far.
template <typename T>
void tile_portable(int64_t kc, const T* ap, const T* bp, T* c) {
  constexpr int NR = kNR<T>;
  for (int64_t p = 0; p < kc; ++p) {
    const T* b = bp + p * NR;
    for (int r = 0; r < kMR; ++r) {
      const T a = ap[p * kMR + r];
      T* cr = c + r * NR;
      for (int j = 0; j < NR; ++j) cr[j] = std::fma(a, b[j], cr[j]);
    }
  }
}

// --- AVX2 + FMA kernels: the same chains, 8 floats or 4 doubles a vector ---
__attribute__((target("avx2,fma"))) void tile_avx2(int64_t kc, const float* ap, const float* bp, float* c) {
  __m256 c00 = _mm256_load_ps(c + 0), c01 = _mm256_load_ps(c + 8);
  __m256 c10 = _mm256_load_ps(c + 16), c11 = _mm256_load_ps(c + 24);
  __m256 c20 = _mm256_load_ps(c + 32), c21 = _mm256_load_ps(c + 40);
  __m256 c30 = _mm256_load_ps(c + 48), c31 = _mm256_load_ps(c + 56);
  __m256 c40 = _mm256_load_ps(c + 64), c41 = _mm256_load_ps(c + 72);
  __m256 c50 = _mm256_load_ps(c + 80), c51 = _mm256_load_ps(c + 88);
  for (int64_t p = 0; p < kc; ++p, ap += kMR, bp += 16) {
    const __m256 b0 = _mm256_load_ps(bp), b1 = _mm256_load_ps(bp + 8);
    __m256 a = _mm256_broadcast_ss(ap + 0);
    c00 = _mm256_fmadd_ps(a, b0, c00), c01 = _mm256_fmadd_ps(a, b1, c01);
    a = _mm256_broadcast_ss(ap + 1);
    c10 = _mm256_fmadd_ps(a, b0, c10), c11 = _mm256_fmadd_ps(a, b1, c11);
    a = _mm256_broadcast_ss(ap + 2);
    c20 = _mm256_fmadd_ps(a, b0, c20), c21 = _mm256_fmadd_ps(a, b1, c21);
    a = _mm256_broadcast_ss(ap + 3);
    c30 = _mm256_fmadd_ps(a, b0, c30), c31 = _mm256_fmadd_ps(a, b1, c31);
    a = _mm256_broadcast_ss(ap + 4);
    c40 = _mm256_fmadd_ps(a, b0, c40), c41 = _mm256_fmadd_ps(a, b1, c41);
    a = _mm256_broadcast_ss(ap + 5);
    c50 = _mm256_fmadd_ps(a, b0, c50), c51 = _mm256_fmadd_ps(a, b1, c51);
  }
  _mm256_store_ps(c + 0, c00), _mm256_store_ps(c + 8, c01);
  _mm256_store_ps(c + 16, c10), _mm256_store_ps(c + 24, c11);
  _mm256_store_ps(c + 32, c20), _mm256_store_ps(c + 40, c21);
  _mm256_store_ps(c + 48, c30), _mm256_store_ps(c + 56, c31);
  _mm256_store_ps(c + 64, c40), _mm256_store_ps(c + 72, c41);
  _mm256_store_ps(c + 80, c50), _mm256_store_ps(c + 88, c51);
}

__attribute__((target("avx2,fma"))) void tile_avx2(int64_t kc, const double* ap, const double* bp, double* c) {
  __m256d acc[kMR][2];
  for (int r = 0; r < kMR; ++r) acc[r][0] = _mm256_load_pd(c + r * 8), acc[r][1] = _mm256_load_pd(c + r * 8 + 4);
  for (int64_t p = 0; p < kc; ++p, ap += kMR, bp += 8) {
    const __m256d b0 = _mm256_load_pd(bp), b1 = _mm256_load_pd(bp + 4);
    for (int r = 0; r < kMR; ++r) {
      const __m256d a = _mm256_broadcast_sd(ap + r);
      acc[r][0] = _mm256_fmadd_pd(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_pd(a, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < kMR; ++r) _mm256_store_pd(c + r * 8, acc[r][0]), _mm256_store_pd(c + r * 8 + 4, acc[r][1]);
}

// C[m, n] (ldc) = (accumulate ? C : 0) + A[m, k] B[k, n], each element by the
// chain in the file comment. A job is up to kMJob rows by up to kNJob columns
// of C; it runs its K blocks in order, packs that block of its A rows once
// (kMR-row panels, rows past m repeat the last real row) and, panel by panel,
// its B columns (NR wide, zero past n), into 64-byte-aligned stack buffers.
template <typename T>
void gemm(T* C, int64_t ldc, View<T> A, View<T> B, int64_t m, int64_t k, int64_t n, bool accumulate) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate)
      for (int64_t i = 0; i < m; ++i) std::fill(C + i * ldc, C + i * ldc + n, T(0));
    return;
  }
  constexpr int NR = kNR<T>;
  const bool simd = current_path() == GemmPath::avx2_fma;
  const int64_t jobs_n = (n + kNJob - 1) / kNJob, jobs_m = (m + kMJob - 1) / kMJob, jobs = jobs_n * jobs_m;
  // Below ~1 MFLOP the thread start costs more than it saves; either way the bits are the same.
  const bool parallel = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) > 5e5 && jobs > 1;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t job = 0; job < jobs; ++job) {
    const int64_t i_begin = (job / jobs_n) * kMJob, i_end = std::min(m, i_begin + kMJob);
    const int64_t j_begin = (job % jobs_n) * kNJob, j_end = std::min(n, j_begin + kNJob);
    alignas(64) T ap[kMJob * kKB];
    alignas(64) T bp[kKB * NR];
    alignas(64) T tile[kMR * NR];
    for (int64_t p0 = 0; p0 < k; p0 += kKB) {
      const int64_t kc = std::min(kKB, k - p0);
      const bool fresh = p0 == 0 && !accumulate;  // the chains start at 0, C is not read
      for (int64_t i0 = i_begin; i0 < i_end; i0 += kMR) {
        T* panel = ap + (i0 - i_begin) * kc;
        for (int r = 0; r < kMR; ++r) {
          const int64_t i = std::min(i0 + r, m - 1);
          for (int64_t p = 0; p < kc; ++p) panel[p * kMR + r] = A.at(i, p0 + p);
        }
      }
      for (int64_t j0 = j_begin; j0 < j_end; j0 += NR) {
        const int64_t nr = std::min<int64_t>(NR, j_end - j0);
        for (int64_t p = 0; p < kc; ++p) {
          T* row = bp + p * NR;
          for (int64_t j = 0; j < nr; ++j) row[j] = B.at(p0 + p, j0 + j);
          for (int64_t j = nr; j < NR; ++j) row[j] = T(0);
        }
        for (int64_t i0 = i_begin; i0 < i_end; i0 += kMR) {
          const int64_t mr = std::min<int64_t>(kMR, i_end - i0);
          for (int r = 0; r < kMR; ++r)
            for (int j = 0; j < NR; ++j)
              tile[r * NR + j] = (r < mr && j < nr && !fresh) ? C[(i0 + r) * ldc + j0 + j] : T(0);
          const T* panel = ap + (i0 - i_begin) * kc;
          if (simd)
            tile_avx2(kc, panel, bp, tile);
          else
            tile_portable<T>(kc, panel, bp, tile);
          for (int64_t r = 0; r < mr; ++r) std::memcpy(C + (i0 + r) * ldc + j0, tile + r * NR, nr * sizeof(T));
        }
      }
    }
  }
}

template <typename T>
void forward_t(T* y, int64_t ldy, const T* x, int64_t ldx, const T* w, int64_t m, int64_t k, int64_t n,
               bool accumulate) {
  check_dims(m, k, n);
  check_ld(ldy, n, "y");
  check_ld(ldx, k, "x");
  // y[m, n] = x[m, k] W^T: A = x, B(p, j) = W[j, p]
  gemm<T>(y, ldy, View<T>{x, ldx, 1}, View<T>{w, 1, k}, m, k, n, accumulate);
}

template <typename T>
void backward_input_t(T* dx, int64_t lddx, const T* dy, int64_t lddy, const T* w, int64_t m, int64_t k, int64_t n) {
  check_dims(m, k, n);
  check_ld(lddx, k, "dx");
  check_ld(lddy, n, "dy");
  // dx[m, k] = dy[m, n] W[n, k]: A = dy, B = W
  gemm<T>(dx, lddx, View<T>{dy, lddy, 1}, View<T>{w, k, 1}, m, n, k, false);
}

template <typename T>
void backward_weight_t(T* dw, const T* dy, int64_t lddy, const T* x, int64_t ldx, int64_t m, int64_t k, int64_t n,
                       bool accumulate) {
  check_dims(m, k, n);
  check_ld(lddy, n, "dy");
  check_ld(ldx, k, "x");
  // dW[n, k] = dy[m, n]^T x[m, k]: A(i, p) = dy[p, i], B = x; accumulate adds onto the earlier micro-batches
  gemm<T>(dw, k, View<T>{dy, 1, lddy}, View<T>{x, ldx, 1}, n, m, k, accumulate);
}

}  // namespace

namespace detail {
GemmPath gemm_path() { return current_path(); }
void set_gemm_path(GemmPath p) {
  if (p == GemmPath::avx2_fma) {
    __builtin_cpu_init();
    LOOM_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
               "cpu gemm: the avx2_fma path needs a processor with AVX2 and FMA");
  }
  g_path.store(static_cast<int>(p), std::memory_order_relaxed);
}
}  // namespace detail

void linear_forward(float* y, int64_t ldy, const float* x, int64_t ldx, const float* w, int64_t m, int64_t k,
                    int64_t n, bool accumulate) {
  forward_t(y, ldy, x, ldx, w, m, k, n, accumulate);
}
void linear_forward(double* y, int64_t ldy, const double* x, int64_t ldx, const double* w, int64_t m, int64_t k,
                    int64_t n, bool accumulate) {
  forward_t(y, ldy, x, ldx, w, m, k, n, accumulate);
}
void linear_backward_input(float* dx, int64_t lddx, const float* dy, int64_t lddy, const float* w, int64_t m,
                           int64_t k, int64_t n) {
  backward_input_t(dx, lddx, dy, lddy, w, m, k, n);
}
void linear_backward_input(double* dx, int64_t lddx, const double* dy, int64_t lddy, const double* w, int64_t m,
                           int64_t k, int64_t n) {
  backward_input_t(dx, lddx, dy, lddy, w, m, k, n);
}
void linear_backward_weight(float* dw, const float* dy, int64_t lddy, const float* x, int64_t ldx, int64_t m,
                            int64_t k, int64_t n, bool accumulate) {
  backward_weight_t(dw, dy, lddy, x, ldx, m, k, n, accumulate);
}
void linear_backward_weight(double* dw, const double* dy, int64_t lddy, const double* x, int64_t ldx, int64_t m,
                            int64_t k, int64_t n, bool accumulate) {
  backward_weight_t(dw, dy, lddy, x, ldx, m, k, n, accumulate);
}

}  // namespace loom::cpu
