// examples/plugins/fp8_rowwise, the out-of-tree precision recipe built from
// the installed SDK by tests/install (the ctest fixture sdk_example_plugins),
// loaded through the registry from its file as `loom train` loads it.
//
// Against an fp64 reference on random inputs whose rows span 2^-6 .. 2^6 in
// magnitude (what per-row scaling is for), for every GEMM of a linear:
//   - the rows' and columns' casts: codes and inverse scales of
//     loom/ops/fp8_rowwise.hpp against an independent computation (the power
//     of two at or below 448 / amax, fp8::encode);
//   - the plugin's product against the fp64 product of those FP8 operands
//     (which operand is scaled along which axis): within fp32 accumulation,
//     |err| <= 2 k 2^-24 sum |a b|;
//   - and against the fp64 product of the unquantised operands within the
//     FP8 tolerance: each E4M3 operand is off by at most 2^-4 relative (3
//     mantissa bits, round to nearest) or half a subnormal step (2^-10 /
//     scale), so |err| <= sum_k (2u + u^2)|a b| + e_a |b| + e_b |a| + e_a e_b
//     with u = 2^-4; and the bound is not vacuous: the worst error reaches a
//     hundredth of it (unquantised operands would stay near 1e-6).
// The LM head stays in full precision (bitwise the fp32 GEMM on the CPU).
// The GPU case runs the same checks on the cuBLASLt outer-vector GEMMs (bf16
// activations; skipped without a GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "loom/config.hpp"
#include "loom/cpu_gemm.hpp"
#include "loom/fp8.hpp"
#include "loom/ops/fp8_rowwise.hpp"
#include "loom/precision.hpp"
#include "loom/registry.hpp"
#ifdef LOOM_HAVE_CUDA
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#endif

namespace fs = std::filesystem;
using loom::Device;
using loom::DType;
using loom::Tensor;

namespace {

const fs::path kPlugin =
    fs::path(LOOM_BINARY_DIR) / "tests" / "install" / "work" / "fp8_rowwise-build" / "libloom-precision-fp8_rowwise.so";

struct Loaded {
  loom::PluginRegistry registry;
  std::unique_ptr<loom::Precision> p;
};

std::unique_ptr<Loaded> load(Device dev, const std::string& keys = "") {
  if (!fs::exists(kPlugin))
    throw std::runtime_error("examples/plugins/fp8_rowwise was not built at " + kPlugin.string() +
                             ": the ctest fixture install_sdk_and_build_example builds it (run it first)");
  auto l = std::make_unique<Loaded>();
  loom::PluginInit init;
  init.config = loom::parse_config_table("[precision]\nplugin = \"fp8_rowwise\"\n" + keys, "test.toml").table("precision");
  // The core reads precision.plugin itself before it hands the table over (config/run_config.cpp).
  init.config.get_string("plugin", "");
  init.device = dev;
  l->p = l->registry.create_as<loom::PluginKind::precision>("fp8_rowwise", init, kPlugin);
  return l;
}

// Random values whose rows have magnitudes 2^-6 .. 2^6 and whose columns
// another 2^-3 .. 2^3, so that per-row and per-column scales both matter.
std::vector<float> random_matrix(int64_t rows, int64_t cols, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), e(-6.0f, 6.0f), f(-3.0f, 3.0f);
  std::vector<float> row_mag(static_cast<size_t>(rows)), col_mag(static_cast<size_t>(cols));
  for (float& m : row_mag) m = std::exp2(std::round(e(rng)));
  for (float& m : col_mag) m = std::exp2(std::round(f(rng)));
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) v[static_cast<size_t>(r * cols + c)] = u(rng) * row_mag[r] * col_mag[c];
  return v;
}

