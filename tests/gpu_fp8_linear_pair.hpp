// What the FP8 GPU suites share (test_gpu_fp8_recipes, test_gpu_fp8_block),
// beside cuda_test_util.hpp's device buffer and downloads: the error-to-bound
// ratio, and the one-linear check of a GPU recipe against its CPU emulation.
// CUDA builds only.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test_util.hpp"
#include "hf/safetensors.hpp"
#include "loom/comm.hpp"
#include "loom/precision.hpp"

namespace loom_test {

// |gpu - cpu| <= rel * |cpu| + abs_frac * max |cpu|, element by element;
// returns the worst ratio of error to bound (<= 1 passes) and, when max_err
// is given, the largest absolute error.
inline double worst_ratio(const std::vector<float>& gpu, const std::vector<float>& cpu, double rel, double abs_frac,
                          double* max_err = nullptr) {
  double m = 0;
  for (float c : cpu) m = std::max(m, static_cast<double>(std::fabs(c)));
  double worst = 0, err = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double e = std::fabs(static_cast<double>(gpu[i]) - cpu[i]);
    err = std::max(err, e);
    worst = std::max(worst, e / (rel * std::fabs(cpu[i]) + abs_frac * m));
  }
  if (max_err) *max_err = err;
  return worst;
}

// A cuBLASLt handle and a stream of their own, and the ExecContext a GPU
// recipe is called with; released at the end of the scope.
struct GpuCallContext {
  cublasLtHandle_t lt = nullptr;
  cudaStream_t stream = nullptr;
  loom::ExecContext ctx;
  GpuCallContext() {
    EXPECT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
    ctx.device = loom::Device::cuda;
    ctx.stream = stream;
    ctx.blas_handle = lt;
  }
  ~GpuCallContext() {
    if (stream) cudaStreamDestroy(stream);
    if (lt) cublasLtDestroy(lt);
  }
  GpuCallContext(const GpuCallContext&) = delete;
  GpuCallContext& operator=(const GpuCallContext&) = delete;
};

// n random bf16 values (nd's draws times sc): their bits, and their values as T.
template <typename T>
void random_bf16(std::mt19937& g, std::normal_distribution<float>& nd, size_t n, float sc, std::vector<uint16_t>& bits,
                 std::vector<T>& values) {
  bits.resize(n);
  values.resize(n);
  for (size_t i = 0; i < n; ++i) {
    bits[i] = loom::hf::f32_to_bf16(nd(g) * sc);
    values[i] = static_cast<T>(loom::hf::bf16_to_f32(bits[i]));
  }
}

// A GPU recipe's workspace and saved activations for its linear `id`, on the
// device and handed to it (set_workspace, set_saved_activations) when both
// allocations succeeded (ok()); they live as long as this object.
struct RecipeDeviceMemory {
  DevBuf ws, saved;
  RecipeDeviceMemory(loom::Precision& p, int id) : RecipeDeviceMemory(p, std::vector<int>{id}) {}
  // Every linear of `ids` (the sum of their saved activations).
  RecipeDeviceMemory(loom::Precision& p, const std::vector<int>& ids)
      : ws(p.workspace_bytes()), saved(saved_bytes(p, ids)) {
    if (!ok()) return;
    p.set_workspace(ws.p, p.workspace_bytes());
    p.set_saved_activations(saved.p, saved_bytes(p, ids));
  }
  static size_t saved_bytes(const loom::Precision& p, const std::vector<int>& ids) {
    size_t n = 0;
    for (int id : ids) n += p.saved_activation_bytes(id);
    return n;
  }
  bool ok() const { return ws.p != nullptr && saved.p != nullptr; }
};

