// The fp8_block recipe on CUDA (DeepSeek-V3's fine-grained FP8 scaling):
//   - the three block casts bitwise against the host reference casts
//     (loom/fp8_block.hpp) at real shapes, with a zero tile, an inf tile and
//     an outlier;
//   - the block-scaled cuBLASLt GEMMs (fprop, dgrad, wgrad shapes and scale
//     modes) against fp64 products of the dequantised operands; on failure the
//     error under the other scale layouts is printed, so that a transposed
//     layout shows as such;
//   - one linear through the GPU path against the CPU recipe;
//   - a short training run on CUDA against the CPU emulation, and a stop and
//     resume on CUDA, bitwise.
// GPU cases skip without a device.
#include <gtest/gtest.h>

#ifdef LOOM_HAVE_CUDA
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "config/run_config.hpp"
#include "gpu_fp8_linear_pair.hpp"
#include "gpu_test_util.hpp"
#include "loom/ops/gemm.hpp"
#include "loom/ops/fp8_block_cast.hpp"
#include "loom/comm.hpp"
#include "loom/config.hpp"
#include "loom/fp8.hpp"
#include "loom/fp8_block.hpp"
#include "loom/gemm_algo.hpp"
#include "loom/precision.hpp"
#include "loom/registry.hpp"
#include "session_runs.hpp"
#include "train/session_probe.hpp"
#include "test_util.hpp"

// The block-scaled product through the one plan cache (loom/ops/gemm.hpp),
// with the scale modes of loom/fp8_block.hpp.
struct BlockOp {
  const loom::Tensor* t;
  const float* s;
  loom::fp8::block::ScaleMode m;
};
inline void block_gemm(loom::ops::GemmPlans& g, const BlockOp& a, const BlockOp& b, loom::Tensor& d,
                       const loom::Tensor* c, cudaStream_t stream, bool varying = false) {
  auto mode = [](loom::fp8::block::ScaleMode m) {
    return m == loom::fp8::block::ScaleMode::tile_1x128 ? loom::ops::GemmScale::tile_1x128
                                                        : loom::ops::GemmScale::block_128x128;
  };
  loom::ops::scaled_gemm(g, {a.t, a.s, mode(a.m)}, {b.t, b.s, mode(b.m)}, d, c, stream,
                         varying ? loom::ops::GemmVarying::m : loom::ops::GemmVarying::none, varying ? d.shape[0] : 0);
}

namespace fs = std::filesystem;
using loom::Device;
using loom::DType;
using loom::Tensor;
namespace fp8 = loom::fp8;
namespace blk = loom::fp8::block;
using loom_test::DevBuf;
using loom_test::download;
using loom::hf::bf16_to_f32;
using loom::hf::f32_to_bf16;
using loom_test::worst_ratio;

namespace {

// bf16 data ~ N(0, 1) times a magnitude per row and per 128-column block
// (10^[-2, 2]), so that tiles and blocks have distinct scales and a scale
// taken from the wrong tile shows.
void tiled_data(int64_t rows, int64_t cols, uint32_t seed, std::vector<uint16_t>& b, std::vector<float>& f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(-2.f, 2.f);
  std::vector<float> rmag(static_cast<size_t>(rows)), cmag(static_cast<size_t>(cols / 128));
  for (auto& m : rmag) m = std::pow(10.f, ud(g));
  for (auto& m : cmag) m = std::pow(10.f, ud(g));
  b.resize(static_cast<size_t>(rows * cols));
  f.resize(b.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = static_cast<size_t>(r * cols + c);
      b[i] = f32_to_bf16(nd(g) * rmag[static_cast<size_t>(r)] * cmag[static_cast<size_t>(c / 128)]);
      f[i] = bf16_to_f32(b[i]);
    }
}

// Compares two code arrays and two scale arrays; prints the first mismatches.
::testing::AssertionResult same_bytes(const char* what, const std::vector<uint8_t>& got,
                                      const std::vector<uint8_t>& want, int64_t cols) {
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < want.size(); ++i)
    if (got[i] != want[i]) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << want.size()
                                       << " codes differ; first at [" << first / cols << ", " << first % cols
                                       << "]: device 0x" << std::hex << int(got[static_cast<size_t>(first)])
                                       << ", host 0x" << int(want[static_cast<size_t>(first)]);
}
::testing::AssertionResult same_scales(const char* what, const std::vector<float>& got,
                                       const std::vector<float>& want) {
  int64_t bad = 0, first = -1;
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    uint32_t a, b;
    std::memcpy(&a, &got[i], 4);
    std::memcpy(&b, &want[i], 4);
    if (a != b) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
      worst = std::max(worst, std::fabs(static_cast<double>(got[i]) / want[i] - 1.0));
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << want.size()
                                       << " scale inverses differ (worst relative " << worst << "); first at "
                                       << first << ": device " << got[static_cast<size_t>(first)] << ", host "
                                       << want[static_cast<size_t>(first)];
}


}  // namespace