// An operand as the recipe sees it: per row of its k-major view [n, k]
// (along = the values' k stride), each row's FP8 values and half-subnormal step.
struct Quantised {
  std::vector<double> v;    // dequantised, [n, k]
  std::vector<double> sub;  // per row: 2^-10 / scale
};
// x is [rows, cols]; per_row: rows are the outer dim (k = cols), else columns are (k = rows).
Quantised quantise(const std::vector<float>& x, int64_t rows, int64_t cols, bool per_row) {
  const int64_t n = per_row ? rows : cols, k = per_row ? cols : rows;
  auto at = [&](int64_t i, int64_t j) { return per_row ? x[static_cast<size_t>(i * cols + j)] : x[static_cast<size_t>(j * cols + i)]; };
  Quantised q;
  q.v.resize(static_cast<size_t>(n * k));
  q.sub.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    float amax = 0;
    for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(at(i, j)));
    // The power of two at or below 448 / amax (1 for a zero row).
    const float s = amax > 0 ? std::exp2(std::floor(std::log2(448.0f / amax))) : 1.0f;
    q.sub[static_cast<size_t>(i)] = std::ldexp(1.0, -10) / s;
    for (int64_t j = 0; j < k; ++j)
      q.v[static_cast<size_t>(i * k + j)] =
          static_cast<double>(loom::fp8::decode(loom::fp8::encode(at(i, j) * s, loom::fp8::Format::e4m3),
                                                loom::fp8::Format::e4m3)) / s;
  }
  return q;
}

struct Bounds {
  double worst_acc = 0;  // max |got - fp8 product| / fp32 accumulation bound
  double worst_fp8 = 0;  // max |got - exact product| / FP8 bound
};

// D[m, n] = sum_k A(i, k) B(j, k) from k-major [m, k] and [n, k] operands, checked both ways.
void check_product(const std::vector<float>& got, const std::vector<float>& a_raw, const std::vector<float>& b_raw,
                   const Quantised& qa, const Quantised& qb, int64_t m, int64_t n, int64_t k,
                   const std::vector<float>* c, double out_rel, Bounds& b, const std::string& what,
                   bool gpu_acc = false) {
  const double u = 1.0 / 16;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double q = 0, exact = 0, abs_q = 0, bound = 0;
      for (int64_t t = 0; t < k; ++t) {
        const double av = qa.v[static_cast<size_t>(i * k + t)], bv = qb.v[static_cast<size_t>(j * k + t)];
        const double ar = a_raw[static_cast<size_t>(i * k + t)], br = b_raw[static_cast<size_t>(j * k + t)];
        q += av * bv;
        exact += ar * br;
        abs_q += std::fabs(av * bv);
        const double ea = qa.sub[static_cast<size_t>(i)], eb = qb.sub[static_cast<size_t>(j)];
        bound += (2 * u + u * u) * std::fabs(ar * br) + ea * std::fabs(br) + eb * std::fabs(ar) + ea * eb;
      }
      const double cv = c != nullptr ? (*c)[static_cast<size_t>(i * n + j)] : 0.0;
      const double g = got[static_cast<size_t>(i * n + j)];
      // fp32 summation of k products onto C (a residual or the dW being
      // accumulated): C is one more summand, and every partial sum rounds at
      // its own magnitude, at most |C| + sum |products|. gpu_acc: Hopper's
      // FP8 tensor-core accumulation instead (see the GPU case below).
      const double rel = gpu_acc ? static_cast<double>(std::min<int64_t>(k, 128)) * std::ldexp(1.0, -13)
                                 : 2.0 * static_cast<double>(k + 1) * std::ldexp(1.0, -24);
      const double acc = rel * (abs_q + std::fabs(cv)) + out_rel * (std::fabs(q + cv)) + 1e-30;
      b.worst_acc = std::max(b.worst_acc, std::fabs(g - (q + cv)) / acc);
      b.worst_fp8 = std::max(b.worst_fp8, std::fabs(g - (exact + cv)) / (bound + acc));
      if (std::fabs(g - (q + cv)) > acc) {
        ADD_FAILURE() << what << ": D[" << i << ", " << j << "] = " << g << ", the FP8 product is " << q + cv
                      << " (bound " << acc << ")";
        return;
      }
    }
}

