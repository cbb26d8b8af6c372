// The FP8 device building blocks (loom/ops/fp8_cast.hpp, loom/ops/gemm.hpp)
// against the host FP8 code (loom/fp8.hpp, precision/common/fp8_scaling.hpp) and an fp64
// CPU GEMM:
// - the hardware encode of the tile kernels: every fp32 input's code equal
//   to encode_fast's (itself checked against the host's encode);
// - casts: bitwise equal to host loom::fp8::quantize (fp32 and bf16 inputs,
//   E4M3 and E5M2, several scales, saturation, NaN, infinities, zeros, fp32
//   and FP8 subnormals, rounding ties), the transposed copy, tile edges and
//   unaligned rows (scalar paths), row views; amax exact (NaN -> +inf);
// - scale updates: bitwise compute_scale / ScalingState, amax 0, inf, NaN,
//   negative, tiny (scale overflow) and huge with a margin (scale underflow);
// - GEMMs: every operand format pair cuBLASLt has, fast accumulation on and
//   off, with and without C (separate and in place), bf16 and fp32 D, the D
//   amax, and a linear's fprop/dgrad/wgrad end to end from device casts;
// - SwiGLU and RMSNorm writing FP8 (swiglu_forward_fp8, swiglu_backward_fp8,
//   rmsnorm_forward_fp8): bitwise the bf16 kernels followed by fp8_cast,
//   codes, transposed codes, amax and rstd, over whole and partial tiles,
//   packed halves and separate tensors, narrow and wide rows, both formats,
//   saturation and NaN.
// GPU cases skip without a device; the argument checks need none and run in
// every CUDA build (nothing is launched before an argument is refused).
#include <gtest/gtest.h>

#ifdef LOOM_HAVE_CUDA
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "alloc_counter.hpp"
#include "cuda_test_util.hpp"
#include "gpu_test_util.hpp"
#include "hf/safetensors.hpp"
#include "kernels/cuda/cuda_kernels.hpp"
#include "loom/ops/gemm.hpp"
#include "loom/ops/fp8_cast.hpp"
#include "loom/fp8.hpp"
#include "precision/common/fp8_scaling.hpp"
#include "loom/gemm_algo.hpp"