// Each device cast against the host reference, bitwise: codes and scale
// inverses (padding entries of the 128x128 layouts excluded: they are never
// written). [2048, 4096] (llama2-7b x of a micro-batch) and [4096, 11008]
// (its gate/up weight, 11008 / 128 = 86 k blocks: padded to 88), each with a
// zero tile, one inf (a non-finite tile, counted) and an outlier.
TEST(GpuFp8Block, CastsMatchTheHostReferenceBitwise) {
  LOOM_REQUIRE_GPU();
  for (auto [R, C] : {std::pair<int64_t, int64_t>{2048, 4096}, {4096, 11008}}) {
    SCOPED_TRACE(testing::Message() << "x [" << R << ", " << C << "] bf16");
    std::vector<uint16_t> xb;
    std::vector<float> xf;
    tiled_data(R, C, static_cast<uint32_t>(R + C), xb, xf);
    for (int64_t c = 0; c < 128; ++c) xb[static_cast<size_t>(3 * C + c)] = 0;  // a zero tile (row 3, k block 0)
    xb[static_cast<size_t>(5 * C + 300)] = 0x7F80;                             // +inf in row 5
    xb[static_cast<size_t>(7 * C + 1000)] = f32_to_bf16(3.0e30f);                  // an outlier
    for (size_t i = 0; i < xb.size(); ++i) xf[i] = bf16_to_f32(xb[i]);
    const size_t n = xb.size();
    DevBuf dx(n * 2), dq(n), dqt(n), ds(static_cast<size_t>(R * C / 128) * 4 + 256),
        dst(static_cast<size_t>(R * C / 128) * 4 + 256), dcount(256);
    ASSERT_NE(dst.p, nullptr);
    CUDA_OK(cudaMemcpy(dx.p, xb.data(), n * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(dcount.p, 0, 4));
    Tensor tx(dx.p, DType::bf16, Device::cuda, {R, C});
    Tensor q(dq.p, DType::e4m3, Device::cuda, {R, C}), qt(dqt.p, DType::e4m3, Device::cuda, {C, R});
    auto* count = static_cast<uint32_t*>(dcount.p);
    // Rows.
    {
      const auto ns = static_cast<size_t>(blk::scale_floats(blk::ScaleMode::tile_1x128, R, C));
      std::vector<uint8_t> hq(n);
      std::vector<float> hs(ns);
      const int64_t nf = blk::cast_row_tiles(xf.data(), R, C, C, hq.data(), hs.data());
      loom::gpu::fp8_block_cast_rows(tx, q, static_cast<float*>(ds.p), count, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_TRUE(same_bytes("rows: q", download<uint8_t>(dq.p, n), hq, C));
      EXPECT_TRUE(same_scales("rows: scale_inv", download<float>(ds.p, ns), hs));
      EXPECT_EQ(download<uint32_t>(dcount.p, 1)[0], static_cast<uint32_t>(nf));
      EXPECT_EQ(nf, 1);
    }
    // Columns (xᵀ in 1x128 tiles along the rows of x).
    {
      const auto ns = static_cast<size_t>(blk::scale_floats(blk::ScaleMode::tile_1x128, C, R));
      std::vector<uint8_t> hq(n);
      std::vector<float> hs(ns);
      const int64_t nf = blk::cast_col_tiles(xf.data(), R, C, C, hq.data(), hs.data());
      CUDA_OK(cudaMemset(dcount.p, 0, 4));
      loom::gpu::fp8_block_cast_cols(tx, qt, static_cast<float*>(dst.p), count, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_TRUE(same_bytes("cols: q_t", download<uint8_t>(dqt.p, n), hq, R));
      EXPECT_TRUE(same_scales("cols: scale_inv_t", download<float>(dst.p, ns), hs));
      EXPECT_EQ(download<uint32_t>(dcount.p, 1)[0], static_cast<uint32_t>(nf));
    }
    // Rows and columns in one pass (what the recipe calls for x and dy):
    // bitwise both host references, the non-finite tiles of both counted.
    {
      const auto ns = static_cast<size_t>(blk::scale_floats(blk::ScaleMode::tile_1x128, R, C));
      const auto nst = static_cast<size_t>(blk::scale_floats(blk::ScaleMode::tile_1x128, C, R));
      std::vector<uint8_t> hq(n), hqt(n);
      std::vector<float> hs(ns), hst(nst);
      const int64_t nf = blk::cast_row_tiles(xf.data(), R, C, C, hq.data(), hs.data()) +
                         blk::cast_col_tiles(xf.data(), R, C, C, hqt.data(), hst.data());
      CUDA_OK(cudaMemset(dq.p, 0, n));
      CUDA_OK(cudaMemset(dqt.p, 0, n));
      CUDA_OK(cudaMemset(ds.p, 0, ns * 4));
      CUDA_OK(cudaMemset(dst.p, 0, nst * 4));
      CUDA_OK(cudaMemset(dcount.p, 0, 4));
      loom::gpu::fp8_block_cast_rows_cols(tx, q, static_cast<float*>(ds.p), qt, static_cast<float*>(dst.p), count,
                                          nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_TRUE(same_bytes("rows+cols: q", download<uint8_t>(dq.p, n), hq, C));
      EXPECT_TRUE(same_bytes("rows+cols: q_t", download<uint8_t>(dqt.p, n), hqt, R));
      EXPECT_TRUE(same_scales("rows+cols: scale_inv", download<float>(ds.p, ns), hs));
      EXPECT_TRUE(same_scales("rows+cols: scale_inv_t", download<float>(dst.p, nst), hst));
      EXPECT_EQ(download<uint32_t>(dcount.p, 1)[0], static_cast<uint32_t>(nf));
      EXPECT_EQ(nf, 2);  // the inf's row tile and column tile
    }
    // Blocks, both copies.
    {
      const auto ns = static_cast<size_t>(blk::scale_floats(blk::ScaleMode::block_128x128, R, C));
      const auto nst = static_cast<size_t>(blk::scale_floats(blk::ScaleMode::block_128x128, C, R));
      std::vector<uint8_t> hq(n), hqt(n);
      std::vector<float> hs(ns, 0.0f), hst(nst, 0.0f);
      const int64_t nf = blk::cast_blocks(xf.data(), R, C, C, hq.data(), hqt.data(), hs.data(), hst.data());
      CUDA_OK(cudaMemset(ds.p, 0, ns * 4));
      CUDA_OK(cudaMemset(dst.p, 0, nst * 4));
      CUDA_OK(cudaMemset(dcount.p, 0, 4));
      loom::gpu::fp8_block_cast_blocks(tx, &q, &qt, static_cast<float*>(ds.p), static_cast<float*>(dst.p), count,
                                       nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      EXPECT_TRUE(same_bytes("blocks: q", download<uint8_t>(dq.p, n), hq, C));
      EXPECT_TRUE(same_bytes("blocks: q_t", download<uint8_t>(dqt.p, n), hqt, R));
      EXPECT_TRUE(same_scales("blocks: scale_inv", download<float>(ds.p, ns), hs));
      EXPECT_TRUE(same_scales("blocks: scale_inv_t", download<float>(dst.p, nst), hst));
      EXPECT_EQ(download<uint32_t>(dcount.p, 1)[0], static_cast<uint32_t>(nf));
    }
  }
  // Refusals name the values.
  DevBuf d(128 * 100 * 2), dq(128 * 128), ds(4096);
  Tensor bad(d.p, DType::bf16, Device::cuda, {128, 100});
  Tensor q(dq.p, DType::e4m3, Device::cuda, {128, 100});
  try {
    loom::gpu::fp8_block_cast_rows(bad, q, static_cast<float*>(ds.p), nullptr, nullptr);
    ADD_FAILURE() << "a [128, 100] cast was not refused";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiples of 128"), std::string::npos) << e.what();
  }
}

namespace {

// One block-scaled GEMM D[m, n] = A[m, k] B[n, k]^T (fp32 D, optionally + C)
// against fp64 of the dequantised operands. The error of an element comes
// from fp32 accumulation over K (at most ~K * 2^-24 of sum_k |a_k b_k| in the
// worst order, ~sqrt(K) 2^-24 typically), the rounding of each 128-block's
// scale product and partial sum, and Hopper's FP8 tensor cores, which keep
// only ~14 bits while they add the products of one block (DeepSeek-V3
// report, sec. 3.3.2; cuBLASLt promotes to fp32 at every scale block): the
// bound is (4 K 2^-24 + 2^-11) * sum_k |a_k b_k| (+ 2^-22 |C| with C). A scale taken from
// the wrong tile is off by the data's magnitude spread (up to 10^4 here), so
// a wrong layout fails by orders of magnitude, not marginally.
struct GemmCase {
  const char* name;
  int64_t m, n, k;
  blk::ScaleMode ma, mb;
  bool with_c;
};

// The scale of element (r, c) of an operand [rows, k] under a layout variant:
// 0 the chosen one (scale_index); 1 with the two indices of the layout swapped
// (row-major where it is k-block-major and back).
float scale_at(const std::vector<float>& s, blk::ScaleMode m, int64_t r, int64_t c, int64_t rows, int64_t k,
               int variant) {
  const int64_t tr = m == blk::ScaleMode::tile_1x128 ? r : r / 128, kb = c / 128;
  if (variant == 0) return s[static_cast<size_t>(blk::scale_index(m, tr, kb, rows, k))];
  if (m == blk::ScaleMode::tile_1x128) return s[static_cast<size_t>(tr * (k / 128) + kb)];
  return s[static_cast<size_t>(kb * ((rows + 127) / 128) + tr)];
}

std::vector<double> reference(const std::vector<uint8_t>& qa, const std::vector<float>& sa, blk::ScaleMode ma,
                              int va, const std::vector<uint8_t>& qb, const std::vector<float>& sb,
                              blk::ScaleMode mb, int vb, int64_t m, int64_t n, int64_t k, std::vector<double>* abs_sum) {
  std::vector<double> a(static_cast<size_t>(m * k)), b(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < k; ++c)
      a[static_cast<size_t>(r * k + c)] =
          static_cast<double>(fp8::decode(qa[static_cast<size_t>(r * k + c)], fp8::Format::e4m3)) *
          scale_at(sa, ma, r, c, m, k, va);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < k; ++c)
      b[static_cast<size_t>(r * k + c)] =
          static_cast<double>(fp8::decode(qb[static_cast<size_t>(r * k + c)], fp8::Format::e4m3)) *
          scale_at(sb, mb, r, c, n, k, vb);
  std::vector<double> d(static_cast<size_t>(m * n));
  if (abs_sum) abs_sum->assign(d.size(), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, t = 0;
      const double* pa = &a[static_cast<size_t>(i * k)];
      const double* pb = &b[static_cast<size_t>(j * k)];
      for (int64_t l = 0; l < k; ++l) {
        s += pa[l] * pb[l];
        t += std::fabs(pa[l] * pb[l]);
      }
      d[static_cast<size_t>(i * n + j)] = s;
      if (abs_sum) (*abs_sum)[static_cast<size_t>(i * n + j)] = t;
    }
  return d;
}

}  // namespace

// An E4M3 operand [rows, k] cast on the device from tiled_data(seed), in 1x128
// tiles or 128x128 blocks (mode), with its codes and scales read back for the
// fp64 reference.
struct CastOperand {
  DevBuf q, s;
  std::vector<uint8_t> hq;
  std::vector<float> hs;
  CastOperand(int64_t rows, int64_t k, blk::ScaleMode mode, uint32_t seed)
      : q(static_cast<size_t>(rows * k)), s(static_cast<size_t>(rows * k / 128) * 4 + 256) {
    std::vector<uint16_t> b;
    std::vector<float> f;
    tiled_data(rows, k, seed, b, f);
    DevBuf dx(b.size() * 2);
    EXPECT_EQ(cudaMemcpy(dx.p, b.data(), b.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    Tensor tx(dx.p, DType::bf16, Device::cuda, {rows, k}), tq(q.p, DType::e4m3, Device::cuda, {rows, k});
    if (mode == blk::ScaleMode::tile_1x128)
      loom::gpu::fp8_block_cast_rows(tx, tq, static_cast<float*>(s.p), nullptr, nullptr);
    else
      loom::gpu::fp8_block_cast_blocks(tx, &tq, nullptr, static_cast<float*>(s.p), nullptr, nullptr, nullptr);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    hq = download<uint8_t>(q.p, b.size());
    hs = download<float>(s.p, static_cast<size_t>(blk::scale_floats(mode, rows, k)));
  }
  const float* scales() const { return static_cast<const float*>(s.p); }
};

// fprop (x 1x128, W 128x128), dgrad (dy 1x128, Wᵀ 128x128) and wgrad (dyᵀ,
// xᵀ both 1x128, + C) shapes, operands cast on the device from data with
// distinct tile magnitudes.
TEST(GpuFp8Block, BlockScaledGemmsAgainstFp64) {
  LOOM_REQUIRE_GPU();
  using M = blk::ScaleMode;
  const GemmCase cases[] = {
      {"fprop y = x W^T", 512, 1024, 768, M::tile_1x128, M::block_128x128, false},
      {"dgrad dx = dy W", 512, 768, 1024, M::tile_1x128, M::block_128x128, false},
      {"wgrad dW = dy^T x (+ dW)", 1024, 768, 512, M::tile_1x128, M::tile_1x128, true},
      {"128x128 on A (either order)", 768, 512, 1024, M::block_128x128, M::tile_1x128, false},
  };
  cublasLtHandle_t lt = nullptr;
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  DevBuf ws(loom::ops::GemmPlans::kWorkspaceBytes);
  // Both ways of picking the algorithm (loom/gemm_algo.hpp): "fastest" times
  // the candidates on a scratch D, so the accumulated dW (C = D) and D must
  // come out as with the heuristic's answer.
  for (loom::GemmAlgo algo : {loom::GemmAlgo::heuristic, loom::GemmAlgo::fastest}) {
  loom::ops::GemmPlans g(lt, ws.p, loom::ops::GemmPlans::kWorkspaceBytes, algo);
  uint32_t seed = 1;
  for (const GemmCase& c : cases) {
    SCOPED_TRACE(std::string(c.name) + ", gemm_algo " + loom::gemm_algo_name(algo));
    const CastOperand A(c.m, c.k, c.ma, seed++), B(c.n, c.k, c.mb, seed++);
    const size_t nd = static_cast<size_t>(c.m * c.n);
    DevBuf dd(nd * 4);
    std::vector<float> c0(nd, 0.0f);
    std::mt19937 gc(seed++);
    std::normal_distribution<float> ndist(0.f, 1.f);
    if (c.with_c)
      for (auto& v : c0) v = ndist(gc);
    CUDA_OK(cudaMemcpy(dd.p, c0.data(), nd * 4, cudaMemcpyHostToDevice));
    Tensor ta(A.q.p, DType::e4m3, Device::cuda, {c.m, c.k}), tb(B.q.p, DType::e4m3, Device::cuda, {c.n, c.k});
    Tensor td(dd.p, DType::f32, Device::cuda, {c.m, c.n});
    block_gemm(g, {&ta, A.scales(), c.ma}, {&tb, B.scales(), c.mb}, td,
           c.with_c ? &td : nullptr, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> got = download<float>(dd.p, nd);
    std::vector<double> abs_sum;
    std::vector<double> want = reference(A.hq, A.hs, c.ma, 0, B.hq, B.hs, c.mb, 0, c.m, c.n, c.k, &abs_sum);
    for (size_t i = 0; i < nd; ++i) want[i] += c0[i];
    const double eps_k = 4.0 * static_cast<double>(c.k) * std::ldexp(1.0, -24) + std::ldexp(1.0, -11);
    double worst = 0, max_err = 0, max_ref = 0;
    for (size_t i = 0; i < nd; ++i) {
      const double e = std::fabs(got[i] - want[i]);
      const double bound = eps_k * abs_sum[i] + (c.with_c ? std::ldexp(std::fabs(c0[i]), -22) : 0.0) + 1e-30;
      worst = std::max(worst, e / bound);
      max_err = std::max(max_err, e);
      max_ref = std::max(max_ref, std::fabs(want[i]));
    }
    std::printf("[fp8 gemm block] %s (%s) m=%lld n=%lld k=%lld: max error %.3g (max |ref| %.3g), worst %.3f of the bound\n",
                c.name, loom::gemm_algo_name(algo), static_cast<long long>(c.m), static_cast<long long>(c.n), static_cast<long long>(c.k), max_err,
                max_ref, worst);
    EXPECT_LE(worst, 1.0) << "max error " << max_err << " of max |ref| " << max_ref;
    if (worst > 1.0) {
      // Which scale layout does the GPU result follow? Relative error against
      // the reference under each (A variant, B variant); 0 = scale_index, 1 =
      // its two indices swapped.
      for (int va = 0; va < 2; ++va)
        for (int vb = 0; vb < 2; ++vb) {
          std::vector<double> alt = reference(A.hq, A.hs, c.ma, va, B.hq, B.hs, c.mb, vb, c.m, c.n, c.k, nullptr);
          double e = 0, mr = 0;
          for (size_t i = 0; i < nd; ++i) {
            e = std::max(e, std::fabs(got[i] - (alt[i] + c0[i])));
            mr = std::max(mr, std::fabs(alt[i] + c0[i]));
          }
          std::printf("[fp8 gemm block] %s: layout A %s, B %s: max relative error %.3g%s\n", c.name,
                      va ? "swapped" : "chosen", vb ? "swapped" : "chosen", e / mr,
                      e / mr < 1e-4 ? "  <-- the GPU follows this layout: flip scale_index in loom/fp8_block.hpp" : "");
        }
    }
  }
  }
  // 128x128 on both operands is refused before cuBLASLt sees it.
  loom::ops::GemmPlans g(lt, ws.p, loom::ops::GemmPlans::kWorkspaceBytes);
  DevBuf q(128 * 128), s(4096), d(128 * 128 * 4);
  Tensor tq(q.p, DType::e4m3, Device::cuda, {128, 128}), td(d.p, DType::f32, Device::cuda, {128, 128});
  try {
    block_gemm(g, {&tq, static_cast<const float*>(s.p), M::block_128x128}, {&tq, static_cast<const float*>(s.p), M::block_128x128},
           td, nullptr, nullptr);
    ADD_FAILURE() << "128x128 x 128x128 was not refused";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("128x128"), std::string::npos) << e.what();
  }
  cublasLtDestroy(lt);
}

// A variable-row linear's calls (an MoE expert's, varying = true) build
// their plans from the heuristic alone even under GemmAlgo::fastest: a timing
// would run mid-training at every new row count. Each new shape builds one
// plan, a repeat none; the same problem outside a varying call is timed, and
// both give D within the fp64 bound of BlockScaledGemmsAgainstFp64.
TEST(GpuFp8Block, VaryingCallsArePlannedWithoutTiming) {
  LOOM_REQUIRE_GPU();
  using M = blk::ScaleMode;
  cublasLtHandle_t lt = nullptr;
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  DevBuf ws(loom::ops::GemmPlans::kWorkspaceBytes);
  loom::ops::GemmPlans g(lt, ws.p, loom::ops::GemmPlans::kWorkspaceBytes, loom::GemmAlgo::fastest);
  const int64_t n = 256, k = 384;
  uint32_t seed = 40;
  const CastOperand w(n, k, M::block_128x128, seed++);
  Tensor tw(w.q.p, DType::e4m3, Device::cuda, {n, k});
  auto run = [&](const CastOperand& x, int64_t m, bool varying) {
    Tensor tx(x.q.p, DType::e4m3, Device::cuda, {m, k});
    DevBuf dd(static_cast<size_t>(m * n) * 4);
    Tensor td(dd.p, DType::f32, Device::cuda, {m, n});
    block_gemm(g, {&tx, x.scales(), M::tile_1x128}, {&tw, w.scales(), M::block_128x128}, td, nullptr, nullptr, varying);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> got = download<float>(dd.p, static_cast<size_t>(m * n));
    std::vector<double> abs_sum;
    const std::vector<double> want = reference(x.hq, x.hs, M::tile_1x128, 0, w.hq, w.hs, M::block_128x128, 0, m, n, k, &abs_sum);
    const double eps_k = 4.0 * static_cast<double>(k) * std::ldexp(1.0, -24) + std::ldexp(1.0, -11);
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]) / (eps_k * abs_sum[i] + 1e-30));
    EXPECT_LE(worst, 1.0) << "m=" << m << (varying ? " varying" : "");
  };
  const CastOperand x256(256, k, M::tile_1x128, seed++), x384(384, k, M::tile_1x128, seed++);
  run(x256, 256, true);
  EXPECT_EQ(g.plans_built(), 1);
  run(x256, 256, true);
  run(x384, 384, true);
  EXPECT_EQ(g.plans_built(), 2);
  EXPECT_EQ(g.plans_timed(), 0) << "a varying call was timed";
  run(x256, 256, false);
  EXPECT_EQ(g.plans_built(), 3);
  EXPECT_EQ(g.plans_timed(), 1);
  cublasLtDestroy(lt);
}

namespace {

loom::PluginRegistry& registry() {
  static auto* reg = new loom::PluginRegistry({fs::path(LOOM_TEST_PLUGIN_DIR)});
  return *reg;
}

std::unique_ptr<loom::Precision> make(const std::string& body, Device device) {
  loom::PluginInit init;
  init.config = loom::parse_config_table("[precision]\n" + body, "fp8_block.toml").table("precision");
  init.config.mark_used("plugin");
  init.device = device;
  return registry().create_as<loom::PluginKind::precision>("fp8_block", init);
}

}  // namespace

// One FP8 linear through the GPU path and the CPU recipe
// (gpu_fp8_linear_pair.hpp: y, dx and dW within the stated bounds, every dim
// a multiple of 128); the counters equal after every end_step.
TEST(GpuFp8Block, OneLinearMatchesTheCpuRecipe) {
  LOOM_REQUIRE_GPU();
  auto cpu = make("", Device::cpu);
  auto gpu = make("", Device::cuda);
  auto counters = [](loom::Precision& p) {
    std::vector<double> v;
    for (const loom::StateTensor& t : p.state_tensors())
      for (int64_t i = 0; i < t.tensor.numel(); ++i) v.push_back(t.tensor.ptr<double>()[i]);
    return v;
  };
  loom_test::check_linear_pair(
      *cpu, *gpu, 256, 384, 256, "fp8 gpu block linear",
      [&](int step) { EXPECT_EQ(counters(*gpu), counters(*cpu)) << "counters after step " << step; },
      [&] { EXPECT_NE(gpu->log_summary().find("non-finite tiles 0"), std::string::npos) << gpu->log_summary(); });
}

// The row multiple the MoE block pads each expert's rows to on a device
// (Precision::variable_row_multiple): a 1x128 tile per row on CUDA, 1 on the
// CPU (no GPU needed).
TEST(GpuFp8Block, VariableRowMultipleIsOneTileRow) {
  EXPECT_EQ(make("", Device::cuda)->variable_row_multiple(), 128);
  EXPECT_EQ(make("", Device::cpu)->variable_row_multiple(), 1);
}

// An MoE expert's row count is rarely a multiple of 128: its calls run the
// largest multiple of 128 of their rows in FP8 and the rest in bf16
// (check_variable_row_split: the FP8 rows bitwise a call with those rows
// alone, the tail the bf16 product, dW their sum, the counters unchanged).
// Two calls: 293 rows writing dW, 228 adding.
TEST(GpuFp8Block, VariableRowCallsRunTheirAlignedRowsInFp8) {
  LOOM_REQUIRE_GPU();
  auto split = make("", Device::cuda), whole = make("", Device::cuda);
  auto counters = [](loom::Precision& p) {
    std::vector<double> v;
    for (const loom::StateTensor& t : p.state_tensors())
      for (int64_t i = 0; i < t.tensor.numel(); ++i) v.push_back(t.tensor.ptr<double>()[i]);
    return v;
  };
  loom_test::check_variable_row_split(*split, *whole, 128, 256, 512, {{256, 37}, {128, 100}},
                                      "fp8 block variable rows",
                                      [&] { EXPECT_EQ(counters(*split), counters(*whole)); });
}

namespace {

fs::path temp_dir(const std::string& name) { return loom::test::temp_dir("gpu_fp8_block_" + name); }

// Every dim a multiple of 128 (hidden 128 = 4 heads of 32 with 4 kv heads, ffn
// 256), 4 x 32 = 128 tokens per micro-batch.
std::string block_config(const fs::path& out, const std::string& device, const std::string& precision,
                         const std::string& attention, int steps) {
  std::ostringstream c;
  c << "[run]\ndevice = \"" << device << "\"\nseed = 5\ndeterministic = true\nthreads = 2\nout_dir = \""
    << out.string() << "\"\nlog_level = \"warn\"\nplugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nhidden = 128\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 4\nffn_hidden = 256\n"
    << "vocab_size = 96\nmax_seq_len = 64\n"
    << "[train]\nsteps = " << steps << "\nmicro_batch = 4\nseq_len = 32\ngrad_accum = 2\nlr = 3e-3\nmin_lr = 3e-4\n"
    << "warmup_steps = 2\nvalidation_every = 3\nvalidation_batches = 2\nlog_every = 5\n"
    << "[checkpoint]\nevery = 0\nresume = \"none\"\n"
    << "[precision]\n" << precision << "\n[attention]\nplugin = \"" << attention
    << "\"\n[sharding]\nplugin = \"none\"\n[data]\nplugin = \"synthetic\"\npattern = \"ramp\"\n";
  return c.str();
}

loom::Config parse(const std::string& text, const std::vector<std::string>& ov = {}) {
  return loom::parse_config_string(text, "fp8_block_gpu.toml", ov);
}

}  // namespace

// 30 steps of the recipe on CUDA against the same 30 steps emulated on the
// CPU (same seed, data and initial weights; the GPU keeps bf16 activations,
// the CPU fp32, and the attention differs: cuDNN against naive) and against
// bf16 on CUDA: every step within 6% of the CPU emulation's loss plus 0.05
// and the mean of the last 10 within 3% plus 0.02 (the FP8 CPU recipes hold
// 2% of fp32 over 300 steps; bf16 activations add ~2^-9 per op; the ramp is
// learned down to losses near 0.1, where a relative bound alone would
// magnify noise, hence the absolute floor), losses finite and falling.
TEST(GpuFp8Block, TrainingFollowsTheCpuEmulation) {
  LOOM_REQUIRE_GPU();
  fs::path d = temp_dir("curve");
  auto run = [&](const std::string& device, const std::string& plugin) {
    loom::Session s(parse(block_config(d / (device + "_" + plugin), device, "plugin = \"" + plugin + "\"",
                                       device == "cuda" ? "cudnn" : "naive", 30)));
    return s.train();
  };
  const loom::RunSummary cpu = run("cpu", "fp8_block");
  const loom::RunSummary gpu = run("cuda", "fp8_block");
  const loom::RunSummary bf16 = run("cuda", "bf16");
  ASSERT_EQ(cpu.steps.size(), 30u);
  ASSERT_EQ(gpu.steps.size(), 30u);
  double worst = 0, tail = 0, tail_cpu = 0, tail_bf16 = 0;
  for (size_t i = 0; i < 30; ++i) {
    const double a = gpu.steps[i].loss, b = cpu.steps[i].loss;
    ASSERT_TRUE(std::isfinite(a)) << "step " << i + 1;
    const double e = std::fabs(a - b) / b;
    EXPECT_LT(std::fabs(a - b), 0.06 * b + 0.05) << "step " << i + 1 << ": cuda " << a << " vs cpu emulation " << b;
    worst = std::max(worst, e);
    if (i >= 20) {
      tail += a / 10;
      tail_cpu += b / 10;
      tail_bf16 += bf16.steps[i].loss / 10;
    }
  }
  EXPECT_LT(std::fabs(tail - tail_cpu), 0.03 * tail_cpu + 0.02) << "last 10 mean: cuda " << tail << ", cpu " << tail_cpu;
  EXPECT_LT(gpu.steps.back().loss, gpu.steps.front().loss);
  std::printf("[fp8 gpu curve] fp8_block 30 steps: cuda %.4f -> %.4f, cpu emulation %.4f -> %.4f, bf16 %.4f -> %.4f; "
              "worst step vs cpu %.2f%%, last 10 mean cuda %.4f cpu %.4f bf16 %.4f\n",
              gpu.steps.front().loss, gpu.steps.back().loss, cpu.steps.front().loss, cpu.steps.back().loss,
              bf16.steps.front().loss, bf16.steps.back().loss, 100 * worst, tail, tail_cpu, tail_bf16);
}

// Save at step 6 and resume on CUDA (deterministic mode): the same losses,
// bitwise, as one run of 10 steps, and the same counters.
TEST(GpuFp8Block, StopAndResumeOnCudaIsBitwiseExact) {
  LOOM_REQUIRE_GPU();
  fs::path d = temp_dir("resume");
  const std::string prec = "plugin = \"fp8_block\"";
  auto counters = [](loom::Session& s) {
    for (const loom::StateTensor& t : loom::probe(s).precision().state_tensors())
      if (t.name == "fp8_block.counters") return std::vector<double>(t.tensor.ptr<double>(), t.tensor.ptr<double>() + 2);
    return std::vector<double>{};
  };
  loom::RunSummary full, first, second;
  std::vector<double> cf, cr;
  {
    loom::Session s(parse(block_config(d / "full", "cuda", prec, "cudnn", 10)));
    full = s.train();
    cf = counters(s);
  }
  const std::vector<std::string> ov = {"checkpoint.every=3", "checkpoint.resume=auto"};
  {
    loom::Session s(parse(block_config(d / "split", "cuda", prec, "cudnn", 10), ov));
    first = s.train(6);
  }
  {
    loom::Session s(parse(block_config(d / "split", "cuda", prec, "cudnn", 10), ov));
    second = s.train();
    cr = counters(s);
  }
  ASSERT_EQ(full.steps.size(), 10u);
  ASSERT_EQ(second.steps.size(), 4u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(first.steps[i].loss, full.steps[i].loss) << "step " << i + 1;
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(second.steps[i].loss, full.steps[6 + i].loss) << "step " << 7 + i;
  EXPECT_EQ(cr, cf);
}

// weight_cache = "layer" casts W (q and its 128x128 block scales) before
// every fprop and Wᵀ before every dgrad into one scratch; "step" casts both
// once per step: every block's scale comes from W itself, so the FP8 bits,
// the losses (training and validation) and the counters are bitwise equal
// (deterministic mode). The llama-125m model (hidden 768, 12 layers, 12/12
// heads, ffn 2048: every linear dim a multiple of 128) at 4 x 512 tokens,
// both layer variants, one and two micro-batches per step (two: "layer"
// recasts per micro-batch). Both runs let the blocks drop the FP8 linears'
// inputs (keeps_wgrad_input).
TEST(GpuFp8Block, WeightCacheStepAndLayerAreBitwiseEqual) {
  LOOM_REQUIRE_GPU();
  for (const std::string layers : {"native", "fused"})
    for (const std::string accum : {"1", "2"}) {
      SCOPED_TRACE(layers + " grad_accum " + accum);
      std::map<std::string, loom::RunSummary> runs;
      std::map<std::string, std::map<std::string, std::vector<char>>> states;
      for (const std::string mode : {"step", "layer"}) {
        const fs::path out = temp_dir("wcache_" + layers + accum + mode);
        const std::vector<std::string> ov = {
            "run.out_dir=\"" + out.string() + "\"", "run.plugin_path=[\"" + std::string(LOOM_TEST_PLUGIN_DIR) + "\"]",
            "run.deterministic=true", "run.log_level=\"warn\"", "precision.plugin=\"fp8_block\"",
            "precision.weight_cache=\"" + mode + "\"", "model.layers=\"" + layers + "\"", "train.micro_batch=4",
            "train.seq_len=512", "train.grad_accum=" + accum, "train.steps=4", "train.log_every=2",
            "train.validation_every=2", "train.validation_batches=1", "checkpoint.every=0",
            "checkpoint.resume=\"none\""};
        loom::Session s(loom::load_config(fs::path(LOOM_SOURCE_DIR) / "configs" / "bench" / "llama-125m.toml", ov));
        runs[mode] = s.train();
        states[mode] = loom::test::state_bytes(s);
      }
      const loom::RunSummary &a = runs["step"], &b = runs["layer"];
      loom::test::expect_same_losses(a, b, 4);
      EXPECT_EQ(states["step"], states["layer"]) << "counters";
      std::printf("[fp8_block weight_cache] %s grad_accum %s: step %.6f -> %.6f, layer %.6f -> %.6f\n", layers.c_str(),
                  accum.c_str(), a.steps.front().loss, a.steps.back().loss, b.steps.front().loss,
                  b.steps.back().loss);
    }
}

// `loom bench` (its "mem GiB" column: cudaMemGetInfo's total - free after
// the timed steps, in its own process) on fp8_block and the bf16
// counterparts: fp8_block (grad_accum 1, so weight_cache "auto" is "layer",
// and the blocks drop the FP8 linears' inputs) must use no more device
// memory. llama-1b (8 x 2048, llama-1b-fp8-block.toml vs llama-1b.toml) and
// llama2-7b (8 x 256, llama2-7b-fp8.toml with precision.plugin = "fp8_block",
// master = "bf16", vs llama2-7b.toml's bf16_pure; needs ~60 GiB, skipped on
// a smaller GPU).
TEST(GpuFp8Block, BenchUsesNoMoreDeviceMemoryThanBf16) {
  LOOM_REQUIRE_GPU();
  size_t free_b = 0, total_b = 0;
  const cudaError_t e = cudaMemGetInfo(&free_b, &total_b);
  ASSERT_EQ(e, cudaSuccess) << "cudaMemGetInfo: " << cudaGetErrorString(e);
  const fs::path d = temp_dir("bench_mem");
  auto bench = [&](const std::string& config, const std::string& name, const std::string& extra) {
    return loom::test::bench_json(d, config, name, extra);
  };
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const std::string block = " --set precision.plugin=\\\"fp8_block\\\"";
  for (const auto& [fp8, bf16, extra, need_gib] : std::vector<std::tuple<std::string, std::string, std::string, double>>{
           {"llama-1b-fp8-block", "llama-1b", "", 48}, {"llama2-7b-fp8", "llama2-7b", block, 76}}) {
    SCOPED_TRACE(fp8);
    if (static_cast<double>(total_b) / gib < need_gib) {
      std::printf("[fp8_block memory] %s skipped: %.1f GiB GPU, needs %.0f\n", fp8.c_str(), total_b / gib, need_gib);
      continue;
    }
    // Fused layers on both sides, as the benchmark tables report them. With
    // native layers fp8_block measured 0.12 GiB (0.3%) above bf16 on llama-1b
    // (docs/PERFORMANCE-LOG.md, 2026-11-25): the fp32 scale of every 1x128
    // tile of the saved xᵀ (1/32 of its FP8 bytes) is what it keeps beyond the
    // per-tensor recipes.
    const std::string fused = " --set model.layers=\\\"fused\\\"";
    const nlohmann::json a = bench(fp8, fp8 + "-block", extra + fused), b = bench(bf16, bf16, fused);
    if (a.is_null() || b.is_null()) continue;
    const double m8 = a.at("device_mem_gib").get<double>(), m16 = b.at("device_mem_gib").get<double>();
    const double r8 = a.at("arena_gib").get<double>(), r16 = b.at("arena_gib").get<double>();
    std::printf("[fp8_block memory] %s (fp8_block): device in use %.2f GiB (arena %.2f) vs %s %.2f GiB (arena %.2f)\n",
                fp8.c_str(), m8, r8, bf16.c_str(), m16, r16);
    EXPECT_LE(m8, m16) << fp8 << " with fp8_block uses more device memory than " << bf16;
  }
}

#else
TEST(GpuFp8Block, SkippedWithoutCuda) { GTEST_SKIP() << "loom built without CUDA"; }
#endif