// Row-major transpose of [rows, cols].
std::vector<float> transpose(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> t(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[static_cast<size_t>(c * rows + r)] = x[static_cast<size_t>(r * cols + c)];
  return t;
}

TEST(Fp8RowwiseExample, HostCastsMatchTheirDefinition) {
  std::mt19937 rng(3);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{5, 7}, {33, 64}, {1, 300}}) {
    std::vector<float> x = random_matrix(rows, cols, rng);
    if (rows > 2) std::fill_n(x.begin() + cols, cols, 0.0f);  // a zero row: scale 1
    for (bool per_row : {true, false}) {
      const int64_t n = per_row ? rows : cols, k = per_row ? cols : rows;
      std::vector<uint8_t> q(static_cast<size_t>(n * k));
      std::vector<float> sinv(static_cast<size_t>(n));
      if (per_row)
        loom::ops::fp8_cast_rowwise_host(x.data(), rows, cols, cols, {}, q.data(), sinv.data());
      else
        loom::ops::fp8_cast_colwise_host(x.data(), rows, cols, cols, {}, q.data(), sinv.data());
      const Quantised want = quantise(x, rows, cols, per_row);
      for (int64_t i = 0; i < n; ++i) {
        EXPECT_EQ(std::ldexp(1.0, -10) * sinv[static_cast<size_t>(i)], want.sub[static_cast<size_t>(i)])
            << (per_row ? "row " : "column ") << i;
        for (int64_t j = 0; j < k; ++j)
          ASSERT_EQ(loom::fp8::decode(q[static_cast<size_t>(i * k + j)], loom::fp8::Format::e4m3) *
                        static_cast<double>(sinv[static_cast<size_t>(i)]),
                    want.v[static_cast<size_t>(i * k + j)])
              << (per_row ? "row " : "column ") << i << ", element " << j;
      }
    }
  }
}

// The three GEMMs of a linear on `dev` (CPU here; CUDA in the GPU case below).
struct LinearCase {
  int64_t m, in, out;
};