namespace {

using loom::Device;
using loom::DType;
using loom::Tensor;
namespace fp8 = loom::fp8;


std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float round_bf16(float x) { return loom::hf::bf16_to_f32(loom::hf::f32_to_bf16(x)); }

using loom_test::DevBuf;

template <typename T>
void upload(const DevBuf& d, const std::vector<T>& v) {
  ASSERT_EQ(cudaMemcpy(d.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
}
template <typename T>
std::vector<T> download(const DevBuf& d, size_t n) {
  std::vector<T> v(n);
  EXPECT_EQ(cudaMemcpy(v.data(), d.p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}
void put_float(const DevBuf& d, float v, size_t index = 0) {
  ASSERT_EQ(cudaMemcpy(d.as<float>() + index, &v, 4, cudaMemcpyHostToDevice), cudaSuccess);
}
float get_float(const DevBuf& d, size_t index = 0) {
  float v = kNaN;
  EXPECT_EQ(cudaMemcpy(&v, d.as<float>() + index, 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return v;
}

// The amax a device slot holds for an input whose host amax is `a` (host: NaN
// when the input has one; device: +inf, fp8_scaling.hpp).
float device_amax(float a) { return std::isnan(a) ? kInf : a; }

// Values over the whole range of both formats and beyond: random magnitudes
// 2^[-30, 30), then specials at fixed places (they move with `seed`).
std::vector<float> cast_inputs(size_t n, uint32_t seed, bool specials, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> e(-30.f, 30.f), u(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = std::copysign(std::exp2(e(rng)), u(rng));
  if (!specials) return v;
  // Exact places around each format's edges, as seen after the scale: ties
  // between codes, max, the saturation boundary, subnormals and half of the
  // smallest one, fp32 subnormals, zeros, infinities and NaN.
  const float s = scale;
  const std::vector<float> sp = {0.f,          -0.f,         kInf,         -kInf,       kNaN,         448.f / s,
                                 449.f / s,    464.f / s,    480.f / s,    -500.f / s,  57344.f / s,  61440.f / s,
                                 1e30f,        -1e30f,       FLT_MAX,      0x1p-9f / s, 0x1p-10f / s, 0x3p-10f / s,
                                 0x1p-16f / s, 0x1p-17f / s, 0x3p-17f / s, 1e-40f,      -1e-42f,      1.0625f / s,
                                 1.1875f / s,  1.125f / s,   0x1p-6f / s,  0x1p-14f / s};
  std::uniform_int_distribution<size_t> where(0, n - 1);
  for (int rep = 0; rep < 3; ++rep)
    for (float x : sp) v[where(rng)] = x;
  v[n / 2] = kNaN;  // at least one NaN whatever the placements overwrote
  return v;
}

// ---- argument checks (no device needed) ---------------------------------------

// Addresses that are never dereferenced: every check runs before any launch.
char* fake_ptr(uintptr_t offset = 0) { return reinterpret_cast<char*>(uintptr_t{1} << 20) + offset; }

TEST(CudaFp8Args, CastRefusesBadArguments) {
  float* scale = reinterpret_cast<float*>(fake_ptr(1 << 16));
  Tensor x(fake_ptr(), DType::bf16, Device::cuda, {32, 64});
  Tensor q(fake_ptr(1 << 12), DType::e4m3, Device::cuda, {32, 64});
  Tensor qt(fake_ptr(1 << 13), DType::e4m3, Device::cuda, {64, 32});
  std::string e;
  Tensor xi = x;
  xi.dtype = DType::i32;
  e = error_of([&] { loom::gpu::fp8_cast(xi, &q, &qt, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "fp8_cast: x must be fp32 or bf16, got int32")) << e;
  Tensor xc = x;
  xc.device = Device::cpu;
  e = error_of([&] { loom::gpu::fp8_cast(xc, &q, &qt, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "is on cpu")) << e;
  e = error_of([&] { loom::gpu::fp8_cast(x, nullptr, nullptr, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "neither q nor q_t is given")) << e;
  Tensor qb = q;
  qb.dtype = DType::bf16;
  e = error_of([&] { loom::gpu::fp8_cast(x, &qb, nullptr, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "q must be fp8_e4m3 or fp8_e5m2, got bf16")) << e;
  Tensor qs(fake_ptr(1 << 12), DType::e4m3, Device::cuda, {32, 48});
  e = error_of([&] { loom::gpu::fp8_cast(x, &qs, nullptr, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "q must be a contiguous [32, 64] tensor")) << e;
  Tensor qtw(fake_ptr(1 << 13), DType::e4m3, Device::cuda, {32, 64});  // not transposed
  e = error_of([&] { loom::gpu::fp8_cast(x, &q, &qtw, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "q_t must be a contiguous [cols, rows] = [64, 32] tensor")) << e;
  Tensor qt5 = qt;
  qt5.dtype = DType::e5m2;
  e = error_of([&] { loom::gpu::fp8_cast(x, &q, &qt5, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "q is fp8_e4m3 but q_t is fp8_e5m2")) << e;
  e = error_of([&] { loom::gpu::fp8_cast(x, &q, &qt, nullptr, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "scale is null")) << e;
  e = error_of([&] { loom::gpu::fp8_cast(x, &q, &qt, scale, reinterpret_cast<float*>(fake_ptr(2)), nullptr); });
  EXPECT_TRUE(contains(e, "amax at") && contains(e, "is not 4-byte aligned")) << e;
  e = error_of([&] { loom::gpu::fp8_amax(x, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "fp8_amax: amax is null")) << e;
  e = error_of(
      [&] { loom::gpu::fp8_update_scales(scale, scale, scale, 0, 3, fp8::Formats::hybrid, 127, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "margin 127 is outside [0, 126]")) << e;
  e = error_of([&] {
    loom::gpu::fp8_delayed_update(scale, scale, 4, 4, 3, fp8::AmaxAlgo::max, fp8::Formats::hybrid, 0, scale, scale,
                                  nullptr, nullptr, nullptr);
  });
  EXPECT_TRUE(contains(e, "head 4 is not a row of a history of 4 rows")) << e;
  Tensor y(fake_ptr(), DType::f32, Device::cuda, {32, 64});
  Tensor q2(fake_ptr(1 << 12), DType::e4m3, Device::cuda, {32, 63});
  e = error_of([&] { loom::gpu::fp8_dequantize(y, q2, scale, nullptr); });
  EXPECT_TRUE(contains(e, "have different element counts")) << e;
}

TEST(CudaFp8Args, SwigluFp8RefusesWhatItCannotWrite) {
  // Checked before anything is launched: bf16 operands only, rows and f
  // multiples of 16, q [rows, outputs f] and q_t [outputs f, rows] of one FP8
  // format, 16-byte alignment.
  float* scale = reinterpret_cast<float*>(fake_ptr(1 << 16));
  Tensor gu(fake_ptr(), DType::bf16, Device::cuda, {32, 128});
  Tensor g = gu, u = gu;
  g.shape[1] = u.shape[1] = 64;
  u.data = fake_ptr(128);  // the second half, row stride 128
  Tensor d(fake_ptr(1 << 14), DType::bf16, Device::cuda, {32, 64});
  Tensor q(fake_ptr(1 << 12), DType::e4m3, Device::cuda, {32, 64});
  Tensor qt(fake_ptr(1 << 13), DType::e4m3, Device::cuda, {64, 32});
  Tensor q2(fake_ptr(1 << 12), DType::e5m2, Device::cuda, {32, 128});
  Tensor qt2(fake_ptr(1 << 13), DType::e5m2, Device::cuda, {128, 32});
  std::string e;
  Tensor g32 = g;
  g32.dtype = DType::f32;
  e = error_of([&] { loom::gpu::swiglu_forward_fp8(q, qt, g32, u, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "swiglu_forward_fp8: gate, up must be bf16")) << e;
  Tensor g24 = g, u24 = u;
  g24.shape[1] = u24.shape[1] = 24;
  Tensor q24(fake_ptr(1 << 12), DType::e4m3, Device::cuda, {32, 24});
  Tensor qt24(fake_ptr(1 << 13), DType::e4m3, Device::cuda, {24, 32});
  e = error_of([&] { loom::gpu::swiglu_forward_fp8(q24, qt24, g24, u24, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "[32, 24] SwiGLU columns: rows and columns must be multiples of 16")) << e;
  Tensor g40 = g, u40 = u;
  g40.shape[0] = u40.shape[0] = 40;
  e = error_of([&] { loom::gpu::swiglu_forward_fp8(q, qt, g40, u40, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "[40, 64] SwiGLU columns")) << e;
  e = error_of([&] { loom::gpu::swiglu_backward_fp8(q, qt, d, g, u, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "q must be a contiguous [32, 128] tensor, got [32,64]")) << e;
  e = error_of([&] { loom::gpu::swiglu_forward_fp8(q2, qt, g, u, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "q and q_t must be one FP8 format")) << e;
  e = error_of([&] { loom::gpu::swiglu_forward_fp8(q, q, g, u, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "q_t must be a contiguous [64, 32] tensor, got [32,64]")) << e;
  Tensor u_off = u;
  u_off.data = fake_ptr(130);
  e = error_of([&] { loom::gpu::swiglu_forward_fp8(q, qt, g, u_off, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "must start 16-byte aligned")) << e;
  e = error_of([&] { loom::gpu::swiglu_backward_fp8(q2, qt2, d, g, u, nullptr, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "swiglu_backward_fp8: scale at") && contains(e, "must be a device float")) << e;
  Tensor d48(fake_ptr(1 << 14), DType::bf16, Device::cuda, {32, 48});
  e = error_of([&] { loom::gpu::swiglu_backward_fp8(q2, qt2, d48, g, u, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "dout is [32, 48], gate [32, 64]")) << e;
}

TEST(CudaFp8Args, RmsnormFp8RefusesWhatItCannotWrite) {
  float* scale = reinterpret_cast<float*>(fake_ptr(1 << 16));
  Tensor x(fake_ptr(), DType::bf16, Device::cuda, {32, 64});
  Tensor w(fake_ptr(1 << 14), DType::bf16, Device::cuda, {64});
  Tensor rstd(fake_ptr(1 << 15), DType::f32, Device::cuda, {32});
  Tensor q(fake_ptr(1 << 12), DType::e4m3, Device::cuda, {32, 64});
  Tensor qt(fake_ptr(1 << 13), DType::e4m3, Device::cuda, {64, 32});
  std::string e;
  Tensor x32 = x;
  x32.dtype = DType::f32;
  e = error_of([&] { loom::gpu::rmsnorm_forward_fp8(q, qt, rstd, x32, w, 1e-5f, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "rmsnorm_forward_fp8: x and w must be bf16")) << e;
  Tensor x40(fake_ptr(), DType::bf16, Device::cuda, {40, 64});
  Tensor r40(fake_ptr(1 << 15), DType::f32, Device::cuda, {40});
  e = error_of([&] { loom::gpu::rmsnorm_forward_fp8(q, qt, r40, x40, w, 1e-5f, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "[40, 64]: rows and h must be multiples of 16")) << e;
  Tensor x56(fake_ptr(), DType::bf16, Device::cuda, {32, 56}), w56(fake_ptr(1 << 14), DType::bf16, Device::cuda, {56});
  e = error_of([&] { loom::gpu::rmsnorm_forward_fp8(q, qt, rstd, x56, w56, 1e-5f, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "[32, 56]: rows and h must be multiples of 16")) << e;
  e = error_of([&] { loom::gpu::rmsnorm_forward_fp8(qt, q, rstd, x, w, 1e-5f, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "q must be a contiguous [32, 64] tensor, got [64,32]")) << e;
  Tensor qt5 = qt;
  qt5.dtype = DType::e5m2;
  e = error_of([&] { loom::gpu::rmsnorm_forward_fp8(q, qt5, rstd, x, w, 1e-5f, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "q and q_t must be one FP8 format")) << e;
  Tensor r16(fake_ptr(1 << 15), DType::f32, Device::cuda, {16});
  e = error_of([&] { loom::gpu::rmsnorm_forward_fp8(q, qt, r16, x, w, 1e-5f, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "rstd [16] must hold one value per row (32)")) << e;
  Tensor xo = x;
  xo.data = fake_ptr(8);
  e = error_of([&] { loom::gpu::rmsnorm_forward_fp8(q, qt, rstd, xo, w, 1e-5f, scale, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "must be 16-byte aligned")) << e;
  e = error_of([&] { loom::gpu::rmsnorm_forward_fp8(q, qt, rstd, x, w, 1e-5f, nullptr, nullptr, nullptr); });
  EXPECT_TRUE(contains(e, "must be a device float")) << e;
}

TEST(CudaFp8Args, GemmRefusesWhatCublasLtCannotDo) {
  loom::ops::GemmPlans g(nullptr, nullptr, 0);  // no handle: every call below must fail before using one
  const float* sa = reinterpret_cast<const float*>(fake_ptr(1 << 18));
  const float* sb = sa + 1;
  Tensor a(fake_ptr(), DType::e4m3, Device::cuda, {64, 128});
  Tensor b(fake_ptr(1 << 14), DType::e4m3, Device::cuda, {96, 128});
  Tensor d(fake_ptr(1 << 16), DType::bf16, Device::cuda, {64, 96});
  loom::ops::Fp8GemmOptions o;
  auto err = [&](const Tensor& ta, const Tensor& tb, Tensor td, const loom::ops::Fp8GemmOptions& opt) {
    return error_of([&] { loom::ops::fp8_gemm(g, ta, sa, tb, sb, td, opt, nullptr); });
  };
  std::string e;
  Tensor a5 = a, b5 = b;
  a5.dtype = DType::e5m2;
  b5.dtype = DType::e5m2;
  e = err(a5, b5, d, o);
  EXPECT_TRUE(contains(e, "both fp8_e5m2; cuBLASLt has no E5M2 x E5M2 kernel")) << e;
  Tensor ab = a;
  ab.dtype = DType::bf16;
  e = err(ab, b, d, o);
  EXPECT_TRUE(contains(e, "A and B must be fp8_e4m3 or fp8_e5m2, got A bf16")) << e;
  Tensor dh = d;
  dh.dtype = DType::f16;
  e = err(a, b, dh, o);
  EXPECT_TRUE(contains(e, "D must be bf16 or fp32, got fp16")) << e;
  Tensor a40(fake_ptr(), DType::e4m3, Device::cuda, {40, 128});
  Tensor d40(fake_ptr(1 << 16), DType::bf16, Device::cuda, {40, 96});
  e = err(a40, b, d40, o);
  EXPECT_TRUE(contains(e, "m (rows of A and D) = 40 is not a positive multiple of 16")) << e;
  Tensor ak(fake_ptr(), DType::e4m3, Device::cuda, {64, 120});
  Tensor bk(fake_ptr(1 << 14), DType::e4m3, Device::cuda, {96, 120});
  e = err(ak, bk, d, o);
  EXPECT_TRUE(contains(e, "row stride of 120 elements, not a multiple of 16 bytes")) << e;
  Tensor bw(fake_ptr(1 << 14), DType::e4m3, Device::cuda, {96, 64});
  e = err(a, bw, d, o);
  EXPECT_TRUE(contains(e, "contracts the last dim of both")) << e;
  Tensor dw(fake_ptr(1 << 16), DType::bf16, Device::cuda, {64, 80});
  e = err(a, b, dw, o);
  EXPECT_TRUE(contains(e, "D is [64, 80] but A B^T is [64, 96]")) << e;
  Tensor au(fake_ptr(8), DType::e4m3, Device::cuda, {64, 128});
  e = err(au, b, d, o);
  EXPECT_TRUE(contains(e, "A at") && contains(e, "is not 16-byte aligned")) << e;
  Tensor av = a;  // a row view with a row stride of 136 bytes
  av.stride[0] = 136;
  e = err(av, b, d, o);
  EXPECT_TRUE(contains(e, "row stride of 136 elements, not a multiple of 16 bytes")) << e;
  e = error_of([&] { loom::ops::fp8_gemm(g, a, nullptr, b, sb, d, o, nullptr); });
  EXPECT_TRUE(contains(e, "inverse scales must be device floats")) << e;
  Tensor c32(fake_ptr(1 << 17), DType::f32, Device::cuda, {64, 96});
  loom::ops::Fp8GemmOptions oc;
  oc.c = &c32;
  e = err(a, b, d, oc);
  EXPECT_TRUE(contains(e, "C is fp32 but D is bf16")) << e;
  Tensor cover(fake_ptr((1 << 16) + 32), DType::bf16, Device::cuda, {64, 96});
  oc.c = &cover;
  e = err(a, b, d, oc);
  EXPECT_TRUE(contains(e, "overlaps D") && contains(e, "must be D itself or share no byte with it")) << e;
  Tensor cstride = d;
  cstride.stride[0] = 104;
  oc.c = &cstride;
  e = err(a, b, d, oc);
  EXPECT_TRUE(contains(e, "C is D's buffer with another row stride (104 vs 96)")) << e;
  // Everything valid: the only thing missing is the handle.
  e = err(a, b, d, o);
  EXPECT_TRUE(contains(e, "no cuBLASLt handle")) << e;
  EXPECT_EQ(g.plans_built(), 0);
}

// ---- casts ------------------------------------------------------------------------

class CudaFp8 : public ::testing::Test {
 protected:
  void SetUp() override {
    LOOM_REQUIRE_GPU();
    CUDA_OK(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    if (stream_) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

struct CastCase {
  int64_t rows, cols, pad;  // pad: extra elements per input row (a row view)
};

TEST_F(CudaFp8, CastMatchesHostEncodeBitwise) {
  // Full tiles; tile edges in both dims with packed paths; odd shapes and an
  // odd row stride (scalar paths everywhere); a wide row view. Then the 128 x
  // 64 whole-tile path with what it leaves: a right and a bottom strip
  // ([208, 136]: 8 columns, 80 rows; a row view [144, 72]: 8 columns, 16
  // rows), several tiles each way, a 16-row bottom strip alone, and shapes it
  // must refuse (rows not a multiple of 16, cols not a multiple of 8).
  const CastCase cases[] = {{128, 64, 0},  {80, 200, 0}, {37, 45, 0},  {33, 70, 3},  {256, 1024, 64},
                            {208, 136, 0}, {144, 72, 8}, {384, 192, 0}, {272, 64, 0}, {131, 64, 0},
                            {144, 100, 0}};
  constexpr int kCases = static_cast<int>(sizeof cases / sizeof cases[0]);
  const float scales[] = {1.0f, 3.7f, 0x1p-10f, 448.f / 3.f, 1e6f};
  int checked = 0;
  for (DType xt : {DType::f32, DType::bf16}) {
    for (DType qtype : {DType::e4m3, DType::e5m2}) {
      const fp8::Format f = qtype == DType::e4m3 ? fp8::Format::e4m3 : fp8::Format::e5m2;
      for (const CastCase& cc : cases) {
        for (float s : scales) {
          SCOPED_TRACE(::testing::Message() << loom::dtype_name(xt) << " -> " << loom::dtype_name(qtype) << " ["
                                            << cc.rows << ", " << cc.cols << "] pad " << cc.pad << " scale " << s);
          const int64_t R = cc.rows, C = cc.cols, ld = C + cc.pad;
          const size_t n = static_cast<size_t>(R * C);
          std::vector<float> v = cast_inputs(n, static_cast<uint32_t>(R * 7 + C + checked), true, s);
          if (xt == DType::bf16)
            for (float& x : v) x = round_bf16(x);
          // Host reference: the batched host cast (fp32 product, then encode).
          std::vector<uint8_t> want(n);
          const float host_amax = fp8::quantize(v.data(), static_cast<int64_t>(n), s, f, want.data());
          // Device input with row stride ld.
          const size_t es = loom::dtype_size(xt);
          DevBuf xb(static_cast<size_t>(R * ld) * es), qb(n), qtb(n), sb(4), ab(8);
          ASSERT_TRUE(xb.p && qb.p && qtb.p && sb.p && ab.p);
          std::vector<unsigned char> host_x(static_cast<size_t>(R * ld) * es, 0);
          for (int64_t r = 0; r < R; ++r)
            for (int64_t c = 0; c < C; ++c) {
              const float x = v[static_cast<size_t>(r * C + c)];
              unsigned char* dst = host_x.data() + static_cast<size_t>(r * ld + c) * es;
              if (xt == DType::f32) {
                std::memcpy(dst, &x, 4);
              } else {
                const uint16_t h = loom::hf::f32_to_bf16(x);
                std::memcpy(dst, &h, 2);
              }
            }
          upload(xb, host_x);
          put_float(sb, s);
          put_float(ab, 0.0f);
          put_float(ab, 0.0f, 1);
          // Poisoned: an element the kernel leaves unwritten fails wherever the host code is not 0xAA.
          CUDA_OK(cudaMemset(qb.p, 0xAA, n));
          CUDA_OK(cudaMemset(qtb.p, 0xAA, n));
          Tensor x(xb.p, xt, Device::cuda, {R, C});
          x.stride[0] = ld;
          Tensor q(qb.p, qtype, Device::cuda, {R, C});
          Tensor qt(qtb.p, qtype, Device::cuda, {C, R});
          loom::gpu::fp8_cast(x, &q, &qt, sb.as<float>(), ab.as<float>(), stream_);
          loom::gpu::fp8_amax(x, ab.as<float>() + 1, stream_);
          CUDA_OK(cudaStreamSynchronize(stream_));
          const std::vector<uint8_t> got = download<uint8_t>(qb, n), got_t = download<uint8_t>(qtb, n);
          int bad = 0, bad_t = 0;
          for (size_t i = 0; i < n; ++i)
            if (got[i] != want[i] && bad++ < 5)
              ADD_FAILURE() << "q[" << i / C << "," << i % C << "] = 0x" << std::hex << int(got[i]) << ", host 0x"
                            << int(want[i]) << std::dec << " for x = " << v[i] << " (x*scale = " << v[i] * s << ")";
          for (int64_t r = 0; r < R; ++r)
            for (int64_t c = 0; c < C; ++c)
              if (got_t[static_cast<size_t>(c * R + r)] != want[static_cast<size_t>(r * C + c)] && bad_t++ < 5)
                ADD_FAILURE() << "q_t[" << c << "," << r << "] != q[" << r << "," << c << "]";
          EXPECT_EQ(bad, 0);
          EXPECT_EQ(bad_t, 0);
          // amax: exact, NaN recorded as +inf.
          EXPECT_TRUE(std::isnan(host_amax));  // the specials include NaN
          EXPECT_EQ(bits(get_float(ab, 0)), bits(device_amax(host_amax)));
          EXPECT_EQ(bits(get_float(ab, 1)), bits(device_amax(host_amax)));
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 2 * 2 * kCases * 5);
}

TEST_F(CudaFp8, HardwareEncodeIsTheHostEncodeForEveryFloat) {
  // The tile kernels encode with PTX cvt.rn.satfinite (fp8_tile.cuh): over
  // all 2^32 fp32 bit patterns (every NaN, infinity, subnormal and tie) it
  // must give encode_fast's code, which test_fp8 checks against the host's
  // encode over every input.
  for (fp8::Format f : {fp8::Format::e4m3, fp8::Format::e5m2}) {
    uint32_t first = 0;
    const uint64_t bad = loom::gpu::fp8_encode_mismatches(f, &first, stream_);
    EXPECT_EQ(bad, 0u) << (f == fp8::Format::e4m3 ? "e4m3" : "e5m2") << ": first differing input bits 0x" << std::hex
                       << first;
  }
}

TEST_F(CudaFp8, WholeTileCastLoopsOverMoreTilesThanBlocks) {
  // [2176, 4096] is 17 x 64 = 1088 whole 128 x 64 tiles, more than the fast
  // kernel's grid (the blocks resident at once: 132 SMs x 6 on an H100):
  // blocks cast a second tile, whose shared transpose must not mix with the
  // first. q and q_t together, then each alone, and the amax; bf16 as the
  // trainer casts it.
  const int64_t R = 2176, C = 4096;
  const size_t n = static_cast<size_t>(R * C);
  const float s = 3.7f;
  std::vector<float> v = cast_inputs(n, 29, true, s);
  for (float& x : v) x = round_bf16(x);
  std::vector<uint8_t> want(n);
  const float host_amax = fp8::quantize(v.data(), static_cast<int64_t>(n), s, fp8::Format::e4m3, want.data());
  std::vector<uint16_t> hx(n);
  for (size_t i = 0; i < n; ++i) hx[i] = loom::hf::f32_to_bf16(v[i]);
  DevBuf xb(n * 2), qb(n), qtb(n), q1b(n), qt1b(n), sb(4), ab(12);
  ASSERT_TRUE(xb.p && qb.p && qtb.p && q1b.p && qt1b.p && sb.p && ab.p);
  upload(xb, hx);
  put_float(sb, s);
  for (size_t i = 0; i < 3; ++i) put_float(ab, 0.0f, i);
  for (const DevBuf* b : {&qb, &qtb, &q1b, &qt1b}) CUDA_OK(cudaMemset(b->p, 0xAA, n));
  Tensor x(xb.p, DType::bf16, Device::cuda, {R, C});
  Tensor q(qb.p, DType::e4m3, Device::cuda, {R, C}), qt(qtb.p, DType::e4m3, Device::cuda, {C, R});
  Tensor q1(q1b.p, DType::e4m3, Device::cuda, {R, C}), qt1(qt1b.p, DType::e4m3, Device::cuda, {C, R});
  loom::gpu::fp8_cast(x, &q, &qt, sb.as<float>(), ab.as<float>(), stream_);
  loom::gpu::fp8_cast(x, &q1, nullptr, sb.as<float>(), ab.as<float>() + 1, stream_);
  loom::gpu::fp8_cast(x, nullptr, &qt1, sb.as<float>(), ab.as<float>() + 1, stream_);
  loom::gpu::fp8_amax(x, ab.as<float>() + 2, stream_);
  CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_TRUE(download<uint8_t>(qb, n) == want) << "q";
  EXPECT_TRUE(download<uint8_t>(q1b, n) == want) << "q alone";
  for (const DevBuf* b : {&qtb, &qt1b}) {
    const std::vector<uint8_t> got_t = download<uint8_t>(*b, n);
    int64_t bad_t = 0;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c)
        if (got_t[static_cast<size_t>(c * R + r)] != want[static_cast<size_t>(r * C + c)] && bad_t++ < 5)
          ADD_FAILURE() << (b == &qtb ? "q_t" : "q_t alone") << "[" << c << "," << r << "] != q[" << r << "," << c
                        << "]";
    EXPECT_EQ(bad_t, 0);
  }
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(bits(get_float(ab, i)), bits(device_amax(host_amax))) << "amax slot " << i;
  // q alone needs no rows % 16: the first 2170 rows take 16 x 64 whole tiles
  // and leave a 122-row bottom strip.
  const int64_t R2 = 2170;
  const size_t n2 = static_cast<size_t>(R2 * C);
  CUDA_OK(cudaMemset(q1b.p, 0xAA, n));
  Tensor x2(xb.p, DType::bf16, Device::cuda, {R2, C}), q2(q1b.p, DType::e4m3, Device::cuda, {R2, C});
  loom::gpu::fp8_cast(x2, &q2, nullptr, sb.as<float>(), nullptr, stream_);
  CUDA_OK(cudaStreamSynchronize(stream_));
  const std::vector<uint8_t> got2 = download<uint8_t>(q1b, n2);
  EXPECT_TRUE(std::equal(got2.begin(), got2.end(), want.begin())) << "q alone, " << R2 << " rows";
}

TEST_F(CudaFp8, CastOutputsAloneAmaxAccumulatesAndIsExact) {
  // Finite inputs (amax a real value), q only and q_t only, and the amax slot
  // max-accumulating across calls (a step's micro-batches).
  const int64_t R = 96, C = 160;
  const size_t n = static_cast<size_t>(R * C);
  for (DType xt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(loom::dtype_name(xt));
    std::vector<float> v = cast_inputs(n, 11, false, 1.0f);
    for (float& x : v) x = std::ldexp(x, -25);  // magnitudes 2^[-55, 5)
    if (xt == DType::bf16)
      for (float& x : v) x = round_bf16(x);
    std::vector<uint8_t> want(n);
    const float s = 17.0f;
    const float host_amax = fp8::quantize(v.data(), static_cast<int64_t>(n), s, fp8::Format::e5m2, want.data());
    ASSERT_TRUE(std::isfinite(host_amax) && host_amax > 0);
    const size_t es = loom::dtype_size(xt);
    DevBuf xb(n * es), qb(n), qtb(n), sb(4), ab(12);
    ASSERT_TRUE(xb.p && qb.p && qtb.p && sb.p && ab.p);
    std::vector<unsigned char> hx(n * es);
    for (size_t i = 0; i < n; ++i) {
      if (xt == DType::f32) {
        std::memcpy(hx.data() + 4 * i, &v[i], 4);
      } else {
        const uint16_t h = loom::hf::f32_to_bf16(v[i]);
        std::memcpy(hx.data() + 2 * i, &h, 2);
      }
    }
    upload(xb, hx);
    put_float(sb, s);
    put_float(ab, 0.0f);
    put_float(ab, 2.0f * host_amax, 1);  // a larger earlier micro-batch: kept
    put_float(ab, 0.5f * host_amax, 2);  // a smaller one: replaced
    Tensor x(xb.p, xt, Device::cuda, {R, C});
    Tensor q(qb.p, DType::e5m2, Device::cuda, {R, C});
    Tensor qt(qtb.p, DType::e5m2, Device::cuda, {C, R});
    loom::gpu::fp8_cast(x, &q, nullptr, sb.as<float>(), ab.as<float>(), stream_);
    loom::gpu::fp8_cast(x, nullptr, &qt, sb.as<float>(), ab.as<float>() + 1, stream_);
    loom::gpu::fp8_amax(x, ab.as<float>() + 2, stream_);
    loom::gpu::fp8_amax(x, ab.as<float>() + 2, stream_);  // twice: still the same max
    CUDA_OK(cudaStreamSynchronize(stream_));
    const std::vector<uint8_t> got = download<uint8_t>(qb, n), got_t = download<uint8_t>(qtb, n);
    EXPECT_EQ(got, want);
    int bad_t = 0;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c)
        bad_t += got_t[static_cast<size_t>(c * R + r)] != want[static_cast<size_t>(r * C + c)];
    EXPECT_EQ(bad_t, 0);
    EXPECT_EQ(bits(get_float(ab, 0)), bits(host_amax));
    EXPECT_EQ(bits(get_float(ab, 1)), bits(2.0f * host_amax));
    EXPECT_EQ(bits(get_float(ab, 2)), bits(host_amax));
  }
}

TEST_F(CudaFp8, DequantizeMatchesHost) {
  // Every code of both formats, three scales; NaN codes must stay NaN.
  std::vector<uint8_t> codes(256 * 3);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i);
  const size_t n = codes.size();
  for (fp8::Format f : {fp8::Format::e4m3, fp8::Format::e5m2}) {
    for (float s : {1.0f, 0.3f, 4096.0f}) {
      std::vector<float> want(n);
      fp8::dequantize(codes.data(), static_cast<int64_t>(n), s, f, want.data());
      DevBuf qb(n), yb(n * 4), yb16(n * 2), sb(4);
      ASSERT_TRUE(qb.p && yb.p && yb16.p && sb.p);
      upload(qb, codes);
      put_float(sb, s);
      const DType qt = f == fp8::Format::e4m3 ? DType::e4m3 : DType::e5m2;
      Tensor q(qb.p, qt, Device::cuda, {static_cast<int64_t>(n)});
      Tensor y(yb.p, DType::f32, Device::cuda, {static_cast<int64_t>(n)});
      Tensor y16(yb16.p, DType::bf16, Device::cuda, {static_cast<int64_t>(n)});
      loom::gpu::fp8_dequantize(y, q, sb.as<float>(), stream_);
      loom::gpu::fp8_dequantize(y16, q, sb.as<float>(), stream_);
      CUDA_OK(cudaStreamSynchronize(stream_));
      const std::vector<float> got = download<float>(yb, n);
      const std::vector<uint16_t> got16 = download<uint16_t>(yb16, n);
      for (size_t i = 0; i < n; ++i) {
        if (std::isnan(want[i])) {
          EXPECT_TRUE(std::isnan(got[i]) && std::isnan(loom::hf::bf16_to_f32(got16[i]))) << "code " << i % 256;
        } else {
          EXPECT_EQ(bits(got[i]), bits(want[i])) << "code " << i % 256 << " scale " << s;
          EXPECT_EQ(got16[i], loom::hf::f32_to_bf16(want[i])) << "code " << i % 256 << " scale " << s;
        }
      }
    }
  }
}

TEST_F(CudaFp8, DequantizeLongAndMisalignedMatchesHost) {
  // The packed path (8 codes a thread) and the element-by-element head and
  // tail: 2^20 + 13 random codes read from and written to offsets of 0..9
  // elements into their buffers (q and y aligned together, apart, or never),
  // bitwise the host's dequantize for both formats and output dtypes.
  const int64_t n = (int64_t{1} << 20) + 13;
  std::mt19937 rng(11);
  std::vector<uint8_t> codes(static_cast<size_t>(n));
  for (uint8_t& c : codes) c = static_cast<uint8_t>(rng() & 0xFFu);
  DevBuf qb(static_cast<size_t>(n) + 16), yb(static_cast<size_t>(n + 16) * 4), sb(4);
  ASSERT_TRUE(qb.p && yb.p && sb.p);
  for (fp8::Format f : {fp8::Format::e4m3, fp8::Format::e5m2}) {
    const float s = f == fp8::Format::e4m3 ? 0.37f : 1.0f / 3000.0f;
    std::vector<float> want(static_cast<size_t>(n));
    fp8::dequantize(codes.data(), n, s, f, want.data());
    put_float(sb, s);
    const DType qt = f == fp8::Format::e4m3 ? DType::e4m3 : DType::e5m2;
    for (auto [qo, yo] : {std::pair<int, int>{0, 0}, {8, 8}, {1, 0}, {0, 3}, {5, 5}, {3, 9}}) {
      std::vector<uint8_t> padded(static_cast<size_t>(n) + 16, 0);
      std::copy(codes.begin(), codes.end(), padded.begin() + qo);
      upload(qb, padded);
      Tensor q(static_cast<uint8_t*>(qb.p) + qo, qt, Device::cuda, {n});
      for (DType yt : {DType::f32, DType::bf16}) {
        const size_t es = yt == DType::f32 ? 4 : 2;
        CUDA_OK(cudaMemset(yb.p, 0xFF, static_cast<size_t>(n + 16) * 4));  // NaN everywhere
        Tensor y(static_cast<char*>(yb.p) + static_cast<size_t>(yo) * es, yt, Device::cuda, {n});
        loom::gpu::fp8_dequantize(y, q, sb.as<float>(), stream_);
        CUDA_OK(cudaStreamSynchronize(stream_));
        int bad = 0;
        if (yt == DType::f32) {
          const std::vector<float> got = download<float>(yb, static_cast<size_t>(n + yo));
          for (int64_t i = 0; i < n && bad < 5; ++i) {
            const float w = want[static_cast<size_t>(i)], g = got[static_cast<size_t>(i + yo)];
            const bool ok = std::isnan(w) ? std::isnan(g) : bits(g) == bits(w);
            if (!ok) ADD_FAILURE() << "fp32 element " << i << " code " << int(codes[static_cast<size_t>(i)]) << " got "
                                   << g << " want " << w << " (q+" << qo << ", y+" << yo << ")";
            bad += !ok;
          }
        } else {
          const std::vector<uint16_t> got = download<uint16_t>(yb, static_cast<size_t>(n + yo));
          for (int64_t i = 0; i < n && bad < 5; ++i) {
            const float w = want[static_cast<size_t>(i)];
            const uint16_t g = got[static_cast<size_t>(i + yo)];
            const bool ok = std::isnan(w) ? std::isnan(loom::hf::bf16_to_f32(g)) : g == loom::hf::f32_to_bf16(w);
            if (!ok) ADD_FAILURE() << "bf16 element " << i << " code " << int(codes[static_cast<size_t>(i)])
                                   << " (q+" << qo << ", y+" << yo << ")";
            bad += !ok;
          }
        }
        EXPECT_EQ(bad, 0) << (f == fp8::Format::e4m3 ? "e4m3" : "e5m2") << " q+" << qo << " y+" << yo;
      }
    }
  }
}

TEST_F(CudaFp8, TransposeOfCodesMatchesHost) {
  // qt = qᵀ byte for byte: shapes of whole 64 x 64 tiles (the 16-byte path),
  // of whole tiles and an edge strip, of rows or columns not a multiple of 16
  // (the byte path everywhere), a single row and column, a Llama-3-8B weight
  // ([4096, 14336]), and q at an offset that breaks the 16-byte alignment.
  // The bytes around qt stay untouched.
  std::mt19937 rng(3);
  struct Shape { int64_t rows, cols, offset; };
  for (const Shape sh : {Shape{128, 192, 0}, {4096, 14336, 0}, {200, 136, 0}, {96, 80, 0}, {37, 101, 0},
                         {1, 70, 0}, {70, 1, 0}, {128, 128, 5}}) {
    const int64_t n = sh.rows * sh.cols;
    std::vector<uint8_t> codes(static_cast<size_t>(n));
    for (uint8_t& c : codes) c = static_cast<uint8_t>(rng() & 0xFFu);
    std::vector<uint8_t> padded(static_cast<size_t>(n + 32), 0);
    std::copy(codes.begin(), codes.end(), padded.begin() + sh.offset);
    DevBuf qb(static_cast<size_t>(n + 32)), tb(static_cast<size_t>(n + 32));
    ASSERT_TRUE(qb.p && tb.p);
    upload(qb, padded);
    CUDA_OK(cudaMemset(tb.p, 0xA5, static_cast<size_t>(n + 32)));
    for (DType dt : {DType::e4m3, DType::e5m2}) {
      Tensor q(static_cast<uint8_t*>(qb.p) + sh.offset, dt, Device::cuda, {sh.rows, sh.cols});
      Tensor qt(static_cast<uint8_t*>(tb.p) + 16, dt, Device::cuda, {sh.cols, sh.rows});
      loom::gpu::fp8_transpose(qt, q, stream_);
      CUDA_OK(cudaStreamSynchronize(stream_));
      const std::vector<uint8_t> got = download<uint8_t>(tb, static_cast<size_t>(n + 32));
      int bad = 0;
      for (int64_t r = 0; r < sh.rows && bad < 5; ++r)
        for (int64_t c = 0; c < sh.cols && bad < 5; ++c) {
          const uint8_t w = codes[static_cast<size_t>(r * sh.cols + c)], g = got[static_cast<size_t>(16 + c * sh.rows + r)];
          if (g != w) ADD_FAILURE() << "[" << sh.rows << ", " << sh.cols << "] q(" << r << ", " << c << ") = " << int(w)
                                    << ", qt(" << c << ", " << r << ") = " << int(g);
          bad += g != w;
        }
      for (int64_t i = 0; i < 16; ++i) EXPECT_EQ(got[static_cast<size_t>(i)], 0xA5) << "byte " << i << " before qt";
      for (int64_t i = 16 + n; i < n + 32; ++i) EXPECT_EQ(got[static_cast<size_t>(i)], 0xA5) << "byte " << i << " after qt";
    }
  }
  // The refusals: mixed formats, shapes that are not each other's transpose.
  DevBuf a(64), b(64);
  Tensor q(a.p, DType::e4m3, Device::cuda, {4, 16}), bad_dt(b.p, DType::e5m2, Device::cuda, {16, 4}),
      bad_shape(b.p, DType::e4m3, Device::cuda, {4, 16});
  EXPECT_THROW(loom::gpu::fp8_transpose(bad_dt, q, stream_), loom::Error);
  EXPECT_THROW(loom::gpu::fp8_transpose(bad_shape, q, stream_), loom::Error);
}

// ---- scale updates -------------------------------------------------------------------

TEST_F(CudaFp8, UpdateScalesMatchesHostComputeScaleBitwise) {
  // Slots of 20 linears (60 tensors): random amaxes over 2^[-40, 40), and the
  // edge cases at fixed slots: 0, +inf, NaN, negative, an fp32 subnormal (the
  // scale overflows to FLT_MAX, whose inverse is subnormal), FLT_MAX (with a
  // margin the scale underflows to 0: skipped).
  const int64_t T = 60;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> e(-40.f, 40.f), pe(-8.f, 8.f);
  std::vector<float> amax(T), prev(T);
  for (int64_t t = 0; t < T; ++t) {
    amax[static_cast<size_t>(t)] = std::exp2(e(rng));
    prev[static_cast<size_t>(t)] = std::exp2(pe(rng));
  }
  const float edge[] = {0.0f, kInf, kNaN, -3.0f, 1e-42f, FLT_MAX, 0x1p-126f, 448.0f, 57344.0f};
  for (size_t i = 0; i < std::size(edge); ++i) {
    amax[3 * i] = edge[i];      // an x slot (E4M3)
    amax[3 * i + 2] = edge[i];  // a dy slot (E5M2 under hybrid)
  }
  for (fp8::Formats formats : {fp8::Formats::hybrid, fp8::Formats::e4m3}) {
    for (int margin : {0, 1, 126}) {
      for (int64_t first : {int64_t{0}, int64_t{4}}) {
        SCOPED_TRACE(::testing::Message() << fp8::name(formats) << " margin " << margin << " first " << first);
        const int64_t count = T - first - (first ? 3 : 0);
        std::vector<float> want_s = prev, want_inv(T, -1.0f);
        uint32_t want_skipped = 0;
        for (int64_t t = first; t < first + count; ++t) {
          const auto i = static_cast<size_t>(t);
          const float fmax = fp8::max_value(fp8::role_format(formats, static_cast<fp8::Role>(t % 3)));
          const fp8::ScaleUpdate u = fp8::compute_scale(amax[i], fmax, margin, prev[i]);
          want_s[i] = u.scale;
          want_inv[i] = 1.0f / u.scale;
          want_skipped += u.skipped;
        }
        DevBuf ab(T * 4), sb(T * 4), ib(T * 4), kb(4);
        ASSERT_TRUE(ab.p && sb.p && ib.p && kb.p);
        upload(ab, amax);
        upload(sb, prev);
        upload(ib, std::vector<float>(T, -1.0f));
        CUDA_OK(cudaMemset(kb.p, 0, 4));
        loom::gpu::fp8_update_scales(ab.as<float>(), sb.as<float>(), ib.as<float>(), first, count, formats, margin,
                                     kb.as<uint32_t>(), stream_);
        CUDA_OK(cudaStreamSynchronize(stream_));
        const std::vector<float> got_s = download<float>(sb, T), got_inv = download<float>(ib, T);
        for (int64_t t = 0; t < T; ++t) {
          const auto i = static_cast<size_t>(t);
          EXPECT_EQ(bits(got_s[i]), bits(want_s[i])) << "slot " << t << " amax " << amax[i] << " prev " << prev[i];
          EXPECT_EQ(bits(got_inv[i]), bits(want_inv[i])) << "slot " << t << " scale " << want_s[i];
        }
        EXPECT_EQ(download<uint32_t>(kb, 1)[0], want_skipped);
        EXPECT_GE(want_skipped, first == 0 ? 8u : 5u);  // the edge cases in range did skip (from slot 4: three fewer of 0, inf, NaN)
      }
    }
  }
}

TEST_F(CudaFp8, DelayedUpdateMatchesScalingStateOverSteps) {
  for (fp8::AmaxAlgo algo : {fp8::AmaxAlgo::max, fp8::AmaxAlgo::most_recent}) {
    SCOPED_TRACE(fp8::name(algo));
    fp8::ScalingConfig cfg;
    cfg.amax_history_len = 4;
    cfg.amax_compute_algo = algo;
    cfg.margin = 1;
    fp8::ScalingState host(cfg);
    const int L = 7;
    for (int l = 0; l < L; ++l) host.add_linear("layer." + std::to_string(l));
    const int64_t T = host.tensors();
    DevBuf step(T * 4), hist(T * 4 * 4), sc(T * 4), inv(T * 4), cnt(8);
    ASSERT_TRUE(step.p && hist.p && sc.p && inv.p && cnt.p);
    CUDA_OK(cudaMemset(hist.p, 0, T * 16));
    upload(sc, std::vector<float>(host.scales(), host.scales() + T));
    upload(inv, std::vector<float>(host.scale_invs(), host.scale_invs() + T));
    std::mt19937 rng(17);
    std::uniform_real_distribution<float> e(-12.f, 12.f);
    int head = 0;
    for (int s = 0; s < 9; ++s) {
      SCOPED_TRACE(::testing::Message() << "step " << s);
      for (int l = 0; l < L; ++l)
        for (int r = 0; r < 3; ++r) {
          float a = std::exp2(e(rng));
          if ((l + s) % 5 == 0 && r == 1) a = 0.0f;  // a tensor that was all zeros
          if (s == 3 && l == 2) a = kNaN;            // a bad step (recorded as +inf)
          if (s == 5 && l == 4 && r == 2) a = kInf;
          host.record_amax(l, static_cast<fp8::Role>(r), a);
        }
      upload(step, std::vector<float>(host.step_amax(), host.step_amax() + T));
      CUDA_OK(cudaMemset(cnt.p, 0, 8));
      const int64_t nonfinite0 = host.nonfinite_amaxes();
      const int64_t kept = host.update_scales();
      head = (head + 1) % cfg.amax_history_len;
      loom::gpu::fp8_delayed_update(step.as<float>(), hist.as<float>(), cfg.amax_history_len, head, T, algo,
                                    cfg.formats, cfg.margin, sc.as<float>(), inv.as<float>(), cnt.as<uint32_t>(),
                                    cnt.as<uint32_t>() + 1, stream_);
      CUDA_OK(cudaStreamSynchronize(stream_));
      const std::vector<float> gs = download<float>(sc, T), gi = download<float>(inv, T),
                               gstep = download<float>(step, T), gh = download<float>(hist, T * 4);
      const std::vector<uint32_t> gc = download<uint32_t>(cnt, 2);
      EXPECT_EQ(gc[0], static_cast<uint32_t>(kept));
      EXPECT_EQ(gc[1], static_cast<uint32_t>(host.nonfinite_amaxes() - nonfinite0));
      for (int l = 0; l < L; ++l)
        for (int r = 0; r < 3; ++r) {
          const auto role = static_cast<fp8::Role>(r);
          const auto t = static_cast<size_t>(fp8::ScalingState::slot(l, role));
          EXPECT_EQ(bits(gs[t]), bits(host.scale(l, role))) << "linear " << l << " role " << r;
          EXPECT_EQ(bits(gi[t]), bits(host.scale_inv(l, role))) << "linear " << l << " role " << r;
          EXPECT_EQ(gstep[t], 0.0f);
          const std::vector<float> h = host.history(l, role);  // newest first
          for (int i = 0; i < cfg.amax_history_len; ++i) {
            const int row = ((head - i) % cfg.amax_history_len + cfg.amax_history_len) % cfg.amax_history_len;
            EXPECT_EQ(bits(gh[static_cast<size_t>(row) * T + t]), bits(h[static_cast<size_t>(i)]))
                << "linear " << l << " role " << r << " history entry " << i;
          }
        }
    }
  }
}

// ---- GEMMs --------------------------------------------------------------------------

// FP8 operand data: codes quantised on the host from N(0, 1) * spread values
// with the scale compute_scale gives their amax, and the decoded values.
struct Operand {
  DType dtype;
  std::vector<uint8_t> codes;
  std::vector<double> value;  // decode(code), unscaled
  float scale = 1.0f, inv = 1.0f;
};
Operand make_operand(int64_t rows, int64_t cols, DType t, uint32_t seed) {
  const fp8::Format f = t == DType::e4m3 ? fp8::Format::e4m3 : fp8::Format::e5m2;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (float& v : x) v = nd(rng) * 0.05f;
  Operand o;
  o.dtype = t;
  o.scale = fp8::compute_scale(fp8::amax(x.data(), static_cast<int64_t>(x.size())), fp8::max_value(f), 0, 1.0f).scale;
  o.inv = 1.0f / o.scale;
  o.codes.resize(x.size());
  fp8::quantize(x.data(), static_cast<int64_t>(x.size()), o.scale, f, o.codes.data());
  o.value.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) o.value[i] = fp8::decode(o.codes[i], f);
  return o;
}

// fp64 reference of D = inv_a inv_b A B^T + C and, per element, the bound's
// scale S = inv_a inv_b sum |a b| + |C|.
struct Reference {
  std::vector<double> d, s;
};
Reference reference(const Operand& a, const Operand& b, int64_t m, int64_t n, int64_t k, const std::vector<float>* c) {
  Reference r;
  r.d.resize(static_cast<size_t>(m * n));
  r.s.resize(r.d.size());
  const double sc = static_cast<double>(a.inv) * static_cast<double>(b.inv);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0, mag = 0;
      const double* ar = a.value.data() + i * k;
      const double* br = b.value.data() + j * k;
      for (int64_t p = 0; p < k; ++p) {
        acc += ar[p] * br[p];
        mag += std::fabs(ar[p] * br[p]);
      }
      const size_t o = static_cast<size_t>(i * n + j);
      const double cv = c != nullptr ? (*c)[o] : 0.0;
      r.d[o] = acc * sc + cv;
      r.s[o] = mag * sc + std::fabs(cv);
    }
  return r;
}

// Tolerances. The products of two FP8 values are exact in fp32 (at most 4 x 4
// significant bits) and the inverse scales are fp32, so every error is in the
// accumulation and the output rounding:
// - accumulation over k terms: fp32 with round-off u = 2^-24 per add would
//   allow k u S; Hopper's FP8 tensor cores add their partial sums with a
//   narrower (about 14-bit) significand, which cuBLASLt without fast
//   accumulation promotes into fp32 every few k-blocks. 2^-10 S covers that
//   with margin (a 14-bit add loses at most 2^-13 of the running sum, over one
//   promotion interval of a few 32-wide k-blocks). Fast accumulation keeps the
//   narrow partial sums over the whole k: 2^-7 S.
// - D's rounding: half an ulp, at most 2^-8 |D| for bf16 (8 significant
//   bits; 2^-9 |D| for a value at the top of its binade), 2^-24 |D| for fp32.
// S = inv_a inv_b sum |a b| + |C| bounds what the sum passes through.
// Alone this bound can be loose where the terms cancel (S is about sqrt(k)
// times |D| for random signs), so the relative Frobenius error is held too:
// 2^-8 with full accumulation (bf16's rounding is about 2^-9 rms; with a
// 14-bit partial sum per promotion interval the accumulation's share stays
// near 2^-11 at k = 1024), 2^-5 with fast accumulation (DeepSeek-V3 reports
// a worst relative error near 2^-6 for k = 4096 without promotion). A wrong
// scale, format, transpose or missing C gives errors of order |D| and fails
// both; an unwritten element (D is poisoned with NaN) fails too.
struct Tol {
  double acc, out, frob;
};
Tol tolerance(bool fast, DType d) {
  const double out = d == DType::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24);
  if (fast) return {std::ldexp(1.0, -7), out, std::ldexp(1.0, -5)};
  return {std::ldexp(1.0, -10), out, std::ldexp(1.0, -8)};
}

std::vector<float> download_matrix(const DevBuf& b, DType t, size_t n) {
  std::vector<float> v(n);
  if (t == DType::f32) return download<float>(b, n);
  const std::vector<uint16_t> h = download<uint16_t>(b, n);
  for (size_t i = 0; i < n; ++i) v[i] = loom::hf::bf16_to_f32(h[i]);
  return v;
}
void upload_matrix(const DevBuf& b, DType t, const std::vector<float>& v) {
  if (t == DType::f32) return upload(b, v);
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = loom::hf::f32_to_bf16(v[i]);
  upload(b, h);
}

std::string cat_what(DType a, DType b, DType d, bool fast, int cmode) {
  static const char* cname[] = {"no C", "C separate", "C = D in place"};
  return std::string(loom::dtype_name(a)) + " x " + std::string(loom::dtype_name(b)) + " -> " +
         std::string(loom::dtype_name(d)) + (fast ? ", fast accumulation, " : ", full accumulation, ") + cname[cmode];
}

// Compares got with the reference under tol; returns the worst bound ratio.
double check_gemm(const std::vector<float>& got, const Reference& ref, const Tol& tol, const std::string& what) {
  double worst = 0, num = 0, den = 0;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref.d[i]);
    const double bound = tol.acc * ref.s[i] + tol.out * std::fabs(ref.d[i]) + 1e-30;
    if (!(err <= bound) && bad++ < 5)
      ADD_FAILURE() << what << ": D[" << i << "] = " << got[i] << ", reference " << ref.d[i] << " (error " << err
                    << " > bound " << bound << ")";
    worst = std::max(worst, std::isfinite(err) ? err / bound : 1e30);
    num += err * err;
    den += ref.d[i] * ref.d[i];
  }
  const double frob = std::sqrt(num / den);
  EXPECT_LE(frob, tol.frob) << what << ": relative Frobenius error";
  EXPECT_EQ(bad, 0) << what;
  return worst;
}

class CudaFp8Gemm : public CudaFp8 {
 protected:
  void SetUp() override {
    CudaFp8::SetUp();
    if (IsSkipped()) return;
    ASSERT_EQ(cublasLtCreate(&lt_), CUBLAS_STATUS_SUCCESS);
    CUDA_OK(cudaMalloc(&workspace_, loom::ops::GemmPlans::kWorkspaceBytes));
  }
  void TearDown() override {
    if (workspace_) cudaFree(workspace_);
    if (lt_) cublasLtDestroy(lt_);
    CudaFp8::TearDown();
  }
  cublasLtHandle_t lt_ = nullptr;
  void* workspace_ = nullptr;
};

// Both ways of picking the algorithm (loom/gemm_algo.hpp): "fastest" times
// the candidates on a scratch D, so C (also in place, C = D), D and the amax
// slot must come out exactly as with the heuristic's answer.
TEST_F(CudaFp8Gemm, EveryFormatPairAccumulationCAndOutputAgainstFp64) {
 for (loom::GemmAlgo algo : {loom::GemmAlgo::heuristic, loom::GemmAlgo::fastest}) {
  SCOPED_TRACE(loom::gemm_algo_name(algo));
  const int64_t timed0 = loom::gemm_timing_counts().timed;
  loom::ops::GemmPlans g(lt_, workspace_, loom::ops::GemmPlans::kWorkspaceBytes, algo);
  // The three GEMM shapes of a linear with 512 tokens, in = 384, out = 256
  // (loom/ops/gemm.hpp): m, n, k all different within a shape, so that a swapped
  // operand cannot pass; k up to 512 so that accumulation matters.
  struct Shape {
    const char* name;
    int64_t m, n, k;
  };
  const Shape shapes[] = {{"fprop", 512, 256, 384}, {"dgrad", 512, 384, 256}, {"wgrad", 256, 384, 512}};
  const std::pair<DType, DType> pairs[] = {
      {DType::e4m3, DType::e4m3}, {DType::e5m2, DType::e4m3}, {DType::e4m3, DType::e5m2}};
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  int64_t runs = 0, fused = 0;
  double worst_by[2][2] = {};  // [fast accumulation][fp32 D]: the largest error / bound
  for (const Shape& sh : shapes) {
    const int64_t m = sh.m, n = sh.n, k = sh.k;
    for (const auto& [ta, tb] : pairs) {
      const Operand a = make_operand(m, k, ta, 100 + static_cast<uint32_t>(ta));
      const Operand b = make_operand(n, k, tb, 200 + static_cast<uint32_t>(tb));
      DevBuf ab(a.codes.size()), bb(b.codes.size()), scales(12), amax(8);
      ASSERT_TRUE(ab.p && bb.p && scales.p && amax.p);
      upload(ab, a.codes);
      upload(bb, b.codes);
      put_float(scales, a.inv, 0);
      put_float(scales, b.inv, 1);
      put_float(scales, 2.0f * a.inv, 2);  // another A inverse scale at another address
      Tensor ta_t(ab.p, ta, Device::cuda, {m, k}), tb_t(bb.p, tb, Device::cuda, {n, k});
      for (DType dt : {DType::bf16, DType::f32}) {
        // C: a bf16/fp32-representable matrix of A B^T's magnitude (0.05^2
        // sqrt(k), about 0.05 here), so that neither term hides the other's errors.
        std::vector<float> c(static_cast<size_t>(m * n));
        for (float& x : c) x = dt == DType::bf16 ? round_bf16(0.1f * u(rng)) : 0.1f * u(rng);
        const Reference ref_plain = reference(a, b, m, n, k, nullptr);
        const Reference ref_c = reference(a, b, m, n, k, &c);
        const size_t es = loom::dtype_size(dt);
        DevBuf db(static_cast<size_t>(m * n) * es), cb(static_cast<size_t>(m * n) * es);
        ASSERT_TRUE(db.p && cb.p);
        Tensor d(db.p, dt, Device::cuda, {m, n}), ct(cb.p, dt, Device::cuda, {m, n});
        for (bool fast : {false, true}) {
          for (int cmode : {0, 1, 2}) {  // no C, C separate, C = D (in place)
            const std::string what = std::string(sh.name) + "-shaped " + std::to_string(m) + "x" + std::to_string(n) +
                                     "x" + std::to_string(k) + ": " + cat_what(ta, tb, dt, fast, cmode);
            SCOPED_TRACE(what);
            loom::ops::Fp8GemmOptions o;
            o.fast_accum = fast;
            o.d_amax = amax.as<float>();
            if (cmode == 0) {
              CUDA_OK(cudaMemset(db.p, 0xFF, db.bytes));  // NaN: an unwritten element fails
            } else if (cmode == 1) {
              CUDA_OK(cudaMemset(db.p, 0xFF, db.bytes));
              upload_matrix(cb, dt, c);
              o.c = &ct;
            } else {
              upload_matrix(db, dt, c);
              o.c = &d;
            }
            put_float(amax, 1e30f);  // larger than any D: the slot must be reset, not max-accumulated into
            const int64_t plans0 = g.plans_built();
            loom::ops::fp8_gemm(g, ta_t, scales.as<float>(), tb_t, scales.as<float>() + 1, d, o, stream_);
            CUDA_OK(cudaStreamSynchronize(stream_));
            const Reference& ref = cmode == 0 ? ref_plain : ref_c;
            const Tol tol = tolerance(fast, dt);
            const std::vector<float> got = download_matrix(db, dt, static_cast<size_t>(m * n));
            const double worst = check_gemm(got, ref, tol, what);
            // D amax: | max|D| - max|ref| | <= max_i |D_i - ref_i| <= the largest bound.
            double ref_amax = 0, bound = 0;
            for (size_t i = 0; i < ref.d.size(); ++i) {
              ref_amax = std::max(ref_amax, std::fabs(ref.d[i]));
              bound = std::max(bound, tol.acc * ref.s[i] + tol.out * std::fabs(ref.d[i]));
            }
            const float got_amax = get_float(amax);
            EXPECT_NEAR(got_amax, ref_amax, bound) << "D amax (" << (g.amax_fused() ? "cuBLASLt" : "fp8_amax") << ")";
            double& w = worst_by[fast][dt == DType::f32];
            w = std::max(w, worst);
            fused += g.amax_fused();
            // A repeat with other scale and amax pointers reuses the plan and
            // honours the new pointers: A's inverse scale doubled doubles D
            // exactly in the reference (and within the same bounds on the GPU).
            if (cmode == 0) {
              loom::ops::Fp8GemmOptions o2 = o;
              o2.d_amax = amax.as<float>() + 1;
              put_float(amax, 1e30f, 1);
              CUDA_OK(cudaMemset(db.p, 0xFF, db.bytes));
              loom::ops::fp8_gemm(g, ta_t, scales.as<float>() + 2, tb_t, scales.as<float>() + 1, d, o2, stream_);
              CUDA_OK(cudaStreamSynchronize(stream_));
              EXPECT_EQ(g.plans_built(), plans0 + 1);
              Reference twice = ref;
              for (double& v : twice.d) v *= 2;
              for (double& v : twice.s) v *= 2;
              check_gemm(download_matrix(db, dt, got.size()), twice, tol, what + ", repeat with A's scale doubled");
              EXPECT_NEAR(get_float(amax, 1), 2 * ref_amax, 2 * bound) << "D amax of the repeat";
              EXPECT_EQ(get_float(amax, 0), got_amax) << "the first call's amax slot is left alone";
            }
            ++runs;
          }
        }
      }
    }
  }
  EXPECT_EQ(runs, 3 * 3 * 2 * 2 * 3);
  for (int fast = 0; fast < 2; ++fast)
    for (int f32 = 0; f32 < 2; ++f32)
      std::printf("[fp8 gemm] %s accumulation, %s D: worst error / bound %.3f over %lld GEMMs\n",
                  fast ? "fast" : "full", f32 ? "fp32" : "bf16", worst_by[fast][f32],
                  static_cast<long long>(runs / 4));
  std::printf("[fp8 gemm] D amax computed by cuBLASLt (AMAX_D_POINTER) in %lld of %lld GEMMs, by fp8_amax in the rest\n",
              static_cast<long long>(fused), static_cast<long long>(runs));
  // One timing per plan with "fastest" (the plans of the first call of each
  // problem; the repeats reuse them), none with the heuristic.
  const int64_t timed = loom::gemm_timing_counts().timed - timed0;
  if (algo == loom::GemmAlgo::fastest) EXPECT_GE(timed, g.plans_built());
  else EXPECT_EQ(timed, 0);
  std::printf("[fp8 gemm] gemm_algo %s: %lld plans, %lld problems timed\n", loom::gemm_algo_name(algo),
              static_cast<long long>(g.plans_built()), static_cast<long long>(timed));
 }
}

// A varying dim (Fp8GemmOptions::varying: an MoE expert's token count), m as
// in fprop and dgrad, k as in wgrad (where the recipes' transposed copies
// have k as their leading dimension too). Every count against fp64 of the
// dequantised operands, under "fastest": one plan per bucket of counts (256
// apart, above 2048 an eighth of the power of two), all built at the
// problem's first call, none timed, and a later count builds nothing.
// The last call's A is a row view of a wider buffer (leading dimension 112,
// k = 80): the bucket's plan holds k = 256 rows and a leading dimension of
// 256, and takes the call's own (112) per call, so it is the plan of the
// packed k = 48 and 160 calls.
TEST_F(CudaFp8Gemm, VaryingDimSharesOnePlanPerBucket) {
  loom::ops::GemmPlans g(lt_, workspace_, loom::ops::GemmPlans::kWorkspaceBytes, loom::GemmAlgo::fastest);
  const int64_t timed0 = loom::gemm_timing_counts().timed;
  const int64_t most = 4096, n = 128, fixed = 256;
  struct Call {
    loom::ops::GemmVarying dim;
    int64_t v, new_plans, lda_pad = 0;
  };
  using V = loom::ops::GemmVarying;
  // The first call of each dim builds the plans of all 16 buckets up to 4096
  // (256 apart to 2048, then 2304 ... 4096); every later count finds its own.
  const Call calls[] = {{V::m, 80, 16},  {V::m, 96, 0},   {V::m, 256, 0},  {V::m, 272, 0}, {V::m, 2048, 0},
                        {V::m, 2064, 0}, {V::m, 2288, 0}, {V::m, 4096, 0}, {V::k, 48, 16}, {V::k, 160, 0},
                        {V::k, 4080, 0}, {V::k, 80, 0, 32}};
  uint32_t seed = 40;
  for (const Call& c : calls) {
    const bool vm = c.dim == V::m;
    const int64_t m = vm ? c.v : fixed, k = vm ? fixed : c.v;
    SCOPED_TRACE(::testing::Message() << (vm ? "m = " : "k = ") << c.v);
    const Operand a = make_operand(m, k, DType::e4m3, ++seed), b = make_operand(n, k, DType::e4m3, ++seed);
    const int64_t lda = k + c.lda_pad;
    std::vector<uint8_t> a_codes(static_cast<size_t>(m * lda), 0);
    for (int64_t r = 0; r < m; ++r)
      std::copy_n(a.codes.begin() + r * k, k, a_codes.begin() + r * lda);
    DevBuf ab(a_codes.size()), bb(b.codes.size()), scales(8), db(static_cast<size_t>(m * n) * 2);
    ASSERT_TRUE(ab.p && bb.p && scales.p && db.p);
    upload(ab, a_codes);
    upload(bb, b.codes);
    put_float(scales, a.inv, 0);
    put_float(scales, b.inv, 1);
    CUDA_OK(cudaMemset(db.p, 0xFF, db.bytes));  // NaN: an unwritten element fails
    Tensor ta(ab.p, DType::e4m3, Device::cuda, {m, k}), tb(bb.p, DType::e4m3, Device::cuda, {n, k});
    ta.stride[0] = lda;
    Tensor d(db.p, DType::bf16, Device::cuda, {m, n});
    loom::ops::Fp8GemmOptions o;
    o.varying = c.dim;
    o.varying_max = most;
    const int64_t plans0 = g.plans_built();
    loom::ops::fp8_gemm(g, ta, scales.as<float>(), tb, scales.as<float>() + 1, d, o, stream_);
    CUDA_OK(cudaStreamSynchronize(stream_));
    EXPECT_EQ(g.plans_built() - plans0, c.new_plans);
    check_gemm(download_matrix(db, DType::bf16, static_cast<size_t>(m * n)), reference(a, b, m, n, k, nullptr),
               tolerance(false, DType::bf16), "varying dim");
  }
  EXPECT_EQ(loom::gemm_timing_counts().timed, timed0) << "a varying dim's plans are the heuristic's, untimed";
}

// The linear's three GEMMs as loom/ops/gemm.hpp maps them, from device casts with
// device scales (amax -> update_scales -> cast), against the fp64 linear of
// the dequantised operands: the mapping, the transposed copies and the
// hybrid formats end to end.
TEST_F(CudaFp8Gemm, LinearFpropDgradWgradFromDeviceCasts) {
  loom::ops::GemmPlans g(lt_, workspace_, loom::ops::GemmPlans::kWorkspaceBytes);
  const int64_t tokens = 256, in = 320, out = 192;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto randv = [&](int64_t nn, float sd) {
    std::vector<float> v(static_cast<size_t>(nn));
    for (float& x : v) x = round_bf16(nd(rng) * sd);
    return v;
  };
  const std::vector<float> x = randv(tokens * in, 1.0f), w = randv(out * in, 0.02f), dy = randv(tokens * out, 1e-4f);
  auto to_bf16 = [](const std::vector<float>& v) {
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = loom::hf::f32_to_bf16(v[i]);
    return h;
  };
  DevBuf xb(x.size() * 2), wb(w.size() * 2), dyb(dy.size() * 2);
  DevBuf xq(x.size()), xqt(x.size()), wq(w.size()), wqt(w.size()), dyq(dy.size()), dyqt(dy.size());
  DevBuf amax(3 * 4), scale(3 * 4), inv(3 * 4);
  DevBuf yb(static_cast<size_t>(tokens * out) * 2), dxb(static_cast<size_t>(tokens * in) * 2),
      dwb(static_cast<size_t>(out * in) * 4);
  ASSERT_TRUE(xb.p && wb.p && dyb.p && xq.p && xqt.p && wq.p && wqt.p && dyq.p && dyqt.p && amax.p && scale.p &&
              inv.p && yb.p && dxb.p && dwb.p);
  upload(xb, to_bf16(x));
  upload(wb, to_bf16(w));
  upload(dyb, to_bf16(dy));
  upload(amax, std::vector<float>(3, 0.0f));
  upload(scale, std::vector<float>(3, 1.0f));
  Tensor tx(xb.p, DType::bf16, Device::cuda, {tokens, in}), tw(wb.p, DType::bf16, Device::cuda, {out, in}),
      tdy(dyb.p, DType::bf16, Device::cuda, {tokens, out});
  // Slots 0, 1, 2 = x, w, dy of linear 0 (hybrid: dy in E5M2).
  Tensor txq(xq.p, DType::e4m3, Device::cuda, {tokens, in}), txqt(xqt.p, DType::e4m3, Device::cuda, {in, tokens});
  Tensor twq(wq.p, DType::e4m3, Device::cuda, {out, in}), twqt(wqt.p, DType::e4m3, Device::cuda, {in, out});
  Tensor tdyq(dyq.p, DType::e5m2, Device::cuda, {tokens, out}), tdyqt(dyqt.p, DType::e5m2, Device::cuda, {out, tokens});
  float* am = amax.as<float>();
  float* sc = scale.as<float>();
  float* iv = inv.as<float>();
  loom::gpu::fp8_amax(tx, am + 0, stream_);
  loom::gpu::fp8_amax(tw, am + 1, stream_);
  loom::gpu::fp8_amax(tdy, am + 2, stream_);
  loom::gpu::fp8_update_scales(am, sc, iv, 0, 3, fp8::Formats::hybrid, 0, nullptr, stream_);
  loom::gpu::fp8_cast(tx, &txq, &txqt, sc + 0, nullptr, stream_);
  loom::gpu::fp8_cast(tw, &twq, &twqt, sc + 1, nullptr, stream_);
  loom::gpu::fp8_cast(tdy, &tdyq, &tdyqt, sc + 2, nullptr, stream_);
  Tensor ty(yb.p, DType::bf16, Device::cuda, {tokens, out}), tdx(dxb.p, DType::bf16, Device::cuda, {tokens, in}),
      tdw(dwb.p, DType::f32, Device::cuda, {out, in});
  CUDA_OK(cudaMemsetAsync(yb.p, 0xFF, yb.bytes, stream_));
  CUDA_OK(cudaMemsetAsync(dxb.p, 0xFF, dxb.bytes, stream_));
  // dW accumulates onto an earlier micro-batch's value (beta = 1, in place).
  std::vector<float> dw0(static_cast<size_t>(out * in));
  for (float& v : dw0) v = nd(rng) * 1e-3f;
  upload(dwb, dw0);
  loom::ops::Fp8GemmOptions fprop, dgrad, wgrad;
  fprop.fast_accum = true;  // as TransformerEngine: fast accumulation for fprop only
  wgrad.c = &tdw;
  loom::ops::fp8_gemm(g, txq, iv + 0, twq, iv + 1, ty, fprop, stream_);      // y  = x W^T
  loom::ops::fp8_gemm(g, tdyq, iv + 2, twqt, iv + 1, tdx, dgrad, stream_);   // dx = dy W
  loom::ops::fp8_gemm(g, tdyqt, iv + 2, txqt, iv + 0, tdw, wgrad, stream_);  // dW += dy^T x
  CUDA_OK(cudaStreamSynchronize(stream_));

  // Host: the same scales (bitwise, from the host rule) and casts.
  const float amaxes[3] = {fp8::amax(x.data(), static_cast<int64_t>(x.size())),
                           fp8::amax(w.data(), static_cast<int64_t>(w.size())),
                           fp8::amax(dy.data(), static_cast<int64_t>(dy.size()))};
  const fp8::Format fmt[3] = {fp8::Format::e4m3, fp8::Format::e4m3, fp8::Format::e5m2};
  const std::vector<float> dev_scale = download<float>(scale, 3), dev_inv = download<float>(inv, 3);
  Operand ox, ow, ody;
  Operand* ops[3] = {&ox, &ow, &ody};
  const std::vector<float>* src[3] = {&x, &w, &dy};
  for (int i = 0; i < 3; ++i) {
    const float s = fp8::compute_scale(amaxes[i], fp8::max_value(fmt[i]), 0, 1.0f).scale;
    ASSERT_EQ(bits(dev_scale[static_cast<size_t>(i)]), bits(s)) << "scale of operand " << i;
    ASSERT_EQ(bits(dev_inv[static_cast<size_t>(i)]), bits(1.0f / s)) << "inverse scale of operand " << i;
    Operand& o = *ops[i];
    o.scale = s;
    o.inv = 1.0f / s;
    o.codes.resize(src[i]->size());
    fp8::quantize(src[i]->data(), static_cast<int64_t>(src[i]->size()), s, fmt[i], o.codes.data());
    o.value.resize(o.codes.size());
    for (size_t j = 0; j < o.codes.size(); ++j) o.value[j] = fp8::decode(o.codes[j], fmt[i]);
  }
  EXPECT_EQ(download<uint8_t>(xq, x.size()), ox.codes);
  EXPECT_EQ(download<uint8_t>(dyq, dy.size()), ody.codes);
  // Transposed host operands for the reference's A B^T form.
  auto transposed = [](const Operand& o, int64_t rows, int64_t cols) {
    Operand t = o;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        t.codes[static_cast<size_t>(c * rows + r)] = o.codes[static_cast<size_t>(r * cols + c)];
        t.value[static_cast<size_t>(c * rows + r)] = o.value[static_cast<size_t>(r * cols + c)];
      }
    return t;
  };
  const Operand wt = transposed(ow, out, in), dyt = transposed(ody, tokens, out), xt = transposed(ox, tokens, in);
  EXPECT_EQ(download<uint8_t>(wqt, w.size()), wt.codes);
  const Reference ry = reference(ox, ow, tokens, out, in, nullptr);
  const Reference rdx = reference(ody, wt, tokens, in, out, nullptr);
  const Reference rdw = reference(dyt, xt, out, in, tokens, &dw0);
  check_gemm(download_matrix(yb, DType::bf16, ry.d.size()), ry, tolerance(true, DType::bf16), "fprop y = x W^T");
  check_gemm(download_matrix(dxb, DType::bf16, rdx.d.size()), rdx, tolerance(false, DType::bf16), "dgrad dx = dy W");
  check_gemm(download_matrix(dwb, DType::f32, rdw.d.size()), rdw, tolerance(false, DType::f32), "wgrad dW += dy^T x");
}

// The step's FP8 work after its first call: casts with their transposed
// copies and amaxes, a scale update and the three GEMMs (fused or fallback D
// amax included) allocate nothing on the host and build no plan.
TEST_F(CudaFp8Gemm, HotPathAllocatesNothing) {
  loom_test::AllocCounter counter;
  loom::ops::GemmPlans g(lt_, workspace_, loom::ops::GemmPlans::kWorkspaceBytes);
  const int64_t tokens = 128, in = 256, out = 192;
  DevBuf xb(tokens * in * 2), wb(out * in * 2), dyb(tokens * out * 2);
  DevBuf xq(tokens * in), xqt(tokens * in), wq(out * in), wqt(out * in), dyq(tokens * out), dyqt(tokens * out);
  DevBuf yb(tokens * out * 2), dxb(tokens * in * 2), dwb(out * in * 4), sc(16), am(16), iv(16);
  ASSERT_TRUE(xb.p && wb.p && dyb.p && xq.p && xqt.p && wq.p && wqt.p && dyq.p && dyqt.p && yb.p && dxb.p &&
              dwb.p && sc.p && am.p && iv.p);
  for (const DevBuf* b : {&xb, &wb, &dyb, &dwb}) CUDA_OK(cudaMemset(b->p, 0x3C, b->bytes));  // finite bf16 / fp32
  upload(sc, std::vector<float>(4, 1.0f));
  upload(am, std::vector<float>(4, 0.0f));
  Tensor tx(xb.p, DType::bf16, Device::cuda, {tokens, in}), tw(wb.p, DType::bf16, Device::cuda, {out, in}),
      tdy(dyb.p, DType::bf16, Device::cuda, {tokens, out});
  Tensor txq(xq.p, DType::e4m3, Device::cuda, {tokens, in}), txqt(xqt.p, DType::e4m3, Device::cuda, {in, tokens});
  Tensor twq(wq.p, DType::e4m3, Device::cuda, {out, in}), twqt(wqt.p, DType::e4m3, Device::cuda, {in, out});
  Tensor tdyq(dyq.p, DType::e5m2, Device::cuda, {tokens, out}),
      tdyqt(dyqt.p, DType::e5m2, Device::cuda, {out, tokens});
  Tensor ty(yb.p, DType::bf16, Device::cuda, {tokens, out}), tdx(dxb.p, DType::bf16, Device::cuda, {tokens, in}),
      tdw(dwb.p, DType::f32, Device::cuda, {out, in});
  float* a = am.as<float>();
  float* s = sc.as<float>();
  float* v = iv.as<float>();
  loom::ops::Fp8GemmOptions fprop, dgrad, wgrad;
  fprop.fast_accum = true;
  fprop.d_amax = a + 3;
  wgrad.c = &tdw;
  auto step = [&] {
    loom::gpu::fp8_update_scales(a, s, v, 0, 3, fp8::Formats::hybrid, 0, nullptr, stream_);
    loom::gpu::fp8_cast(tx, &txq, &txqt, s + 0, a + 0, stream_);
    loom::gpu::fp8_cast(tw, &twq, &twqt, s + 1, a + 1, stream_);
    loom::gpu::fp8_cast(tdy, &tdyq, &tdyqt, s + 2, a + 2, stream_);
    loom::ops::fp8_gemm(g, txq, v + 0, twq, v + 1, ty, fprop, stream_);
    loom::ops::fp8_gemm(g, tdyq, v + 2, twqt, v + 1, tdx, dgrad, stream_);
    loom::ops::fp8_gemm(g, tdyqt, v + 2, txqt, v + 0, tdw, wgrad, stream_);
  };
  step();  // builds the plans
  CUDA_OK(cudaStreamSynchronize(stream_));
  const int64_t plans = g.plans_built();
  EXPECT_EQ(plans, 3);
  counter.start();
  for (int i = 0; i < 50; ++i) step();
  const loom_test::AllocCounts c = counter.stop();
  CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_EQ(c.ours_new, 0) << "350 FP8 calls allocated; the first allocation came from:" << c.first_ours;
  EXPECT_EQ(c.ours_delete, 0);
  EXPECT_EQ(g.plans_built(), plans);
  // The counter does see this code: a refused call formats its message.
  counter.start();
  try {
    loom::ops::fp8_gemm(g, tdyq, v + 2, tdyqt, v + 2, ty, dgrad, stream_);  // E5M2 x E5M2
  } catch (const loom::Error&) {
  }
  const loom_test::AllocCounts err = counter.stop();
  EXPECT_GT(err.ours_new, 0) << "the counting operator new does not see libloom's allocations";
}


TEST_F(CudaFp8, RmsnormWritingFp8IsTheBf16KernelThenTheCast) {
  // Against rmsnorm_forward (checked against the CPU in test_cuda_kernels)
  // then fp8_cast: codes, transposed codes, amax and rstd bitwise. Widths:
  // 16 (one warp, 2 of its threads busy), 768 (96 threads: llama-125m), 2048
  // (256 threads, one vector each: llama-1b), 4096 (two each: llama2-7b),
  // 5632 (2.75 each: threads with fewer vectors); rows 16 to 4096. Values:
  // bf16, gains around 1 with some large, a scale that saturates the
  // largest, and one row holding a NaN in one case (its whole row NaN, the
  // amax +inf).
  struct Case {
    int64_t rows, h;
  };
  const Case cases[] = {{16, 16}, {48, 768}, {4096, 2048}, {32, 4096}, {64, 5632}};
  int checked = 0;
  for (const Case& cc : cases) {
    for (DType qtype : {DType::e4m3, DType::e5m2}) {
      for (float s : {1.0f, 200.0f}) {
        const int64_t R = cc.rows, h = cc.h;
        const bool nan = cc.h == 768 && qtype == DType::e4m3 && s == 1.0f;
        SCOPED_TRACE(::testing::Message() << "[" << R << ", " << h << "] " << loom::dtype_name(qtype) << " scale " << s
                                          << (nan ? " NaN" : ""));
        std::mt19937 rng(static_cast<uint32_t>(R * 13 + h + checked));
        std::normal_distribution<float> nd(0.f, 1.f);
        std::uniform_real_distribution<float> gain(0.5f, 1.5f);
        const size_t n = static_cast<size_t>(R * h);
        std::vector<uint16_t> hx(n), hw(static_cast<size_t>(h));
        for (uint16_t& v : hx) v = loom::hf::f32_to_bf16(nd(rng) * 3.f);
        for (size_t j = 0; j < hw.size(); ++j) hw[j] = loom::hf::f32_to_bf16(j % 97 == 0 ? 40.f : gain(rng));
        if (nan) hx[static_cast<size_t>(7 * h + 3)] = 0x7FC0;
        DevBuf xb(n * 2), wb(hw.size() * 2), mid(n * 2), r_ref(R * 4), r_got(R * 4), sb(4), ab(8);
        DevBuf q(n), qt(n), want_q(n), want_qt(n);
        ASSERT_TRUE(xb.p && wb.p && mid.p && r_ref.p && r_got.p && sb.p && ab.p && q.p && qt.p && want_q.p &&
                    want_qt.p);
        upload(xb, hx);
        upload(wb, hw);
        put_float(sb, s);
        put_float(ab, 0.0f);
        put_float(ab, 0.0f, 1);
        for (const DevBuf* b : {&q, &qt, &want_q, &want_qt}) CUDA_OK(cudaMemset(b->p, 0xAA, n));
        CUDA_OK(cudaMemset(r_got.p, 0xFF, R * 4));
        const Tensor x(xb.p, DType::bf16, Device::cuda, {R, h}), w(wb.p, DType::bf16, Device::cuda, {h});
        Tensor m(mid.p, DType::bf16, Device::cuda, {R, h});
        Tensor rr(r_ref.p, DType::f32, Device::cuda, {R}), rg(r_got.p, DType::f32, Device::cuda, {R});
        Tensor tq(q.p, qtype, Device::cuda, {R, h}), tqt(qt.p, qtype, Device::cuda, {h, R});
        Tensor wq(want_q.p, qtype, Device::cuda, {R, h}), wqt(want_qt.p, qtype, Device::cuda, {h, R});
        loom::gpu::rmsnorm_forward(m, rr, x, w, 1e-5f, stream_);
        loom::gpu::fp8_cast(m, &wq, &wqt, sb.as<float>(), ab.as<float>() + 1, stream_);
        loom::gpu::rmsnorm_forward_fp8(tq, tqt, rg, x, w, 1e-5f, sb.as<float>(), ab.as<float>(), stream_);
        CUDA_OK(cudaStreamSynchronize(stream_));
        EXPECT_TRUE(download<uint8_t>(q, n) == download<uint8_t>(want_q, n)) << "q";
        EXPECT_TRUE(download<uint8_t>(qt, n) == download<uint8_t>(want_qt, n)) << "q_t";
        const std::vector<float> a = download<float>(r_ref, R), b = download<float>(r_got, R);
        size_t bad = 0;
        for (size_t i = 0; i < a.size(); ++i)
          if (bits(a[i]) != bits(b[i]) && bad++ < 4) ADD_FAILURE() << "rstd[" << i << "] " << b[i] << " vs " << a[i];
        EXPECT_EQ(bad, 0u);
        EXPECT_EQ(bits(get_float(ab, 0)), bits(get_float(ab, 1))) << "amax " << get_float(ab, 0);
        if (nan) EXPECT_EQ(get_float(ab, 0), kInf);
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 5 * 2 * 2);
}

// ---- SwiGLU writing FP8 ------------------------------------------------------------

struct SwigluFp8Case {
  int64_t rows, f;
  bool packed;  // gate and up the halves of one [rows, 2f] buffer (the fused block's), else two [rows, f] tensors
};

TEST_F(CudaFp8, SwigluWritingFp8IsTheBf16KernelThenTheCast) {
  // Against the pair it replaces on the device (both checked elsewhere:
  // SwiGLU against the CPU in test_cuda_kernels, the cast against the host
  // encode above): swiglu_forward into bf16 then fp8_cast into q and q_t, and
  // swiglu_backward into the packed [dgate, dup] then fp8_cast. Bitwise,
  // codes and amax. Shapes: one whole tile; partial tiles both ways (rows 144
  // = 128 + 16, f 80 = 64 + 16); the smallest ([16, 16]); llama-1b's f at a
  // few row tiles; more tiles (64 x 32) than the kernel has resident blocks,
  // so blocks loop. Values: bf16, |gate| up to 8, a scale that saturates the
  // largest, one NaN in one case (its amax +inf).
  const SwigluFp8Case cases[] = {{128, 64, true},   {144, 80, true},    {16, 16, false},
                                 {256, 5632, true}, {8192, 2048, true}, {48, 272, false}};
  int checked = 0;
  for (const SwigluFp8Case& cc : cases) {
    for (DType qtype : {DType::e4m3, DType::e5m2}) {
      for (float s : {1.0f, 60.0f}) {
        const int64_t R = cc.rows, f = cc.f, ldg = cc.packed ? 2 * f : f;
        const bool nan = cc.rows == 144 && qtype == DType::e5m2;
        SCOPED_TRACE(::testing::Message() << "[" << R << ", " << f << "] " << (cc.packed ? "packed" : "separate") << " "
                                          << loom::dtype_name(qtype) << " scale " << s << (nan ? " NaN" : ""));
        std::mt19937 rng(static_cast<uint32_t>(R * 31 + f + checked));
        std::uniform_real_distribution<float> wide(-8.f, 8.f), narrow(-2.f, 2.f);
        const size_t nf = static_cast<size_t>(R * f);
        std::vector<uint16_t> hg(static_cast<size_t>(R * ldg)), hu(hg.size()), hd(nf);
        for (uint16_t& x : hg) x = loom::hf::f32_to_bf16(wide(rng));
        for (uint16_t& x : hu) x = loom::hf::f32_to_bf16(narrow(rng));
        for (uint16_t& x : hd) x = loom::hf::f32_to_bf16(narrow(rng));
        if (nan) hg[static_cast<size_t>(5 * ldg + 7)] = 0x7FC0;
        // gate: [R, ldg]; up: its second half (packed) or its own buffer.
        DevBuf gb(hg.size() * 2), ub(hu.size() * 2), db(nf * 2), mid(2 * nf * 2), sb(4), ab(16);
        DevBuf q(2 * nf), qt(2 * nf), want_q(2 * nf), want_qt(2 * nf);
        ASSERT_TRUE(gb.p && ub.p && db.p && mid.p && sb.p && ab.p && q.p && qt.p && want_q.p && want_qt.p);
        upload(gb, hg);
        upload(ub, hu);
        upload(db, hd);
        put_float(sb, s);
        for (size_t i = 0; i < 4; ++i) put_float(ab, 0.0f, i);
        Tensor gate(gb.p, DType::bf16, Device::cuda, {R, f}), up = gate;
        gate.stride[0] = up.stride[0] = ldg;
        up.data = cc.packed ? static_cast<void*>(gb.as<uint16_t>() + f) : ub.p;
        const Tensor dout(db.p, DType::bf16, Device::cuda, {R, f});
        const float* scale = sb.as<float>();
        float* amax = ab.as<float>();
        for (int backward = 0; backward < 2; ++backward) {
          const int64_t cols = backward ? 2 * f : f;
          const size_t n = static_cast<size_t>(R * cols);
          for (const DevBuf* b : {&q, &qt, &want_q, &want_qt}) CUDA_OK(cudaMemset(b->p, 0xAA, 2 * nf));
          Tensor tq(q.p, qtype, Device::cuda, {R, cols}), tqt(qt.p, qtype, Device::cuda, {cols, R});
          Tensor wq(want_q.p, qtype, Device::cuda, {R, cols}), wqt(want_qt.p, qtype, Device::cuda, {cols, R});
          Tensor m(mid.p, DType::bf16, Device::cuda, {R, cols});
          if (backward) {
            Tensor dg = m, du = m;
            dg.shape[1] = du.shape[1] = f;
            du.data = mid.as<uint16_t>() + f;
            loom::gpu::swiglu_backward(dg, du, dout, gate, up, stream_);
            loom::gpu::swiglu_backward_fp8(tq, tqt, dout, gate, up, scale, amax + 2, stream_);
          } else {
            loom::gpu::swiglu_forward(m, gate, up, stream_);
            loom::gpu::swiglu_forward_fp8(tq, tqt, gate, up, scale, amax, stream_);
          }
          loom::gpu::fp8_cast(m, &wq, &wqt, scale, amax + 2 * backward + 1, stream_);
          CUDA_OK(cudaStreamSynchronize(stream_));
          const char* what = backward ? "backward" : "forward";
          const std::vector<uint8_t> got = download<uint8_t>(q, n), want = download<uint8_t>(want_q, n);
          const std::vector<uint8_t> got_t = download<uint8_t>(qt, n), want_t = download<uint8_t>(want_qt, n);
          size_t bad = 0, bad_t = 0;
          for (size_t i = 0; i < n; ++i) {
            if (got[i] != want[i] && bad++ < 4)
              ADD_FAILURE() << what << " q[" << i / cols << ", " << i % cols << "] = 0x" << std::hex << int(got[i])
                            << ", the cast's 0x" << int(want[i]) << std::dec;
            if (got_t[i] != want_t[i] && bad_t++ < 4)
              ADD_FAILURE() << what << " q_t[" << i / R << ", " << i % R << "] = 0x" << std::hex << int(got_t[i])
                            << ", the cast's 0x" << int(want_t[i]) << std::dec;
          }
          EXPECT_EQ(bad, 0u) << what;
          EXPECT_EQ(bad_t, 0u) << what;
          const float a = get_float(ab, 2 * backward), a_cast = get_float(ab, 2 * backward + 1);
          EXPECT_EQ(bits(a), bits(a_cast)) << what << " amax " << a << ", the cast's " << a_cast;
          EXPECT_GT(a, 0.0f) << what;
          if (nan) EXPECT_EQ(a, kInf) << what << ": a NaN counts as +inf";
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 6 * 2 * 2 * 2);
}

// ---- RMSNorm and SwiGLU writing xᵀ alone (Fp8RecastOperand) --------------------

TEST_F(CudaFp8, NormAndSwigluWriteTheTransposeAloneWhenQIsEmpty) {
  // Selective recompute's backward: rmsnorm_forward_fp8 and
  // swiglu_forward_fp8 with an empty q write q_t (and rstd) bitwise as the
  // call with q does, and nothing else. Shapes with whole and partial tiles
  // (rows 144 = 128 + 16, columns 80 = 64 + 16), llama-1b's widths; E4M3.
  struct Case {
    int64_t rows, cols;
  };
  const Case cases[] = {{128, 64}, {144, 80}, {2048, 2048}, {256, 5632}};
  int checked = 0;
  for (const Case& cc : cases) {
    for (int op = 0; op < 2; ++op) {  // rmsnorm, swiglu forward
      const int64_t R = cc.rows, C = cc.cols;
      SCOPED_TRACE(::testing::Message() << (op == 0 ? "rmsnorm_forward_fp8" : "swiglu_forward_fp8") << " [" << R
                                        << ", " << C << "]");
      std::mt19937 rng(static_cast<uint32_t>(R * 5 + C + op));
      std::normal_distribution<float> nd(0.f, 2.f);
      const size_t n = static_cast<size_t>(R * C);
      std::vector<uint16_t> ha(2 * n), hw(static_cast<size_t>(C));
      for (uint16_t& v : ha) v = loom::hf::f32_to_bf16(nd(rng));
      for (uint16_t& v : hw) v = loom::hf::f32_to_bf16(1.0f + 0.1f * nd(rng));
      DevBuf ab_(ha.size() * 2), wb(hw.size() * 2), sb(4), q(n), qt_ref(n), qt_got(n), r1(R * 4), r2(R * 4);
      ASSERT_TRUE(ab_.p && wb.p && sb.p && q.p && qt_ref.p && qt_got.p && r1.p && r2.p);
      upload(ab_, ha);
      upload(wb, hw);
      put_float(sb, 4.0f);
      CUDA_OK(cudaMemset(qt_ref.p, 0xAA, n));
      CUDA_OK(cudaMemset(qt_got.p, 0x55, n));
      const Tensor none;
      Tensor tq(q.p, DType::e4m3, Device::cuda, {R, C});
      Tensor tref(qt_ref.p, DType::e4m3, Device::cuda, {C, R}), tgot(qt_got.p, DType::e4m3, Device::cuda, {C, R});
      const float* scale = sb.as<float>();
      if (op == 0) {
        const Tensor x(ab_.p, DType::bf16, Device::cuda, {R, C}), w(wb.p, DType::bf16, Device::cuda, {C});
        Tensor rs1(r1.p, DType::f32, Device::cuda, {R}), rs2(r2.p, DType::f32, Device::cuda, {R});
        loom::gpu::rmsnorm_forward_fp8(tq, tref, rs1, x, w, 1e-5f, scale, nullptr, stream_);
        loom::gpu::rmsnorm_forward_fp8(none, tgot, rs2, x, w, 1e-5f, scale, nullptr, stream_);
        CUDA_OK(cudaStreamSynchronize(stream_));
        EXPECT_TRUE(download<uint8_t>(r1, R * 4) == download<uint8_t>(r2, R * 4)) << "rstd";
      } else {
        Tensor gate(ab_.p, DType::bf16, Device::cuda, {R, C}), up = gate;
        gate.stride[0] = up.stride[0] = 2 * C;
        up.data = ab_.as<uint16_t>() + C;
        loom::gpu::swiglu_forward_fp8(tq, tref, gate, up, scale, nullptr, stream_);
        loom::gpu::swiglu_forward_fp8(none, tgot, gate, up, scale, nullptr, stream_);
        CUDA_OK(cudaStreamSynchronize(stream_));
      }
      EXPECT_TRUE(download<uint8_t>(qt_got, n) == download<uint8_t>(qt_ref, n)) << "q_t";
      ++checked;
    }
  }
  EXPECT_EQ(checked, 4 * 2);
}

// ---- RMSNorm and SwiGLU measuring what they write (Fp8OperandAmax) ------------

TEST_F(CudaFp8, NormAndSwigluMeasureWhatTheyWrite) {
  // precision.producer_amax: rmsnorm_forward, swiglu_forward and
  // swiglu_backward given an amax write the same bits as without one and
  // max-accumulate into it exactly what fp8_amax (the recipe's own measure)
  // reads from their output, NaN as +inf. Shapes: the packed path (widths
  // multiples of 8: 2048, 4096, a [rows, 2f] gate_up buffer's halves) and the
  // scalar path (h 100, f 37, separate gate and up), rows from 16 to 4096;
  // bf16 and fp32. An amax already larger than the tensor's stays as it is
  // (unless the tensor holds a NaN: +inf is larger).
  struct Case {
    int64_t rows, width;
    DType dt;
    bool packed;  // SwiGLU: gate and up the halves of one [rows, 2f] buffer
  };
  const Case cases[] = {{4096, 2048, DType::bf16, true}, {64, 4096, DType::bf16, true}, {48, 100, DType::bf16, false},
                        {16, 37, DType::bf16, false},    {32, 96, DType::f32, true},    {24, 37, DType::f32, false}};
  int checked = 0;
  for (const Case& cc : cases) {
    const int64_t R = cc.rows, h = cc.width, es = static_cast<int64_t>(loom::dtype_size(cc.dt));
    std::mt19937 rng(static_cast<uint32_t>(R * 7 + h));
    std::normal_distribution<float> nd(0.f, 2.f);
    // Host values of the dtype, as raw bytes.
    auto values = [&](size_t n, bool nan_at_3) {
      std::vector<uint8_t> b(n * static_cast<size_t>(es));
      for (size_t i = 0; i < n; ++i) {
        float v = nd(rng);
        if (nan_at_3 && i == 3) v = std::nanf("");
        if (cc.dt == DType::bf16) {
          const uint16_t x = loom::hf::f32_to_bf16(v);
          std::memcpy(b.data() + 2 * i, &x, 2);
        } else {
          std::memcpy(b.data() + 4 * i, &v, 4);
        }
      }
      return b;
    };
    for (int nan = 0; nan < 2; ++nan) {
      for (int op = 0; op < 3; ++op) {  // rmsnorm, swiglu forward, swiglu backward
        const char* what = op == 0 ? "rmsnorm_forward" : op == 1 ? "swiglu_forward" : "swiglu_backward";
        SCOPED_TRACE(::testing::Message() << what << " [" << R << ", " << h << "] " << loom::dtype_name(cc.dt)
                                          << (cc.packed ? " packed" : "") << (nan ? " NaN" : ""));
        const int64_t ld = cc.packed ? 2 * h : h;
        const size_t nout = static_cast<size_t>(R * h * (op == 2 ? 2 : 1));
        DevBuf in_a(static_cast<size_t>(R * ld * es)), in_b(static_cast<size_t>(R * ld * es)),
            in_d(static_cast<size_t>(R * h * es)), out_ref(nout * es), out_got(nout * es), r1(R * 4), r2(R * 4),
            ab(12);
        ASSERT_TRUE(in_a.p && in_b.p && in_d.p && out_ref.p && out_got.p && r1.p && r2.p && ab.p);
        upload(in_a, values(static_cast<size_t>(R * ld), nan != 0));
        upload(in_b, values(static_cast<size_t>(R * ld), false));
        upload(in_d, values(static_cast<size_t>(R * h), false));
        CUDA_OK(cudaMemset(out_ref.p, 0xAA, nout * es));
        CUDA_OK(cudaMemset(out_got.p, 0x55, nout * es));
        put_float(ab, 0.0f, 0);  // the kernel's
        put_float(ab, 0.0f, 1);  // fp8_amax's of the same output
        put_float(ab, 1e30f, 2);  // larger than anything here
        float* amax = ab.as<float>();
        auto out = [&](DevBuf& b, int64_t cols, int64_t off) {
          Tensor t(static_cast<char*>(b.p) + off * es, cc.dt, Device::cuda, {R, cols});
          t.stride[0] = op == 2 ? 2 * h : cols;
          return t;
        };
        if (op == 0) {
          const Tensor x(in_a.p, cc.dt, Device::cuda, {R, h}), w(in_b.p, cc.dt, Device::cuda, {h});
          Tensor ref = out(out_ref, h, 0), got = out(out_got, h, 0), got2 = got;
          Tensor rs1(r1.p, DType::f32, Device::cuda, {R}), rs2(r2.p, DType::f32, Device::cuda, {R});
          loom::gpu::rmsnorm_forward(ref, rs1, x, w, 1e-5f, stream_);
          loom::gpu::rmsnorm_forward(got, rs2, x, w, 1e-5f, stream_, amax);
          loom::gpu::rmsnorm_forward(got2, rs2, x, w, 1e-5f, stream_, amax + 2);
        } else {
          Tensor gate(in_a.p, cc.dt, Device::cuda, {R, h}), up = gate;
          gate.stride[0] = up.stride[0] = ld;
          up.data = cc.packed ? static_cast<void*>(static_cast<char*>(in_a.p) + h * es) : in_b.p;
          if (op == 1) {
            Tensor ref = out(out_ref, h, 0), got = out(out_got, h, 0);
            loom::gpu::swiglu_forward(ref, gate, up, stream_);
            loom::gpu::swiglu_forward(got, gate, up, stream_, amax);
            loom::gpu::swiglu_forward(got, gate, up, stream_, amax + 2);
          } else {
            const Tensor dout(in_d.p, cc.dt, Device::cuda, {R, h});
            Tensor rg = out(out_ref, h, 0), ru = out(out_ref, h, h), gg = out(out_got, h, 0), gu = out(out_got, h, h);
            loom::gpu::swiglu_backward(rg, ru, dout, gate, up, stream_);
            loom::gpu::swiglu_backward(gg, gu, dout, gate, up, stream_, amax);
            loom::gpu::swiglu_backward(gg, gu, dout, gate, up, stream_, amax + 2);
          }
        }
        const Tensor whole(out_got.p, cc.dt, Device::cuda, {R, static_cast<int64_t>(nout) / R});
        loom::gpu::fp8_amax(whole, amax + 1, stream_);
        CUDA_OK(cudaStreamSynchronize(stream_));
        EXPECT_TRUE(download<uint8_t>(out_got, nout * es) == download<uint8_t>(out_ref, nout * es))
            << "the output differs from the kernel's without an amax";
        const float a = get_float(ab, 0), want = get_float(ab, 1);
        EXPECT_EQ(bits(a), bits(want)) << "amax " << a << ", fp8_amax of the output " << want;
        EXPECT_GT(a, 0.0f);
        if (nan) EXPECT_EQ(a, kInf) << "a NaN (in x or gate) counts as +inf";
        // A larger amax stays; +inf (a NaN) is larger than any.
        EXPECT_EQ(get_float(ab, 2), nan ? kInf : 1e30f) << "max-accumulated, not written";
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 6 * 2 * 3);
}
}  // namespace

#else  // !LOOM_HAVE_CUDA

TEST(CudaFp8, SkippedWithoutCuda) { GTEST_SKIP() << "loom built without CUDA: no FP8 device kernels or GEMMs"; }

#endif