// One FP8 linear [rows, in] x [out, in]^T through a CPU recipe (emulated
// FP8) and a GPU recipe of the same kind, for three optimizer steps of two
// micro-batches, with a residual on the forward. Inputs are random bf16
// values, given to the CPU recipe as fp32: both paths cast them to the same
// codes and scales, so y, dx and dW differ only by cuBLASLt's fp32
// accumulation order and the bf16 rounding of y and dx (2^-9 relative): y and
// dx within 1% of |cpu| + 0.5% of max |cpu|, dW (fp32 on both) within 0.5% +
// 0.2%. After each step's end_step (both synchronised) `after_step(step)`
// compares the recipes' state; `at_end()` runs before the stream is
// destroyed (a GPU recipe's log_summary reads on the stream it last ran on).
inline void check_linear_pair(loom::Precision& cpu, loom::Precision& gpu, int64_t in, int64_t out, int64_t rows,
                              const char* label, const std::function<void(int)>& after_step,
                              const std::function<void()>& at_end) {
  const loom::LinearDesc desc{"layer.0.q_proj", in, out, rows, loom::LinearRole::hidden};
  const int cid = cpu.register_linear(desc), gid = gpu.register_linear(desc);
  auto self = loom::make_self_communicator();
  loom::PrecisionSetup s;
  s.data_parallel = self.get();
  cpu.setup(s);
  s.device = loom::Device::cuda;
  gpu.setup(s);
  std::vector<float> cws(cpu.workspace_bytes() / 4 + 1), csaved(cpu.saved_activation_bytes(cid) / 4 + 1);
  cpu.set_workspace(cws.data(), cpu.workspace_bytes());
  cpu.set_saved_activations(csaved.data(), cpu.saved_activation_bytes(cid));
  const RecipeDeviceMemory gmem(gpu, gid);
  ASSERT_NE(gmem.ws.p, nullptr);
  ASSERT_NE(gmem.saved.p, nullptr);
  GpuCallContext call;
  ASSERT_TRUE(call.lt && call.stream);
  cudaStream_t stream = call.stream;
  const loom::ExecContext& gctx = call.ctx;
  const loom::ExecContext cctx;
  using loom::Device;
  using loom::DType;
  using loom::Tensor;

  std::mt19937 g(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto bf16_data = [&](size_t n, float sc, std::vector<uint16_t>& b, std::vector<float>& f) {
    random_bf16(g, nd, n, sc, b, f);
  };
  const size_t nx = rows * in, nw = out * in, ny = rows * out;
  DevBuf dx_(nx * 2), dw_(nw * 2), ddy(ny * 2), dy_out(ny * 2), dres(ny * 2), ddx(nx * 2), ddw(nw * 4);
  std::vector<float> cdw(nw, 0.0f);
  for (int step = 0; step < 3; ++step) {
    std::vector<uint16_t> bw;
    std::vector<float> fw;
    bf16_data(nw, 0.05f * (step + 1), bw, fw);
    CUDA_OK(cudaMemcpy(dw_.p, bw.data(), nw * 2, cudaMemcpyHostToDevice));
    for (int mb = 0; mb < 2; ++mb) {
      std::vector<uint16_t> bx, bdy, bres;
      std::vector<float> fx, fdy, fres;
      bf16_data(nx, 1.5f + step, bx, fx);
      bf16_data(ny, 1e-3f * (mb + 1), bdy, fdy);
      bf16_data(ny, 0.5f, bres, fres);
      CUDA_OK(cudaMemcpy(dx_.p, bx.data(), nx * 2, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(ddy.p, bdy.data(), ny * 2, cudaMemcpyHostToDevice));
      CUDA_OK(cudaMemcpy(dres.p, bres.data(), ny * 2, cudaMemcpyHostToDevice));
      // Forward with the residual as C.
      Tensor gx(dx_.p, DType::bf16, Device::cuda, {rows, in}), gw(dw_.p, DType::bf16, Device::cuda, {out, in});
      Tensor gy(dy_out.p, DType::bf16, Device::cuda, {rows, out}), gres(dres.p, DType::bf16, Device::cuda, {rows, out});
      gpu.linear_forward(gctx, gid, gx, gw, gy, &gres);
      std::vector<float> cy(ny);
      Tensor cx(fx.data(), DType::f32, Device::cpu, {rows, in}), cw(fw.data(), DType::f32, Device::cpu, {out, in});
      Tensor cyt(cy.data(), DType::f32, Device::cpu, {rows, out}), cres(fres.data(), DType::f32, Device::cpu, {rows, out});
      cpu.linear_forward(cctx, cid, cx, cw, cyt, &cres);
      // Backward, accumulating dW over the micro-batches.
      Tensor gdy(ddy.p, DType::bf16, Device::cuda, {rows, out}), gdx(ddx.p, DType::bf16, Device::cuda, {rows, in});
      Tensor gdw(ddw.p, DType::f32, Device::cuda, {out, in});
      gpu.linear_backward(gctx, gid, gx, gw, gdy, &gdx, gdw, mb > 0);
      std::vector<float> cdx(nx);
      Tensor cdyt(fdy.data(), DType::f32, Device::cpu, {rows, out}), cdxt(cdx.data(), DType::f32, Device::cpu, {rows, in});
      Tensor cdwt(cdw.data(), DType::f32, Device::cpu, {out, in});
      cpu.linear_backward(cctx, cid, cx, cw, cdyt, &cdxt, cdwt, mb > 0);
      CUDA_OK(cudaStreamSynchronize(stream));
      const std::vector<uint16_t> hy = download<uint16_t>(dy_out.p, ny), hdx = download<uint16_t>(ddx.p, nx);
      ASSERT_EQ(hy.size(), ny);
      ASSERT_EQ(hdx.size(), nx);
      std::vector<float> gyf(ny), gdxf(nx);
      for (size_t i = 0; i < ny; ++i) gyf[i] = loom::hf::bf16_to_f32(hy[i]);
      for (size_t i = 0; i < nx; ++i) gdxf[i] = loom::hf::bf16_to_f32(hdx[i]);
      double ey = 0, edx = 0;
      const double ry = worst_ratio(gyf, cy, 0.01, 0.005, &ey), rdx = worst_ratio(gdxf, cdx, 0.01, 0.005, &edx);
      EXPECT_LE(ry, 1.0) << "y, step " << step << " micro-batch " << mb << ": max error " << ey;
      EXPECT_LE(rdx, 1.0) << "dx, step " << step << " micro-batch " << mb << ": max error " << edx;
      std::printf("[%s] step %d mb %d: y %.3f (max error %.3g), dx %.3f (%.3g) of the bound\n", label, step, mb, ry,
                  ey, rdx, edx);
    }
    const std::vector<float> gdwf = download<float>(ddw.p, nw);
    ASSERT_EQ(gdwf.size(), nw);
    double edw = 0;
    const double rdw = worst_ratio(gdwf, cdw, 0.005, 0.002, &edw);
    EXPECT_LE(rdw, 1.0) << "dW, step " << step << ": max error " << edw;
    std::printf("[%s] step %d: dW %.3f of the bound (max error %.3g)\n", label, step, rdw, edw);
    cpu.end_step(cctx);
    gpu.end_step(gctx);
    CUDA_OK(cudaStreamSynchronize(stream));
    after_step(step);
  }
  at_end();
}

// A variable-row linear (an MoE expert) called with row counts the FP8 GEMMs
// cannot take whole: `split`, the recipe under test, runs the first `head`
// rows (the largest multiple of its row granularity) in FP8 and the tail in
// bf16; `whole`, a second instance of the same recipe, is called with the
// `head` rows alone. For each call (rows = head + tail; the first writes dW,
// the second accumulates):
//   - y and dx of the first `head` rows bitwise those of `whole` (the same
//     FP8 GEMMs on the same codes and scales: a split that ran the call in
//     bf16, or cast other rows, differs in the low bits at least);
//   - the tail rows of y and dx the bf16 product: the fp64 product of the
//     bf16 inputs within 1% of |ref| + 0.5% of max |ref| (the bf16 rounding of
//     y and dx, 2^-9, as for check_linear_pair);
//   - dW that of `whole` plus the tail's fp64 dy^T x, within 1e-3 of max |dW|
//     (fp32 accumulation of a few hundred bf16 products);
// and after end_step `after_step()` compares the two recipes' state (the
// tail does not enter the amaxes, so it is bitwise the same).
inline void check_variable_row_split(loom::Precision& split, loom::Precision& whole, int64_t in, int64_t out,
                                     int64_t max_rows, const std::vector<std::pair<int64_t, int64_t>>& calls,
                                     const char* label, const std::function<void()>& after_step) {
  const loom::LinearDesc desc{"layer.0.expert.3.w1", in, out, max_rows, loom::LinearRole::hidden, true};
  const int sid = split.register_linear(desc), wid = whole.register_linear(desc);
  auto self = loom::make_self_communicator();
  loom::PrecisionSetup s;
  s.data_parallel = self.get();
  s.device = loom::Device::cuda;
  split.setup(s);
  whole.setup(s);
  const RecipeDeviceMemory smem(split, sid), wmem(whole, wid);
  ASSERT_TRUE(smem.ok() && wmem.ok());
  GpuCallContext call;
  ASSERT_TRUE(call.lt && call.stream);
  cudaStream_t stream = call.stream;
  const loom::ExecContext& ctx = call.ctx;
  using loom::Device;
  using loom::DType;
  using loom::Tensor;

  std::mt19937 g(23);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto bf16s = [](const std::vector<uint16_t>& h, size_t from, size_t n) {
    std::vector<float> f(n);
    for (size_t i = 0; i < n; ++i) f[i] = loom::hf::bf16_to_f32(h[from + i]);
    return f;
  };
  const size_t nw = static_cast<size_t>(out * in);
  std::vector<uint16_t> bw;
  std::vector<double> fw;
  random_bf16(g, nd, nw, 0.05f, bw, fw);
  DevBuf dw_(nw * 2), sdw(nw * 4), wdw(nw * 4);
  CUDA_OK(cudaMemcpy(dw_.p, bw.data(), nw * 2, cudaMemcpyHostToDevice));
  const Tensor gw(dw_.p, DType::bf16, Device::cuda, {out, in});
  Tensor gsdw(sdw.p, DType::f32, Device::cuda, {out, in}), gwdw(wdw.p, DType::f32, Device::cuda, {out, in});
  std::vector<double> tail_dw(nw, 0.0);  // the tails' dy^T x, summed over the calls
  for (size_t c = 0; c < calls.size(); ++c) {
    const int64_t head = calls[c].first, rows = head + calls[c].second;
    SCOPED_TRACE(::testing::Message() << label << ": call " << c << ", " << rows << " rows (" << head << " in FP8)");
    const size_t nx = static_cast<size_t>(rows * in), ny = static_cast<size_t>(rows * out);
    std::vector<uint16_t> bx, bdy;
    std::vector<double> fx, fdy;
    random_bf16(g, nd, nx, 1.5f, bx, fx);
    random_bf16(g, nd, ny, 1e-2f, bdy, fdy);
    DevBuf dx_(nx * 2), ddy(ny * 2), sy(ny * 2), wy(ny * 2), sdx(nx * 2), wdx(nx * 2);
    CUDA_OK(cudaMemcpy(dx_.p, bx.data(), nx * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(ddy.p, bdy.data(), ny * 2, cudaMemcpyHostToDevice));
    const bool acc = c > 0;
    Tensor x(dx_.p, DType::bf16, Device::cuda, {rows, in}), dy(ddy.p, DType::bf16, Device::cuda, {rows, out});
    Tensor y(sy.p, DType::bf16, Device::cuda, {rows, out}), dx(sdx.p, DType::bf16, Device::cuda, {rows, in});
    split.linear_forward(ctx, sid, x, gw, y, nullptr);
    split.linear_backward(ctx, sid, x, gw, dy, &dx, gsdw, acc);
    // `whole` on the same buffers' first `head` rows (packed: a prefix).
    Tensor xh(dx_.p, DType::bf16, Device::cuda, {head, in}), dyh(ddy.p, DType::bf16, Device::cuda, {head, out});
    Tensor yh(wy.p, DType::bf16, Device::cuda, {head, out}), dxh(wdx.p, DType::bf16, Device::cuda, {head, in});
    whole.linear_forward(ctx, wid, xh, gw, yh, nullptr);
    whole.linear_backward(ctx, wid, xh, gw, dyh, &dxh, gwdw, acc);
    CUDA_OK(cudaStreamSynchronize(stream));
    const std::vector<uint16_t> hsy = download<uint16_t>(sy.p, ny), hwy = download<uint16_t>(wy.p, ny),
                                hsdx = download<uint16_t>(sdx.p, nx), hwdx = download<uint16_t>(wdx.p, nx);
    ASSERT_EQ(hsy.size(), ny);
    ASSERT_EQ(hsdx.size(), nx);
    const size_t hy = static_cast<size_t>(head * out), hx = static_cast<size_t>(head * in);
    EXPECT_TRUE(std::equal(hsy.begin(), hsy.begin() + static_cast<std::ptrdiff_t>(hy), hwy.begin()))
        << "y's first " << head << " rows are not bitwise the FP8 call's";
    EXPECT_TRUE(std::equal(hsdx.begin(), hsdx.begin() + static_cast<std::ptrdiff_t>(hx), hwdx.begin()))
        << "dx's first " << head << " rows are not bitwise the FP8 call's";
    // The tail in bf16 against fp64 of the same bf16 inputs.
    const int64_t t = rows - head;
    std::vector<float> ry(static_cast<size_t>(t * out)), rdx(static_cast<size_t>(t * in));
    for (int64_t r = 0; r < t; ++r) {
      const int64_t i = head + r;
      for (int64_t o = 0; o < out; ++o) {
        double a = 0;
        for (int64_t k = 0; k < in; ++k) a += fx[static_cast<size_t>(i * in + k)] * fw[static_cast<size_t>(o * in + k)];
        ry[static_cast<size_t>(r * out + o)] = static_cast<float>(a);
      }
      for (int64_t k = 0; k < in; ++k) {
        double a = 0;
        for (int64_t o = 0; o < out; ++o) a += fdy[static_cast<size_t>(i * out + o)] * fw[static_cast<size_t>(o * in + k)];
        rdx[static_cast<size_t>(r * in + k)] = static_cast<float>(a);
      }
      for (int64_t o = 0; o < out; ++o)
        for (int64_t k = 0; k < in; ++k)
          tail_dw[static_cast<size_t>(o * in + k)] += fdy[static_cast<size_t>(i * out + o)] * fx[static_cast<size_t>(i * in + k)];
    }
    double ey = 0, edx = 0;
    const double qy = worst_ratio(bf16s(hsy, hy, ry.size()), ry, 0.01, 0.005, &ey);
    const double qdx = worst_ratio(bf16s(hsdx, hx, rdx.size()), rdx, 0.01, 0.005, &edx);
    EXPECT_LE(qy, 1.0) << "y's last " << t << " rows against the bf16 product: max error " << ey;
    EXPECT_LE(qdx, 1.0) << "dx's last " << t << " rows against the bf16 product: max error " << edx;
    const std::vector<float> hsdw = download<float>(sdw.p, nw), hwdw = download<float>(wdw.p, nw);
    ASSERT_EQ(hsdw.size(), nw);
    std::vector<float> want(nw);
    for (size_t i = 0; i < nw; ++i) want[i] = static_cast<float>(hwdw[i] + tail_dw[i]);
    double edw = 0;
    const double qdw = worst_ratio(hsdw, want, 0.0, 1e-3, &edw);
    EXPECT_LE(qdw, 1.0) << "dW against the FP8 call's plus the tail's: max error " << edw;
    std::printf("[%s] %lld rows (%lld in FP8): head bitwise, tail y %.3f dx %.3f of the bound, dW %.3f\n", label,
                static_cast<long long>(rows), static_cast<long long>(head), qy, qdx, qdw);
  }
  split.end_step(ctx);
  whole.end_step(ctx);
  CUDA_OK(cudaStreamSynchronize(stream));
  after_step();
}

}  // namespace loom_test