TEST(Fp8RowwiseExample, CpuLinearMatchesTheFp8ProductAndTheFp32Reference) {
  Bounds b;
  std::mt19937 rng(11);
  for (const LinearCase& c : {LinearCase{7, 24, 40}, LinearCase{48, 64, 32}, LinearCase{1, 16, 16}}) {
    SCOPED_TRACE(::testing::Message() << "m=" << c.m << " in=" << c.in << " out=" << c.out);
    auto l = load(Device::cpu);
    loom::Precision& p = *l->p;
    const int id = p.register_linear({"layer.0.q_proj", c.in, c.out, c.m});
    const int head = p.register_linear({"lm_head", c.in, c.out, c.m, loom::LinearRole::lm_head});
    loom::PrecisionSetup s;
    p.setup(s);
    std::vector<float> x = random_matrix(c.m, c.in, rng), w = random_matrix(c.out, c.in, rng),
                       dy = random_matrix(c.m, c.out, rng), y(static_cast<size_t>(c.m * c.out)),
                       dx(static_cast<size_t>(c.m * c.in)), dw(static_cast<size_t>(c.out * c.in));
    std::vector<float> r = random_matrix(c.m, c.out, rng);
    Tensor tx(x.data(), DType::f32, Device::cpu, {c.m, c.in}), tw(w.data(), DType::f32, Device::cpu, {c.out, c.in}),
        tdy(dy.data(), DType::f32, Device::cpu, {c.m, c.out}), ty(y.data(), DType::f32, Device::cpu, {c.m, c.out}),
        tdx(dx.data(), DType::f32, Device::cpu, {c.m, c.in}), tdw(dw.data(), DType::f32, Device::cpu, {c.out, c.in}),
        tr(r.data(), DType::f32, Device::cpu, {c.m, c.out});
    loom::ExecContext ctx;

    // fprop with a residual: x per token, W per output feature.
    p.linear_forward(ctx, id, tx, tw, ty, &tr);
    check_product(y, x, w, quantise(x, c.m, c.in, true), quantise(w, c.out, c.in, true), c.m, c.out, c.in, &r, 0, b,
                  "fprop");
    // dgrad: dy per token, W per input feature (over out).
    // wgrad, accumulated onto dw: dy per output feature, x per input feature (over tokens).
    std::vector<float> dw0 = random_matrix(c.out, c.in, rng);
    dw = dw0;
    p.linear_backward(ctx, id, tx, tw, tdy, &tdx, tdw, /*accumulate=*/true);
    const std::vector<float> wt = transpose(w, c.out, c.in);
    check_product(dx, dy, wt, quantise(dy, c.m, c.out, true), quantise(w, c.out, c.in, false), c.m, c.in, c.out,
                  nullptr, 0, b, "dgrad");
    const std::vector<float> dyt = transpose(dy, c.m, c.out), xt = transpose(x, c.m, c.in);
    check_product(dw, dyt, xt, quantise(dy, c.m, c.out, false), quantise(x, c.m, c.in, false), c.out, c.in, c.m,
                  &dw0, 0, b, "wgrad");

    // The LM head is the fp32 GEMM, bitwise.
    std::vector<float> want(y.size());
    loom::cpu::linear_forward(want.data(), c.out, x.data(), c.in, w.data(), c.m, c.in, c.out, false);
    p.linear_forward(ctx, head, tx, tw, ty, nullptr);
    EXPECT_EQ(y, want) << "the LM head is not the fp32 GEMM";
  }
  std::printf("[fp8_rowwise cpu] worst error / fp32 accumulation bound %.3f, / FP8 bound %.3f\n", b.worst_acc,
              b.worst_fp8);
  EXPECT_LE(b.worst_fp8, 1.0) << "beyond the FP8 tolerance";
  EXPECT_GE(b.worst_fp8, 0.01) << "the FP8 bound is vacuous: the operands were not quantised";
}

TEST(Fp8RowwiseExample, RefusesUnknownKeysAndChoices) {
  auto message = [](const std::string& keys) {
    try {
      load(Device::cpu, keys);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message("lm_head = \"low\"\n").find("lm_head"), std::string::npos);
  EXPECT_NE(message("scaling = \"delayed\"\n").find("scaling"), std::string::npos);
}

#ifdef LOOM_HAVE_CUDA
// The device casts against the host reference, bitwise: codes and inverse
// scales, per row and per column, on bf16 and fp32 inputs, odd shapes, a zero
// row and column, and rows that span 2^-6 .. 2^6.
TEST(Fp8RowwiseExample, GpuCastsAreTheHostCastsBitwise) {
  LOOM_REQUIRE_GPU();
  std::mt19937 rng(5);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{64, 128}, {33, 300}, {257, 96}, {1, 1000}}) {
    for (DType t : {DType::bf16, DType::f32}) {
      SCOPED_TRACE(::testing::Message() << rows << " x " << cols << " " << loom::dtype_name(t));
      std::vector<float> x = random_matrix(rows, cols, rng);
      if (rows > 2) std::fill_n(x.begin() + cols, cols, 0.0f);          // a zero row
      for (int64_t r = 0; r < rows; ++r) x[static_cast<size_t>(r * cols)] = 0.0f;  // a zero column
      if (t == DType::bf16)
        for (float& f : x) f = __bfloat162float(__float2bfloat16_rn(f));
      const size_t n = x.size(), es = t == DType::f32 ? 4 : 2;
      std::vector<__nv_bfloat16> xb(n);
      for (size_t i = 0; i < n; ++i) xb[i] = __float2bfloat16_rn(x[i]);
      void *dx = nullptr, *dq = nullptr;
      float* ds = nullptr;
      ASSERT_EQ(cudaMalloc(&dx, n * es), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&dq, n), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&ds, static_cast<size_t>(2 * (rows + cols)) * sizeof(float)), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(dx, t == DType::f32 ? static_cast<const void*>(x.data()) : xb.data(), n * es,
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      Tensor tx(dx, t, Device::cuda, {rows, cols});
      for (bool per_row : {true, false}) {
        const int64_t outer = per_row ? rows : cols, k = per_row ? cols : rows;
        Tensor tq(dq, DType::e4m3, Device::cuda, {outer, k});
        if (per_row)
          loom::gpu::fp8_cast_rowwise(tx, tq, ds, ds + outer, {}, nullptr);
        else
          loom::gpu::fp8_cast_colwise(tx, tq, ds, ds + outer, {}, nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        std::vector<uint8_t> got_q(n), want_q(n);
        std::vector<float> got_s(static_cast<size_t>(outer)), want_s(static_cast<size_t>(outer));
        ASSERT_EQ(cudaMemcpy(got_q.data(), dq, n, cudaMemcpyDeviceToHost), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(got_s.data(), ds + outer, got_s.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        if (per_row)
          loom::ops::fp8_cast_rowwise_host(x.data(), rows, cols, cols, {}, want_q.data(), want_s.data());
        else
          loom::ops::fp8_cast_colwise_host(x.data(), rows, cols, cols, {}, want_q.data(), want_s.data());
        for (int64_t i = 0; i < outer; ++i)
          ASSERT_EQ(got_s[static_cast<size_t>(i)], want_s[static_cast<size_t>(i)])
              << (per_row ? "row " : "column ") << i << ": the inverse scale";
        for (size_t i = 0; i < n; ++i)
          ASSERT_EQ(int(got_q[i]), int(want_q[i])) << (per_row ? "row " : "column ") << static_cast<int64_t>(i) / k
                                                   << ", element " << static_cast<int64_t>(i) % k << ": the code";
      }
      for (void* ptr : {dx, dq, static_cast<void*>(ds)}) cudaFree(ptr);
    }
  }
}

// The GPU path: bf16 activations and weights, the device casts and the
// cuBLASLt outer-vector GEMMs, checked as the CPU case (the bf16 output adds
// 2^-8 relative; wgrad's dW is fp32) but for the accumulation: Hopper's FP8
// tensor cores add products into partial sums that keep about 14 bits (an
// error up to 2^-13 of the running sum per addition, not fp32's 2^-24) for
// at most 128 products (four 32-deep MMA steps) before they are promoted to
// fp32, so |err| <= min(k, 128) 2^-13 sum |a b|. The fp32 bound fails by
// 11x on an H200 (the worst error is about 2^-10.3 of sum |a b| at
// k = 512). Even at k >= 128 the bound is 2^-6 of sum |a b|, an eighth of
// the FP8 quantisation error (2^-3 of it), so a wrong code or scale still
// fails; the casts themselves are checked bitwise above. m = 40 is not a multiple of 16: that
// call runs in bf16, against the exact product within bf16's own tolerance.
TEST(Fp8RowwiseExample, GpuLinearMatchesTheFp8ProductAndTheFp32Reference) {
  LOOM_REQUIRE_GPU();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  cublasLtHandle_t lt = nullptr;
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  loom::ExecContext ctx;
  ctx.device = Device::cuda;
  ctx.stream = stream;
  ctx.blas_handle = lt;
  auto bf16_round = [](std::vector<float> v) {
    for (float& f : v) f = __bfloat162float(__float2bfloat16_rn(f));
    return v;
  };
  auto up = [&](const std::vector<float>& v, DType t) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, v.size() * 4), cudaSuccess);
    if (t == DType::f32) {
      EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    } else {
      std::vector<__nv_bfloat16> h(v.size());
      for (size_t i = 0; i < v.size(); ++i) h[i] = __float2bfloat16_rn(v[i]);
      EXPECT_EQ(cudaMemcpy(p, h.data(), h.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    }
    return p;
  };
  auto down = [&](void* p, size_t n, DType t) {
    std::vector<float> v(n);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    if (t == DType::f32) {
      EXPECT_EQ(cudaMemcpy(v.data(), p, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    } else {
      std::vector<__nv_bfloat16> h(n);
      EXPECT_EQ(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      for (size_t i = 0; i < n; ++i) v[i] = __bfloat162float(h[i]);
    }
    return v;
  };
  Bounds b;
  std::mt19937 rng(21);
  for (const LinearCase& c : {LinearCase{64, 128, 96}, LinearCase{256, 512, 384}}) {
    SCOPED_TRACE(::testing::Message() << "m=" << c.m << " in=" << c.in << " out=" << c.out);
    auto l = load(Device::cuda);
    loom::Precision& p = *l->p;
    const int id = p.register_linear({"layer.0.q_proj", c.in, c.out, c.m});
    loom::PrecisionSetup s;
    s.device = Device::cuda;
    p.setup(s);
    void* ws = nullptr;
    ASSERT_EQ(cudaMalloc(&ws, p.workspace_bytes()), cudaSuccess);
    p.set_workspace(ws, p.workspace_bytes());
    const std::vector<float> x = bf16_round(random_matrix(c.m, c.in, rng)), w = bf16_round(random_matrix(c.out, c.in, rng)),
                             dy = bf16_round(random_matrix(c.m, c.out, rng));
    void *dx_p = up(x, DType::bf16), *dw_p = up(w, DType::bf16), *ddy = up(dy, DType::bf16),
         *dy_out = up(std::vector<float>(static_cast<size_t>(c.m * c.out)), DType::bf16),
         *ddx = up(std::vector<float>(static_cast<size_t>(c.m * c.in)), DType::bf16),
         *ddw = up(std::vector<float>(static_cast<size_t>(c.out * c.in)), DType::f32);
    Tensor tx(dx_p, DType::bf16, Device::cuda, {c.m, c.in}), tw(dw_p, DType::bf16, Device::cuda, {c.out, c.in}),
        tdy(ddy, DType::bf16, Device::cuda, {c.m, c.out}), ty(dy_out, DType::bf16, Device::cuda, {c.m, c.out}),
        tdx(ddx, DType::bf16, Device::cuda, {c.m, c.in}), tdw(ddw, DType::f32, Device::cuda, {c.out, c.in});
    p.linear_forward(ctx, id, tx, tw, ty, nullptr);
    check_product(down(dy_out, static_cast<size_t>(c.m * c.out), DType::bf16), x, w, quantise(x, c.m, c.in, true),
                  quantise(w, c.out, c.in, true), c.m, c.out, c.in, nullptr, std::ldexp(1.0, -8), b, "gpu fprop", true);
    p.linear_backward(ctx, id, tx, tw, tdy, &tdx, tdw, /*accumulate=*/false);
    check_product(down(ddx, static_cast<size_t>(c.m * c.in), DType::bf16), dy, transpose(w, c.out, c.in),
                  quantise(dy, c.m, c.out, true), quantise(w, c.out, c.in, false), c.m, c.in, c.out, nullptr,
                  std::ldexp(1.0, -8), b, "gpu dgrad", true);
    check_product(down(ddw, static_cast<size_t>(c.out * c.in), DType::f32), transpose(dy, c.m, c.out),
                  transpose(x, c.m, c.in), quantise(dy, c.m, c.out, false), quantise(x, c.m, c.in, false), c.out,
                  c.in, c.m, nullptr, 0, b, "gpu wgrad", true);
    for (void* ptr : {dx_p, dw_p, ddy, dy_out, ddx, ddw, ws}) cudaFree(ptr);
  }
  std::printf("[fp8_rowwise cuda] worst error / accumulation bound %.3f, / FP8 bound %.3f\n", b.worst_acc,
              b.worst_fp8);
  EXPECT_LE(b.worst_fp8, 1.0);
  EXPECT_GE(b.worst_fp8, 0.01);
  cublasLtDestroy(lt);
  cudaStreamDestroy(stream);
}
#endif

}  // namespace
