// The CUDA backend against the fp32 CPU reference kernels (kernels/cpu), op by
// op: fresh random inputs per test, the CPU kernel on host fp32 data, the CUDA
// backend on device data, compared by ||gpu - cpu|| / ||cpu||:
//   fp32 path  <= 1e-5
//   bf16 path  <= 1e-2, against the CPU kernel fed the bf16-rounded inputs.
// Every output is poisoned with NaN (0xFF bytes: NaN in fp32 and bf16) before
// the call, so an element a kernel forgets to write fails the comparison.
// Shapes are chosen off the packed-vector widths (h = 96 + 8, odd N, odd
// lengths) so the scalar tails and fallbacks run too; accumulate semantics
// (dw, dwte, dx pre-filled with random values) and determinism (bitwise equal
// reruns) are checked where the contract promises them. The asynchronous
// step's ops (sum_into, clip_scale, adamw with device scalars, upload_async,
// the timer ring) are also checked for never waiting: host_syncs() must not
// move across them, and moves by one for each blocking call.
// Without a GPU every test skips; built without CUDA the suite is one skip.
#include <gtest/gtest.h>

#ifdef LOOM_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "config/run_config.hpp"
#include "gpu_test_util.hpp"
#include "hf/safetensors.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "loom/arena.hpp"
#include "loom/ops/backend.hpp"

namespace loom {
namespace {

constexpr double kTolF32 = 1e-5;
constexpr double kTolBF16 = 1e-2;

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(cudaGetLastError())

std::vector<float> rnd(size_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

float round_bf16(float x) { return hf::bf16_to_f32(hf::f32_to_bf16(x)); }

// The values a tensor of dtype t can hold: bf16 inputs are rounded on the
// host so that the CPU reference sees exactly what the GPU sees.
std::vector<float> as_dtype(std::vector<float> v, DType t) {
  if (t == DType::bf16)
    for (auto& x : v) x = round_bf16(x);
  return v;
}

// ||got - want|| / ||want||; any non-finite value in `got` (a poisoned,
// unwritten element) makes it infinite.
double rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  EXPECT_EQ(got.size(), want.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double tol(DType t) { return t == DType::bf16 ? kTolBF16 : kTolF32; }

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    LOOM_REQUIRE_GPU();
    be_ = make_cuda_backend(0, false);
    ASSERT_EQ(be_->device(), Device::cuda);
    ASSERT_NE(be_->ctx().stream, nullptr);
    ASSERT_NE(be_->ctx().blas_handle, nullptr);
  }
  void TearDown() override {
    if (be_) be_->synchronize();
    for (void* p : allocs_) cudaFree(p);
  }

  // A device tensor, poisoned with NaN.
  Tensor make(DType t, std::vector<int64_t> dims) {
    Tensor x;
    x.dtype = t;
    x.device = Device::cuda;
    x.ndim = static_cast<int>(dims.size());
    for (size_t i = 0; i < dims.size(); ++i) x.shape[i] = dims[i];
    x.set_contiguous();
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(x.bytes(), 16)), cudaSuccess);
    allocs_.push_back(p);
    x.data = p;
    poison(x);
    return x;
  }
  void poison(const Tensor& x) {
    be_->synchronize();
    EXPECT_EQ(cudaMemset(x.data, 0xFF, x.bytes()), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  // Host fp32 values stored as dtype t (rounded to nearest even for bf16).
  Tensor put(const std::vector<float>& host, DType t, std::vector<int64_t> dims) {
    Tensor x = make(t, std::move(dims));
    EXPECT_EQ(static_cast<size_t>(x.numel()), host.size());
    if (t == DType::f32) {
      be_->upload(x, host.data(), host.size() * 4);
    } else {
      std::vector<uint16_t> b(host.size());
      for (size_t i = 0; i < host.size(); ++i) b[i] = hf::f32_to_bf16(host[i]);
      be_->upload(x, b.data(), b.size() * 2);
    }
    return x;
  }
  Tensor put_i32(const std::vector<int32_t>& host) {
    Tensor x = make(DType::i32, {static_cast<int64_t>(host.size())});
    be_->upload(x, host.data(), host.size() * 4);
    return x;
  }
  std::vector<float> get(const Tensor& x) {
    std::vector<float> out(static_cast<size_t>(x.numel()));
    if (x.dtype == DType::f32) {
      be_->download(out.data(), x, out.size() * 4);
    } else {
      EXPECT_EQ(x.dtype, DType::bf16);
      std::vector<uint16_t> b(out.size());
      be_->download(b.data(), x, b.size() * 2);
      for (size_t i = 0; i < b.size(); ++i) out[i] = hf::bf16_to_f32(b[i]);
    }
    return out;
  }
  std::vector<uint8_t> get_bytes(const Tensor& x) {
    std::vector<uint8_t> out(x.bytes());
    be_->download(out.data(), x, out.size());
    return out;
  }
  // f64 device vectors (the step scalars).
  Tensor put_f64(const std::vector<double>& host) {
    Tensor x = make(DType::f64, {static_cast<int64_t>(host.size())});
    be_->upload(x, host.data(), host.size() * sizeof(double));
    return x;
  }
  std::vector<double> get_f64(const Tensor& x) {
    EXPECT_EQ(x.dtype, DType::f64);
    std::vector<double> out(static_cast<size_t>(x.numel()));
    be_->download(out.data(), x, out.size() * sizeof(double));
    return out;
  }

  std::unique_ptr<Backend> be_;
  std::vector<void*> allocs_;
};

// (activation = param, grad) dtypes of backend.hpp.
struct Recipe {
  DType act, grad;
};
const Recipe kRecipes[] = {{DType::f32, DType::f32}, {DType::bf16, DType::f32}, {DType::bf16, DType::bf16}};

std::string name(const Recipe& r) { return cat("act=", dtype_name(r.act), " grad=", dtype_name(r.grad)); }

// A view of `base` starting `offset` elements in, with explicit shape and
// element strides (row views into fused buffers).
Tensor strided(const Tensor& base, int64_t offset, std::vector<int64_t> dims, std::vector<int64_t> strides) {
  Tensor v = base;
  v.data = static_cast<char*>(base.data) + offset * static_cast<int64_t>(dtype_size(base.dtype));
  v.ndim = static_cast<int>(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    v.shape[i] = dims[i];
    v.stride[i] = strides[i];
  }
  return v;
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof(double)) == 0; }

// ---- memory ops -----------------------------------------------------------------

TEST_F(CudaKernels, UploadDownloadZeroCopy) {
  const auto a = rnd(1001, 1);
  Tensor x = put(a, DType::f32, {1001});
  EXPECT_EQ(get(x), a);
  Tensor y = make(DType::f32, {1001});
  be_->copy(y, x);
  EXPECT_EQ(get(y), a);
  be_->zero(x);
  for (float v : get(x)) ASSERT_EQ(v, 0.f);
  EXPECT_GT(be_->device_memory_used(), 0u);
  be_->timer_start();
  be_->scale(y, 2.f);
  const double ms = be_->timer_stop_ms();
  EXPECT_GE(ms, 0.0);
}

TEST_F(CudaKernels, DeviceArenaIsOneZeroedAllocation) {
  ArenaPlan plan;
  const size_t b0 = plan.add("a", MemCategory::params, 1000 * 4);
  const size_t b1 = plan.add("b", MemCategory::grads, 333 * 2);
  Arena arena;
  arena.allocate(plan, Device::cuda);
  EXPECT_EQ(arena.device(), Device::cuda);
  Tensor a = arena.tensor(b0, DType::f32, {1000});
  Tensor b = arena.tensor(b1, DType::bf16, {333});
  EXPECT_EQ(a.device, Device::cuda);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data) % ArenaPlan::kAlign, 0u);
  for (float v : get(a)) ASSERT_EQ(v, 0.f);
  for (float v : get(b)) ASSERT_EQ(v, 0.f);
  const auto h = rnd(1000, 2);
  be_->upload(a, h.data(), h.size() * 4);
  EXPECT_EQ(get(a), h);
}

// ---- embedding --------------------------------------------------------------------

TEST_F(CudaKernels, EmbeddingForwardBackward) {
  uint32_t seed = 100;
  for (const Recipe& r : kRecipes) {
    for (int64_t h : {104, 128}) {
      SCOPED_TRACE(name(r) + cat(" h=", h));
      const int64_t V = 150, N = 37;  // V spans two full 64-row blocks and a partial one
      std::vector<int32_t> tok(N);
      std::mt19937 gen(seed++);
      for (auto& t : tok) t = static_cast<int32_t>(gen() % 12 == 0 ? gen() % V : gen() % 5);  // many repeats
      tok[N - 1] = static_cast<int32_t>(V - 1);
      const auto wte = as_dtype(rnd(V * h, seed++), r.act);
      Tensor d_tok = put_i32(tok), d_wte = put(wte, r.act, {V, h});
      Tensor out = make(r.act, {N, h});
      be_->embedding_forward(out, d_tok, d_wte);
      std::vector<float> ref(N * h);
      cpu::embedding_forward(ref.data(), tok.data(), wte.data(), N, h);
      EXPECT_LE(rel_err(get(out), ref), tol(r.act));

      const auto dout = as_dtype(rnd(N * h, seed++), r.act);
      const auto dw0 = as_dtype(rnd(V * h, seed++), r.grad);  // accumulated into
      Tensor d_dout = put(dout, r.act, {N, h}), dwte = put(dw0, r.grad, {V, h});
      be_->embedding_backward(dwte, d_dout, d_tok);
      std::vector<float> dref = dw0;
      cpu::embedding_backward(dref.data(), dout.data(), tok.data(), N, h);
      EXPECT_LE(rel_err(get(dwte), dref), tol(r.grad));
      // The part that is not the pre-fill: catches a kernel that drops the sum.
      std::vector<float> got = get(dwte), delta_got(got.size()), delta_ref(got.size());
      for (size_t i = 0; i < got.size(); ++i) {
        delta_got[i] = got[i] - dw0[i];
        delta_ref[i] = dref[i] - dw0[i];
      }
      EXPECT_LE(rel_err(delta_got, delta_ref), r.grad == DType::bf16 ? 5e-2 : 1e-5);
    }
  }
}

// More matches than the kernel stages at once (2048): several flushes, and
// a token hit thousands of times. Also bitwise determinism.
TEST_F(CudaKernels, EmbeddingBackwardManyRepeatsDeterministic) {
  const int64_t V = 70, h = 64, N = 5001;
  std::vector<int32_t> tok(N);
  std::mt19937 gen(7);
  for (auto& t : tok) t = static_cast<int32_t>(gen() % 3 == 0 ? 69 : gen() % 4);
  const auto dout = rnd(N * h, 8);
  const auto dw0 = rnd(V * h, 9);
  Tensor d_tok = put_i32(tok), d_dout = put(dout, DType::f32, {N, h});
  Tensor a = put(dw0, DType::f32, {V, h}), b = put(dw0, DType::f32, {V, h});
  be_->embedding_backward(a, d_dout, d_tok);
  be_->embedding_backward(b, d_dout, d_tok);
  std::vector<float> ref = dw0;
  cpu::embedding_backward(ref.data(), dout.data(), tok.data(), N, h);
  EXPECT_LE(rel_err(get(a), ref), kTolF32);
  EXPECT_EQ(get_bytes(a), get_bytes(b));
}

TEST_F(CudaKernels, EmbeddingOutOfRangeTokensAreNotRead) {
  const int64_t V = 10, h = 16, N = 3;
  const std::vector<int32_t> tok = {2, 10, -1};
  const auto wte = rnd(V * h, 11);
  Tensor d_tok = put_i32(tok), d_wte = put(wte, DType::f32, {V, h});
  Tensor out = make(DType::f32, {N, h});
  be_->embedding_forward(out, d_tok, d_wte);
  const auto o = get(out);
  for (int64_t j = 0; j < h; ++j) {
    EXPECT_EQ(o[j], wte[2 * h + j]);
    EXPECT_TRUE(std::isnan(o[h + j]));  // out of range: NaN, not another row
    EXPECT_TRUE(std::isnan(o[2 * h + j]));
  }
  const auto dw0 = rnd(V * h, 12);
  Tensor dwte = put(dw0, DType::f32, {V, h});
  Tensor dout = put(rnd(N * h, 13), DType::f32, {N, h});
  be_->embedding_backward(dwte, dout, d_tok);
  const auto got = get(dwte);
  for (int64_t v = 0; v < V; ++v)
    for (int64_t j = 0; j < h; ++j)
      if (v != 2) {
        ASSERT_EQ(got[v * h + j], dw0[v * h + j]) << "row " << v;
      }
}

// ---- rmsnorm ----------------------------------------------------------------------

TEST_F(CudaKernels, RmsnormForward) {
  uint32_t seed = 200;
  for (DType t : {DType::f32, DType::bf16}) {
    for (int64_t h : {104, 256, 33}) {
      SCOPED_TRACE(cat(dtype_name(t), " h=", h));
      const int64_t N = 37;
      const auto x = as_dtype(rnd(N * h, seed++, -2, 2), t);
      const auto w = as_dtype(rnd(h, seed++, 0.5f, 1.5f), t);
      Tensor dx = put(x, t, {N, h}), dw = put(w, t, {h});
      Tensor out = make(t, {N, h}), rstd = make(DType::f32, {N});
      be_->rmsnorm_forward(out, rstd, dx, dw, 1e-5f);
      std::vector<float> ref(N * h), rref(N);
      cpu::rmsnorm_forward(ref.data(), rref.data(), x.data(), w.data(), N, h, 1e-5f);
      EXPECT_LE(rel_err(get(out), ref), tol(t));
      EXPECT_LE(rel_err(get(rstd), rref), kTolF32);  // rstd is fp32 on every path
    }
  }
}

// Shapes that take each path of the backward: the one-pass kernel (4096 rows
// or more) two rows at a time (h = 104), one row at a time with 2 and 3
// packed vectors a thread (h = 2056 in bf16 and fp32), its chunks of 5 rows
// with a short last one (4099 rows); the general path for fewer rows (37,
// 301, several dw chunks), for rows too wide for the one pass (h = 8200) and
// for rows that cannot be packed (h = 33).
TEST_F(CudaKernels, RmsnormBackwardAccumulatesAndIsDeterministic) {
  uint32_t seed = 300;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{37, 104}, {301, 104}, {4099, 104}, {301, 2056},
                                                           {4099, 2056}, {301, 8200}, {301, 33}};
  for (const Recipe& r : kRecipes) {
    for (auto [N, h] : shapes) {
      SCOPED_TRACE(name(r) + cat(" N=", N, " h=", h));
      const auto x = as_dtype(rnd(N * h, seed++, -2, 2), r.act);
      const auto w = as_dtype(rnd(h, seed++, 0.5f, 1.5f), r.act);
      const auto dy = as_dtype(rnd(N * h, seed++), r.act);
      const auto dx0 = as_dtype(rnd(N * h, seed++), r.act);
      const auto dw0 = as_dtype(rnd(h, seed++), r.grad);
      std::vector<float> out(N * h), rstd(N);
      cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, h, 1e-5f);
      std::vector<float> dx_ref = dx0, dw_ref = dw0;
      cpu::rmsnorm_backward(dx_ref.data(), dw_ref.data(), dy.data(), x.data(), w.data(), rstd.data(), N, h);

      Tensor d_x = put(x, r.act, {N, h}), d_w = put(w, r.act, {h}), d_dy = put(dy, r.act, {N, h});
      Tensor d_rstd = put(rstd, DType::f32, {N});
      Tensor d_dx = put(dx0, r.act, {N, h}), d_dw = put(dw0, r.grad, {h});
      be_->rmsnorm_backward(d_dx, d_dw, d_dy, d_x, d_w, d_rstd);
      EXPECT_LE(rel_err(get(d_dx), dx_ref), tol(r.act));
      EXPECT_LE(rel_err(get(d_dw), dw_ref), tol(r.grad));

      // Same inputs again: bitwise the same dx and dw.
      Tensor d_dx2 = put(dx0, r.act, {N, h}), d_dw2 = put(dw0, r.grad, {h});
      be_->rmsnorm_backward(d_dx2, d_dw2, d_dy, d_x, d_w, d_rstd);
      EXPECT_EQ(get_bytes(d_dx2), get_bytes(d_dx));
      EXPECT_EQ(get_bytes(d_dw2), get_bytes(d_dw));
    }
  }
}

// ---- rope -------------------------------------------------------------------------

TEST_F(CudaKernels, RopeForwardBackwardContiguousAndStrided) {
  uint32_t seed = 400;
  for (DType t : {DType::f32, DType::bf16}) {
    for (int64_t D : {16, 64, 6}) {
      SCOPED_TRACE(cat(dtype_name(t), " D=", D));
      const int64_t B = 2, S = 300, nh = 3, nkv = 1;
      // A fused QKV buffer [B, S, (nh + 2 nkv) D]; q is the strided view of
      // its first nh * D columns, k the next nkv * D.
      const int64_t row = (nh + 2 * nkv) * D;
      const auto buf = as_dtype(rnd(B * S * row, seed++), t);
      Tensor d_buf = put(buf, t, {B * S * row});
      Tensor q = d_buf;
      q.ndim = 4;
      q.shape = {B, S, nh, D};
      q.stride = {S * row, row, D, 1};
      Tensor k = q;
      k.data = static_cast<char*>(d_buf.data) + nh * D * dtype_size(t);
      k.shape = {B, S, nkv, D};
      const double theta = 10000.0;
      be_->rope_forward(q, theta);
      be_->rope_forward(k, theta);
      std::vector<float> ref = buf;
      cpu::rope_forward(ref.data(), B, S, nh, D, row, theta);
      cpu::rope_forward(ref.data() + nh * D, B, S, nkv, D, row, theta);
      const auto got = get(d_buf);
      EXPECT_LE(rel_err(got, ref), tol(t));
      // v (the last nkv * D columns of each row) must be untouched.
      for (int64_t rrow = 0; rrow < B * S; ++rrow)
        for (int64_t j = (nh + nkv) * D; j < row; ++j) ASSERT_EQ(got[rrow * row + j], buf[rrow * row + j]);

      // Backward is the inverse rotation: it maps the CPU's rotated values
      // back to the CPU's backward of them.
      Tensor d_ref = put(ref, t, {B * S * row});
      Tensor q2 = q;
      q2.data = d_ref.data;
      be_->rope_backward(q2, theta);
      std::vector<float> back = as_dtype(ref, t);
      cpu::rope_backward(back.data(), B, S, nh, D, row, theta);
      EXPECT_LE(rel_err(get(d_ref), back), tol(t));
    }
  }
}

// RoPE at given positions (train.reset_position_ids) on CUDA against the
// CPU kernel with the same positions, on a strided q view of a fused buffer:
// positions that restart at random document starts, int32 on the device.
TEST_F(CudaKernels, RopeAtPositionsMatchesTheCpu) {
  uint32_t seed = 470;
  std::mt19937 gen(47);
  for (DType t : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(t));
    const int64_t B = 2, S = 300, nh = 3, D = 64, row = (nh + 2) * D;
    std::vector<int32_t> pos(B * S);
    for (int64_t b = 0; b < B; ++b) {
      int32_t p = 0;
      for (int64_t i = 0; i < S; ++i) pos[b * S + i] = (i > 0 && gen() % 50 != 0) ? ++p : (p = 0);
    }
    Tensor d_pos = put_i32(pos);
    const auto buf = as_dtype(rnd(B * S * row, seed++), t);
    Tensor d_buf = put(buf, t, {B * S * row});
    Tensor q = d_buf;
    q.ndim = 4;
    q.shape = {B, S, nh, D};
    q.stride = {S * row, row, D, 1};
    const double theta = 500000.0;
    be_->rope_forward_at(q, theta, d_pos);
    std::vector<float> ref = buf;
    cpu::rope_forward(ref.data(), B, S, nh, D, row, theta, pos.data());
    EXPECT_LE(rel_err(get(d_buf), ref), tol(t));
    // The positions matter: the plain rotation is far from it.
    std::vector<float> plain = buf;
    cpu::rope_forward(plain.data(), B, S, nh, D, row, theta);
    EXPECT_GT(rel_err(plain, ref), 0.1);  // measured 0.62 in bf16: ten times bf16's tolerance
    // Backward is the inverse rotation: it brings the rotated q back.
    be_->rope_backward_at(q, theta, d_pos);
    EXPECT_LE(rel_err(get(d_buf), buf), 4 * tol(t));
  }
}

// ---- swiglu, residual -----------------------------------------------------------------

TEST_F(CudaKernels, SwigluForwardBackward) {
  uint32_t seed = 500;
  for (DType t : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(t));
    const int64_t n = 1001;
    const auto g = as_dtype(rnd(n, seed++, -4, 4), t), u = as_dtype(rnd(n, seed++, -2, 2), t);
    const auto dout = as_dtype(rnd(n, seed++), t);
    Tensor dg = put(g, t, {n}), du = put(u, t, {n}), dd = put(dout, t, {n});
    Tensor out = make(t, {n}), dgate = make(t, {n}), dup = make(t, {n});
    be_->swiglu_forward(out, dg, du);
    be_->swiglu_backward(dgate, dup, dd, dg, du);
    std::vector<float> ref(n), rg(n), ru(n);
    cpu::swiglu_forward(ref.data(), g.data(), u.data(), n);
    cpu::swiglu_backward(rg.data(), ru.data(), dout.data(), g.data(), u.data(), n);
    EXPECT_LE(rel_err(get(out), ref), tol(t));
    EXPECT_LE(rel_err(get(dgate), rg), tol(t));
    EXPECT_LE(rel_err(get(dup), ru), tol(t));
  }
}

TEST_F(CudaKernels, AddInPlaceAndAccumulateMixed) {
  uint32_t seed = 600;
  const int64_t n = 1003;
  for (DType t : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(t));
    const auto a = as_dtype(rnd(n, seed++), t), b = as_dtype(rnd(n, seed++), t);
    std::vector<float> ref(n);
    cpu::residual_forward(ref.data(), a.data(), b.data(), n);
    Tensor da = put(a, t, {n}), db = put(b, t, {n}), out = make(t, {n});
    be_->add(out, da, db);
    EXPECT_LE(rel_err(get(out), ref), tol(t));
    be_->add(da, da, db);  // out aliases a
    EXPECT_LE(rel_err(get(da), ref), tol(t));
  }
  for (DType td : {DType::f32, DType::bf16})
    for (DType ts : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(cat(dtype_name(td), " += ", dtype_name(ts)));
      const auto d = as_dtype(rnd(n, seed++), td), s = as_dtype(rnd(n, seed++), ts);
      std::vector<float> ref = d;
      cpu::accumulate(ref.data(), s.data(), n);
      Tensor dd = put(d, td, {n}), ds = put(s, ts, {n});
      be_->accumulate(dd, ds);
      EXPECT_LE(rel_err(get(dd), ref), tol(td));
    }
}

// ---- cross-entropy ------------------------------------------------------------------

TEST_F(CudaKernels, CrossEntropyLossAndGradient) {
  uint32_t seed = 700;
  // Vocabularies that take every path: rows kept in registers at 1, 2, 4 and 8
  // packed vectors a thread (bf16 1000, 5000, 12000, 32000), rows read twice
  // (fp32 32000, and 128256 in either type), unpacked rows (1001).
  for (DType t : {DType::f32, DType::bf16}) {
    for (int64_t V : {1000, 1001, 5000, 12000, 32000, 128256}) {
      SCOPED_TRACE(cat(dtype_name(t), " V=", V));
      const int64_t N = 13;
      const auto logits = as_dtype(rnd(N * V, seed++, -5, 5), t);
      std::vector<int32_t> tg(N);
      std::mt19937 gen(seed++);
      for (auto& x : tg) x = static_cast<int32_t>(gen() % V);
      tg[3] = -1;  // ignored positions
      tg[8] = -100;
      const float scale = 1.f / 11.f;
      Tensor d_tg = put_i32(tg);

      // Loss only: logits stay as they are.
      Tensor l0 = put(logits, t, {N, V}), loss0 = make(DType::f32, {N});
      be_->cross_entropy(l0, d_tg, loss0, 0.f);
      EXPECT_EQ(get(l0), logits);

      Tensor d_logits = put(logits, t, {N, V}), losses = make(DType::f32, {N});
      be_->cross_entropy(d_logits, d_tg, losses, scale);
      std::vector<float> ref = logits, ref_loss(N);
      for (int64_t n = 0; n < N; ++n)
        ref_loss[n] = static_cast<float>(cpu::cross_entropy(ref.data() + n * V, tg.data() + n, 1, V, scale));
      const auto got_loss = get(losses);
      EXPECT_LE(rel_err(got_loss, ref_loss), kTolF32);  // losses are fp32 from fp32 math on every path
      EXPECT_LE(rel_err(get(loss0), ref_loss), kTolF32);
      EXPECT_EQ(got_loss[3], 0.f);
      EXPECT_EQ(got_loss[8], 0.f);
      const auto got = get(d_logits);
      EXPECT_LE(rel_err(got, ref), tol(t));
      for (int64_t j = 0; j < V; ++j) {
        ASSERT_EQ(got[3 * V + j], 0.f);
        ASSERT_EQ(got[8 * V + j], 0.f);
      }
    }
  }
}

TEST_F(CudaKernels, CrossEntropyTargetOutsideVocabulary) {
  const int64_t N = 3, V = 64;
  const auto logits = rnd(N * V, 750);
  Tensor d_logits = put(logits, DType::f32, {N, V}), losses = make(DType::f32, {N});
  Tensor d_tg = put_i32({5, static_cast<int32_t>(V), 7});
  be_->cross_entropy(d_logits, d_tg, losses, 1.f);
  const auto l = get(losses);
  EXPECT_TRUE(std::isfinite(l[0]));
  EXPECT_TRUE(std::isnan(l[1]));  // loud, not a read past the row
  EXPECT_TRUE(std::isfinite(l[2]));
  const auto g = get(d_logits);
  for (int64_t j = 0; j < V; ++j) ASSERT_EQ(g[V + j], 0.f);
}

// ---- adamw ---------------------------------------------------------------------------

Backend::AdamWArgs adam_args() {
  Backend::AdamWArgs a;
  a.lr = 1e-2f;
  a.beta1 = 0.9f;
  a.beta2 = 0.95f;
  a.eps = 1e-8f;
  a.weight_decay = 0.1f;
  a.step = 3;
  a.grad_scale = 0.5f;
  return a;
}

void cpu_adamw(std::vector<float>& p, const std::vector<float>& g, std::vector<float>& m, std::vector<float>& v,
               const Backend::AdamWArgs& a) {
  cpu::adamw(p.data(), g.data(), m.data(), v.data(), static_cast<int64_t>(p.size()), a.lr, a.beta1, a.beta2, a.eps,
             a.weight_decay, a.step, a.grad_scale);
}

TEST_F(CudaKernels, AdamWFp32WithoutMaster) {
  const int64_t n = 1003;
  const auto p = rnd(n, 800, -0.05f, 0.05f), g = rnd(n, 801), m = rnd(n, 802, -0.1f, 0.1f),
             v = rnd(n, 803, 0.f, 0.01f);
  const auto a = adam_args();
  std::vector<float> rp = p, rm = m, rv = v;
  cpu_adamw(rp, g, rm, rv, a);
  Tensor dp = put(p, DType::f32, {n}), dg = put(g, DType::f32, {n}), dm = put(m, DType::f32, {n}),
         dv = put(v, DType::f32, {n});
  be_->adamw(dp, nullptr, dg, dm, dv, a);
  EXPECT_LE(rel_err(get(dp), rp), kTolF32);
  EXPECT_LE(rel_err(get(dm), rm), kTolF32);
  EXPECT_LE(rel_err(get(dv), rv), kTolF32);
  // The update itself (p is mostly unchanged, so compare the step too).
  std::vector<float> gp = get(dp), du(n), ru(n);
  for (int64_t i = 0; i < n; ++i) {
    du[i] = gp[i] - p[i];
    ru[i] = rp[i] - p[i];
  }
  EXPECT_LE(rel_err(du, ru), 1e-4);
}

TEST_F(CudaKernels, AdamWMasterWritesRoundedParam) {
  const int64_t n = 1001;
  for (DType gt : {DType::f32, DType::bf16}) {
    for (DType mt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(cat("grad ", dtype_name(gt), " m/v ", dtype_name(mt)));
      const auto master = rnd(n, 810, -0.05f, 0.05f);
      const auto g = as_dtype(rnd(n, 811), gt);
      const auto m = as_dtype(rnd(n, 812, -0.1f, 0.1f), mt), v = as_dtype(rnd(n, 813, 0.f, 0.01f), mt);
      const auto a = adam_args();
      std::vector<float> rmaster = master, rm = m, rv = v;
      cpu_adamw(rmaster, g, rm, rv, a);
      Tensor dmaster = put(master, DType::f32, {n}), dp = make(DType::bf16, {n});
      Tensor dg = put(g, gt, {n}), dm = put(m, mt, {n}), dv = put(v, mt, {n});
      be_->adamw(dp, &dmaster, dg, dm, dv, a);
      const auto gmaster = get(dmaster);
      EXPECT_LE(rel_err(gmaster, rmaster), kTolF32);
      EXPECT_LE(rel_err(get(dm), rm), tol(mt));
      EXPECT_LE(rel_err(get(dv), rv), tol(mt));
      const auto gp = get(dp);
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(gp[i], round_bf16(gmaster[i])) << "element " << i;
    }
  }
}

TEST_F(CudaKernels, AdamWBf16PureNearestMatchesFp32ThenRounded) {
  const int64_t n = 1001;
  const auto p = as_dtype(rnd(n, 820, -0.05f, 0.05f), DType::bf16);
  const auto g = as_dtype(rnd(n, 821), DType::bf16);
  const auto m = as_dtype(rnd(n, 822, -0.1f, 0.1f), DType::bf16), v = as_dtype(rnd(n, 823, 0.f, 0.01f), DType::bf16);
  const auto a = adam_args();
  std::vector<float> rp = p, rm = m, rv = v;
  cpu_adamw(rp, g, rm, rv, a);
  rp = as_dtype(rp, DType::bf16);
  Tensor dp = put(p, DType::bf16, {n}), dg = put(g, DType::bf16, {n}), dm = put(m, DType::bf16, {n}),
         dv = put(v, DType::bf16, {n});
  be_->adamw(dp, nullptr, dg, dm, dv, a);
  const auto gp = get(dp);
  EXPECT_LE(rel_err(gp, rp), kTolBF16);
  EXPECT_LE(rel_err(get(dm), as_dtype(rm, DType::bf16)), kTolBF16);
  EXPECT_LE(rel_err(get(dv), as_dtype(rv, DType::bf16)), kTolBF16);
  std::vector<float> du(n), ru(n);
  for (int64_t i = 0; i < n; ++i) {
    du[i] = gp[i] - p[i];
    ru[i] = rp[i] - p[i];
  }
  EXPECT_LE(rel_err(du, ru), 5e-2);  // the step, at bf16 resolution
}

// The kernel takes 4 elements a thread when every operand is aligned for
// packed access, else 1, and rounds each operation on its own in the CPU's
// order. So views starting 0, 1 and 4 elements into their buffers (packed,
// scalar, packed at another alignment), with tails of every length past the
// last packed group, must all give the CPU's result bit for bit: m and v
// rounded to their dtype, the param (or the fp32 master and the param
// rounded from it). Before the rounding was made explicit, the compiler fused
// different multiplies into FMAs on the two paths, and an unaligned shard
// updated its elements differently from an aligned one.
TEST_F(CudaKernels, AdamWIsTheCpuBitForBitOnEveryPath) {
  struct Layout {
    DType param, grad, state;
    bool master;
  };
  // Every storage a recipe can ask for: bf16_pure (and master = "bf16"),
  // bf16 and the FP8 recipes with an fp32 master, the same with
  // optimizer_state = "bf16" (bf16 m and v beside the fp32 master) and
  // master = "bf16" with optimizer_state = "fp32", and the fp32 reference.
  const Layout layouts[] = {{DType::bf16, DType::bf16, DType::bf16, false},
                            {DType::bf16, DType::f32, DType::f32, true},
                            {DType::bf16, DType::bf16, DType::f32, true},
                            {DType::bf16, DType::f32, DType::bf16, true},
                            {DType::bf16, DType::bf16, DType::f32, false},
                            {DType::f32, DType::f32, DType::f32, false}};
  uint32_t seed = 900;
  for (const Layout& l : layouts) {
    for (int64_t n : {1, 3, 4, 5, 4093, 4096 + 7}) {
      const auto p = as_dtype(rnd(n, seed++, -0.05f, 0.05f), l.master ? DType::f32 : l.param);
      const auto g = as_dtype(rnd(n, seed++), l.grad);
      const auto m = as_dtype(rnd(n, seed++, -0.1f, 0.1f), l.state), v = as_dtype(rnd(n, seed++, 0.f, 0.01f), l.state);
      const auto a = adam_args();
      std::vector<float> rp = p, rm = m, rv = v;
      cpu_adamw(rp, g, rm, rv, a);
      const auto want_p = as_dtype(rp, l.param), want_m = as_dtype(rm, l.state), want_v = as_dtype(rv, l.state);
      for (int64_t off : {0, 1, 4}) {
        SCOPED_TRACE(cat("param ", dtype_name(l.param), " grad ", dtype_name(l.grad), " m/v ", dtype_name(l.state),
                         l.master ? " with master" : "", " n ", n, " offset ", off));
        // A view `off` elements into a buffer of n + off (cudaMalloc aligns the buffer to 256 bytes).
        const auto view = [&](const std::vector<float>& host, DType t) {
          std::vector<float> padded(static_cast<size_t>(off), 0.f);
          padded.insert(padded.end(), host.begin(), host.end());
          Tensor x = put(padded, t, {n + off});
          x.data = static_cast<char*>(x.data) + off * dtype_size(t);
          x.shape[0] = n;
          return x;
        };
        Tensor dp = l.master ? view(std::vector<float>(static_cast<size_t>(n), 0.f), l.param) : view(p, l.param);
        Tensor dmaster = l.master ? view(p, DType::f32) : Tensor{};
        Tensor dg = view(g, l.grad), dm = view(m, l.state), dv = view(v, l.state);
        be_->adamw(dp, l.master ? &dmaster : nullptr, dg, dm, dv, a);
        const auto same_bits = [&](const std::vector<float>& got, const std::vector<float>& want, const char* what) {
          ASSERT_EQ(got.size(), want.size());
          for (size_t i = 0; i < got.size(); ++i)
            ASSERT_EQ(std::memcmp(&got[i], &want[i], 4), 0)
                << what << "[" << i << "]: " << got[i] << " on the GPU against " << want[i] << " on the CPU";
        };
        same_bits(get(dp), want_p, "param");
        same_bits(get(dm), want_m, "m");
        same_bits(get(dv), want_v, "v");
        if (l.master) same_bits(get(dmaster), rp, "master");
      }
    }
  }
}

TEST_F(CudaKernels, AdamWStochasticRoundingIsUnbiasedAndReproducible) {
  // Every element sees the same update, landing between two bf16 values:
  // each result must be one of the two, and their mean must approach the
  // fp32 result.
  const int64_t n = 1 << 16;
  Backend::AdamWArgs a;
  a.lr = 1e-3f;
  a.step = 1;
  a.stochastic_rounding = true;
  a.seed = 1234;
  std::vector<float> p1 = {1.f}, g1 = {0.3f}, m1 = {0.f}, v1 = {0.f};
  cpu_adamw(p1, g1, m1, v1, a);
  const float exact = p1[0];
  const float lo = 0.99609375f, hi = 1.0f;  // bf16 neighbours below 1
  ASSERT_GT(exact, lo);
  ASSERT_LT(exact, hi);

  auto run = [&](uint64_t seed) {
    Backend::AdamWArgs b = a;
    b.seed = seed;
    Tensor dp = put(std::vector<float>(n, 1.f), DType::bf16, {n});
    Tensor dg = put(std::vector<float>(n, 0.3f), DType::f32, {n});
    Tensor dm = put(std::vector<float>(n, 0.f), DType::f32, {n}), dv = put(std::vector<float>(n, 0.f), DType::f32, {n});
    be_->adamw(dp, nullptr, dg, dm, dv, b);
    return get(dp);
  };
  const auto r1 = run(1234);
  double mean = 0;
  int64_t n_hi = 0;
  for (float x : r1) {
    ASSERT_TRUE(x == lo || x == hi) << x;
    mean += x;
    n_hi += x == hi;
  }
  mean /= static_cast<double>(n);
  const double p_hi = (exact - lo) / (hi - lo);
  const double sigma = (hi - lo) * std::sqrt(p_hi * (1 - p_hi) / static_cast<double>(n));
  EXPECT_NEAR(mean, exact, 5 * sigma);
  EXPECT_GT(n_hi, 0);
  EXPECT_LT(n_hi, n);
  EXPECT_EQ(run(1234), r1);  // a pure function of (seed, step, index)
  EXPECT_NE(run(99), r1);
}

// ---- convert, norms -------------------------------------------------------------------

TEST_F(CudaKernels, ConvertRoundTripRoundsToNearestEven) {
  std::vector<float> x = rnd(1001, 900, -100, 100);
  // Ties: the discarded 16 bits exactly half an ulp, both parities.
  auto bits = [](uint32_t b) {
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  };
  x[0] = bits(0x3f808000u);  // tie, even below -> down
  x[1] = bits(0x3f818000u);  // tie, odd below -> up
  x[2] = bits(0xbf808001u);  // just above the tie -> up (magnitude)
  x[3] = std::numeric_limits<float>::infinity();
  x[4] = -0.f;
  x[5] = 1e-40f;  // subnormal
  Tensor src = put(x, DType::f32, {1001}), mid = make(DType::bf16, {1001}), back = make(DType::f32, {1001});
  be_->convert(mid, src);
  be_->convert(back, mid);
  const auto got = get(back);
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = round_bf16(x[i]);
    ASSERT_EQ(std::memcmp(&got[i], &want, 4), 0) << "element " << i << ": " << x[i] << " -> " << got[i] << " want "
                                                 << want;
  }
  // Equal dtypes: a copy.
  Tensor c = make(DType::f32, {1001});
  be_->convert(c, src);
  EXPECT_EQ(get(c), x);
}

TEST_F(CudaKernels, SqNormSumScale) {
  const int64_t n = 100003;
  for (DType t : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(t));
    const auto x = as_dtype(rnd(n, 950), t);
    Tensor d = put(x, t, {n});
    for (auto [b, e] : {std::pair<int64_t, int64_t>{0, n}, {3, n - 5}, {17, 18}, {5, 5}}) {
      const double want = cpu::sq_norm(x.data() + b, e - b);
      const double got = be_->sq_norm(d, b, e);
      EXPECT_NEAR(got, want, 1e-12 * std::max(1.0, want)) << "[" << b << "," << e << ")";
      EXPECT_EQ(be_->sq_norm(d, b, e), got);  // bitwise reproducible
    }
  }
  const auto x = rnd(n, 951);
  Tensor d = put(x, DType::f32, {n});
  double want = 0;
  for (float v : x) want += v;
  const double got = be_->sum(d);
  EXPECT_NEAR(got, want, 1e-8);
  EXPECT_EQ(be_->sum(d), got);
  be_->scale(d, 0.37f);
  std::vector<float> ref = x;
  cpu::scale(ref.data(), 0.37f, n);
  EXPECT_EQ(get(d), ref);  // one fp32 multiply: exact
}

// ---- the asynchronous step's ops ----------------------------------------------------

// sum_into against a serial double sum on the host. Tolerance: both sides add
// fp32 (or bf16) values in double, in different orders; for at most 2^21
// terms the rounding error is below n * 2^-53 * sum|terms| ~ 2.3e-10 of the
// magnitude sum, so 1e-9 of it is safe and still far below one fp32 ulp.
TEST_F(CudaKernels, SumIntoAddsOnTheDeviceDeterministically) {
  uint32_t seed = 1000;
  const double a0 = 0.375;  // the accumulator's value before: sum_into adds to it
  for (DType t : {DType::f32, DType::bf16}) {
    for (int64_t len : {int64_t{1}, int64_t{1000}, (int64_t{1} << 20) + 7}) {
      const int64_t total = len + 16;  // elements past `end` must not count
      const auto x = as_dtype(rnd(static_cast<size_t>(total), seed++), t);
      Tensor d = put(x, t, {total});
      for (int64_t begin : {int64_t{0}, int64_t{3}}) {  // 3: unaligned for packed loads
        for (bool square : {false, true}) {
          SCOPED_TRACE(cat(dtype_name(t), " len=", len, " begin=", begin, " square=", square));
          const int64_t end = begin + len;
          double ref = 0, mag = 0;
          for (int64_t i = begin; i < end; ++i) {
            const double v = x[static_cast<size_t>(i)];
            ref += square ? v * v : v;
            mag += square ? v * v : std::abs(v);
          }
          // Two sum_into calls into s[kNormSq] of a StepScalars tensor: no
          // host wait; the other entries untouched; one download reads it.
          auto sum_twice = [&](const Tensor& src, int64_t b, int64_t e) {
            std::vector<double> init(kStepScalars);
            for (int i = 0; i < kStepScalars; ++i) init[static_cast<size_t>(i)] = i;
            init[kNormSq] = a0;
            Tensor s = put_f64(init);
            Tensor acc = view(s, kNormSq, {1});
            const int64_t syncs = be_->host_syncs();
            be_->sum_into(acc, src, b, e, square);
            be_->sum_into(acc, src, b, e, square);
            EXPECT_EQ(be_->host_syncs(), syncs) << "sum_into waited for the device";
            const auto got = get_f64(s);
            EXPECT_EQ(be_->host_syncs(), syncs + 1);  // the download
            for (int i = 1; i < kStepScalars; ++i) EXPECT_EQ(got[static_cast<size_t>(i)], static_cast<double>(i));
            return got[kNormSq];
          };
          const double r1 = sum_twice(d, begin, end);
          EXPECT_NEAR(r1, a0 + 2 * ref, 1e-9 * (a0 + 2 * mag));
          EXPECT_TRUE(same_bits(sum_twice(d, begin, end), r1)) << "not bitwise reproducible";
          if (begin != 0) {
            // The order depends on end - begin alone: the same values at offset 0
            // (packed loads there, scalar ones at offset 3) give the same bits.
            const std::vector<float> moved(x.begin() + begin, x.begin() + end);
            Tensor d0 = put(moved, t, {len});
            EXPECT_TRUE(same_bits(sum_twice(d0, 0, len), r1)) << "the order depends on the offset";
          }
        }
      }
    }
  }
  // An empty range adds nothing (and launches nothing).
  Tensor d = put(rnd(8, 1099), DType::f32, {8});
  Tensor s = put_f64({a0});
  const int64_t syncs = be_->host_syncs();
  be_->sum_into(s, d, 5, 5, true);
  be_->sum_into(s, d, 0, 0, false);
  EXPECT_EQ(be_->host_syncs(), syncs);
  EXPECT_EQ(get_f64(s)[0], a0);
  Tensor f = make(DType::f32, {1});
  EXPECT_THROW(be_->sum_into(f, d, 0, 8, true), Error);  // the accumulator must be f64
  EXPECT_THROW(be_->sum_into(s, d, 4, 9, true), Error);  // range past the end
}

// clip_scale on the device against CpuBackend::clip_scale on the same input.
// Finite norms: bitwise equal (both compute in double with correctly rounded
// sqrt, division and products, then round the update scale to fp32).
// Non-finite: skip = 1 on both, every entry bitwise equal except the norm
// itself, which is inf or NaN on both (a NaN's payload may differ).
TEST_F(CudaKernels, ClipScaleMatchesTheCpuBackend) {
  auto cpu = make_cpu_backend(1);
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  struct Case {
    const char* what;
    double norm_sq;
    float grad_scale, clip;
    enum { active, inactive, off, skip } kind;
  };
  const Case cases[] = {
      {"clipping active", 37.3, 1.f / 3.f, 1.f, Case::active},  // norm 2.04 > 1
      {"clipping inactive", 0.0413, 0.5f, 1.f, Case::inactive},  // norm 0.10 < 1
      {"clipping disabled (clip 0)", 37.3, 0.5f, 0.f, Case::off},
      {"clipping disabled (clip < 0)", 37.3, 0.5f, -1.f, Case::off},
      {"+inf accumulator", inf, 0.5f, 1.f, Case::skip},
      {"NaN accumulator", nan, 0.5f, 1.f, Case::skip},
      {"NaN accumulator, no clipping", nan, 0.25f, 0.f, Case::skip},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    // The derived entries start at values clip_scale must overwrite.
    // Every literal step-scalar vector in this file lists all the slots: a new slot must be added to each.
    static_assert(kStepScalars == 8, "the step-scalar vectors in this file have 8 entries");
    const std::vector<double> init = {c.norm_sq, 12.5, -7.0, 0.25, -3.0, 1.5, 2.5, 0.75};
    ASSERT_EQ(init.size(), static_cast<size_t>(kStepScalars));
    std::vector<double> want = init;
    Tensor host(want.data(), DType::f64, Device::cpu, {kStepScalars});
    cpu->clip_scale(host, c.grad_scale, c.clip);
    Tensor d = put_f64(init);
    const int64_t syncs = be_->host_syncs();
    be_->clip_scale(d, c.grad_scale, c.clip);
    EXPECT_EQ(be_->host_syncs(), syncs) << "clip_scale waited for the device";
    const auto got = get_f64(d);
    EXPECT_EQ(got[kSkip], c.kind == Case::skip ? 1.0 : 0.0);
    EXPECT_EQ(want[kSkip], got[kSkip]);
    for (int i = 0; i < kStepScalars; ++i) {
      const size_t k = static_cast<size_t>(i);
      if (c.kind == Case::skip && i == kGradNorm) {
        EXPECT_FALSE(std::isfinite(got[k]));
        EXPECT_EQ(std::isnan(got[k]), std::isnan(want[k]));
        EXPECT_EQ(std::isinf(got[k]), std::isinf(want[k]));
      } else if (i == kNormSq && std::isnan(c.norm_sq)) {
        EXPECT_TRUE(std::isnan(got[k]));  // left as it was
      } else {
        EXPECT_TRUE(same_bits(got[k], want[k])) << "entry " << i << ": device " << got[k] << ", cpu " << want[k];
      }
    }
    // What the numbers mean, independently of the CPU: the scale is the fp32
    // grad_scale unless clipping bites, which shrinks it.
    if (c.kind == Case::active) {
      EXPECT_LT(got[kUpdateScale], static_cast<double>(c.grad_scale));
      // scale / grad_scale * norm = clip * norm / (norm + 1e-6), to fp32 rounding: within 2e-6 of clip.
      EXPECT_NEAR(got[kUpdateScale] / c.grad_scale * got[kGradNorm], c.clip, 2e-6);
    } else {
      EXPECT_EQ(got[kUpdateScale], static_cast<double>(c.grad_scale));
    }
  }
}

// adamw with device scalars: (skip 0, update scale s) is bitwise a call with
// grad_scale * s and no scalars (the kernel forms the same fp32 product);
// skip 1 leaves param, master, m and v bitwise as they were. Offset 1 puts
// every operand off its 16-byte alignment, so the scalar instance runs too.
TEST_F(CudaKernels, AdamWDeviceScalarsScaleOrSkip) {
  struct Case {
    const char* what;
    DType param, grad, mv;
    bool master, sr;
  };
  const Case cases[] = {
      {"fp32", DType::f32, DType::f32, DType::f32, false, false},
      {"bf16 + fp32 master", DType::bf16, DType::f32, DType::f32, true, false},
      {"bf16 + fp32 master, bf16 grads", DType::bf16, DType::bf16, DType::f32, true, false},
      {"bf16_pure", DType::bf16, DType::bf16, DType::bf16, false, false},
      {"bf16_pure, stochastic rounding", DType::bf16, DType::bf16, DType::bf16, false, true},
  };
  const float s = 0.37f;   // the update scale clip_scale would have stored
  const float gs = 0.3f;   // grad_scale: gs * s rounds in fp32 (not a power of two)
  const double inf = std::numeric_limits<double>::infinity();
  uint32_t seed = 1100;
  for (const Case& c : cases) {
    for (int64_t off : {0, 1}) {
      SCOPED_TRACE(cat(c.what, " offset=", off));
      const int64_t n = 1003, total = n + off;
      const auto p = as_dtype(rnd(total, seed++, -0.05f, 0.05f), c.param);
      const auto master = rnd(total, seed++, -0.05f, 0.05f);
      const auto g = as_dtype(rnd(total, seed++), c.grad);
      const auto m = as_dtype(rnd(total, seed++, -0.1f, 0.1f), c.mv), v = as_dtype(rnd(total, seed++, 0.f, 0.01f), c.mv);
      // Fresh state, one adamw on [off, off + n); the bytes of every state
      // buffer (whole, so writes outside the range show) before and after.
      struct Bytes {
        std::vector<std::vector<uint8_t>> before, after;
      };
      auto run = [&](const double* scalars, float grad_scale) {
        Tensor dp = put(p, c.param, {total}), dm = put(m, c.mv, {total}), dv = put(v, c.mv, {total});
        Tensor dmaster = put(master, DType::f32, {total}), dg = put(g, c.grad, {total});
        Tensor vp = view(dp, off, {n}), vm = view(dm, off, {n}), vv = view(dv, off, {n});
        Tensor vmaster = view(dmaster, off, {n}), vg = view(dg, off, {n});
        Bytes b;
        b.before = {get_bytes(dp), get_bytes(dmaster), get_bytes(dm), get_bytes(dv)};
        Backend::AdamWArgs a = adam_args();
        a.grad_scale = grad_scale;
        a.scalars = scalars;
        a.stochastic_rounding = c.sr;
        a.seed = 4321;
        const int64_t syncs = be_->host_syncs();
        be_->adamw(vp, c.master ? &vmaster : nullptr, vg, vm, vv, a);
        EXPECT_EQ(be_->host_syncs(), syncs) << "adamw waited for the device";
        b.after = {get_bytes(dp), get_bytes(dmaster), get_bytes(dm), get_bytes(dv)};
        return b;
      };
      Tensor go = put_f64({1.0, 2.0, 3.0, 0.0, static_cast<double>(s), 0.0, 0.0, 0.0});
      const Bytes with = run(go.ptr<const double>(), gs);
      const Bytes plain = run(nullptr, gs * s);
      EXPECT_EQ(with.before, plain.before);
      EXPECT_EQ(with.after, plain.after) << "scalars[kUpdateScale] is not applied as grad_scale * s";
      EXPECT_NE(with.after, with.before) << "the update wrote nothing";
      // A skipped step: nothing written at all, whatever the scale says.
      Tensor skip = put_f64({inf, 2.0, inf, 1.0, static_cast<double>(s), 0.0, 0.0, 0.0});
      const Bytes skipped = run(skip.ptr<const double>(), gs);
      EXPECT_EQ(skipped.after, skipped.before) << "a skipped step changed the state";

      if (c.param == DType::f32) {
        // And the CPU backend, which reads the same scalars on the host:
        // fp32 ~1e-5 relative (same expressions, possibly fused differently).
        auto cpu = make_cpu_backend(1);
        std::vector<double> hs = {1.0, 2.0, 3.0, 0.0, static_cast<double>(s)};
        std::vector<float> rp(p.begin() + off, p.end()), rg(g.begin() + off, g.end()), rm(m.begin() + off, m.end()),
            rv(v.begin() + off, v.end());
        Tensor tp(rp.data(), DType::f32, Device::cpu, {n}), tg(rg.data(), DType::f32, Device::cpu, {n}),
            tm(rm.data(), DType::f32, Device::cpu, {n}), tv(rv.data(), DType::f32, Device::cpu, {n});
        Backend::AdamWArgs a = adam_args();
        a.grad_scale = gs;
        a.scalars = hs.data();
        cpu->adamw(tp, nullptr, tg, tm, tv, a);
        auto floats = [&](const std::vector<uint8_t>& b) {
          std::vector<float> f(static_cast<size_t>(n));
          std::memcpy(f.data(), b.data() + off * 4, f.size() * 4);
          return f;
        };
        EXPECT_LE(rel_err(floats(with.after[0]), rp), kTolF32);
        EXPECT_LE(rel_err(floats(with.after[2]), rm), kTolF32);
        EXPECT_LE(rel_err(floats(with.after[3]), rv), kTolF32);
      }
    }
  }
}

// SwiGLU on the two halves of a packed [N, 2f] gate_up buffer (row stride
// 2f; gate/up and dgate/dup as [B, S, f] views, so three dims fold into
// rows), out and dout packed, against the CPU kernels on packed copies.
// f = 64: the packed 16-byte path; f = 37: the scalar one (odd stride, an
// unaligned up half). Every element of the outputs is poisoned first; the
// two gradient halves cover the whole dgate_up buffer. Tolerances: fp32
// 1e-5 (the same fp32 expressions, expf on both sides); bf16 1e-2 (one
// rounding of each output to bf16, relative 2^-9, from the same inputs).
TEST_F(CudaKernels, SwigluOnPackedGateUpHalves) {
  uint32_t seed = 1200;
  for (DType t : {DType::f32, DType::bf16}) {
    for (int64_t f : {64, 37}) {
      SCOPED_TRACE(cat(dtype_name(t), " f=", f));
      const int64_t B = 2, S = 5, N = B * S, w = 2 * f;
      const auto gu = as_dtype(rnd(N * w, seed++, -4, 4), t);
      const auto dout = as_dtype(rnd(N * f, seed++), t);
      std::vector<float> g(N * f), u(N * f);
      for (int64_t r = 0; r < N; ++r)
        for (int64_t j = 0; j < f; ++j) {
          g[r * f + j] = gu[r * w + j];
          u[r * f + j] = gu[r * w + f + j];
        }
      Tensor d_gu = put(gu, t, {N, w}), d_dout = put(dout, t, {N, f});
      const Tensor gate = strided(d_gu, 0, {B, S, f}, {S * w, w, 1});
      const Tensor up = strided(d_gu, f, {B, S, f}, {S * w, w, 1});
      Tensor out = make(t, {N, f});
      be_->swiglu_forward(out, gate, up);
      std::vector<float> ref(N * f);
      cpu::swiglu_forward(ref.data(), g.data(), u.data(), N * f);
      EXPECT_LE(rel_err(get(out), ref), tol(t));
      EXPECT_EQ(get(d_gu), gu);  // inputs untouched

      Tensor d_dgu = make(t, {N, w});
      Tensor dgate = strided(d_dgu, 0, {B, S, f}, {S * w, w, 1});
      Tensor dup = strided(d_dgu, f, {B, S, f}, {S * w, w, 1});
      be_->swiglu_backward(dgate, dup, d_dout, gate, up);
      std::vector<float> rg(N * f), ru(N * f);
      cpu::swiglu_backward(rg.data(), ru.data(), dout.data(), g.data(), u.data(), N * f);
      const auto dgu = get(d_dgu);
      std::vector<float> got_g(N * f), got_u(N * f);
      for (int64_t r = 0; r < N; ++r)
        for (int64_t j = 0; j < f; ++j) {
          got_g[r * f + j] = dgu[r * w + j];
          got_u[r * f + j] = dgu[r * w + f + j];
        }
      EXPECT_LE(rel_err(got_g, rg), tol(t));
      EXPECT_LE(rel_err(got_u, ru), tol(t));
    }
  }
  // Operands that do not agree on [rows, cols] are refused.
  Tensor a = make(DType::f32, {4, 8}), b = make(DType::f32, {4, 16});
  const Tensor half = strided(b, 0, {4, 7}, {16, 1});
  EXPECT_THROW(be_->swiglu_forward(a, half, half), Error);
}

// RoPE applied once to the q and k heads of a packed [B, S, (H + 2 Hkv) D]
// qkv buffer, as one [B, S, H + Hkv, D] view with row stride (H + 2 Hkv) D,
// equals RoPE applied to separate packed q [B, S, H, D] and k [B, S, Hkv, D]
// buffers: bitwise, since every element goes through the same kernel
// instance (D = 64: packed accesses in both layouts; D = 6: scalar in both)
// with the same table. v stays bitwise untouched. Also against the CPU
// kernel on the packed buffer (fp32 1e-5: fp32 rotations with the same fp32
// table; bf16 1e-2: one bf16 rounding of the outputs).
TEST_F(CudaKernels, RopeOnQkHeadsOfPackedQkv) {
  uint32_t seed = 1300;
  const double theta = 500000.0;
  for (DType t : {DType::f32, DType::bf16}) {
    for (int64_t D : {64, 6}) {
      for (int dir : {+1, -1}) {
        SCOPED_TRACE(cat(dtype_name(t), " D=", D, dir > 0 ? " forward" : " backward"));
        const int64_t B = 2, S = 33, H = 4, Hkv = 2, row = (H + 2 * Hkv) * D;
        const auto qkv = as_dtype(rnd(B * S * row, seed++), t);
        std::vector<float> q(B * S * H * D), k(B * S * Hkv * D);
        for (int64_t r = 0; r < B * S; ++r) {
          for (int64_t j = 0; j < H * D; ++j) q[r * H * D + j] = qkv[r * row + j];
          for (int64_t j = 0; j < Hkv * D; ++j) k[r * Hkv * D + j] = qkv[r * row + H * D + j];
        }
        Tensor d_qkv = put(qkv, t, {B * S * row});
        Tensor qk = strided(d_qkv, 0, {B, S, H + Hkv, D}, {S * row, row, D, 1});
        Tensor d_q = put(q, t, {B, S, H, D}), d_k = put(k, t, {B, S, Hkv, D});
        if (dir > 0) {
          be_->rope_forward(qk, theta);
          be_->rope_forward(d_q, theta);
          be_->rope_forward(d_k, theta);
        } else {
          be_->rope_backward(qk, theta);
          be_->rope_backward(d_q, theta);
          be_->rope_backward(d_k, theta);
        }
        const auto got = get(d_qkv), gq = get(d_q), gk = get(d_k);
        for (int64_t r = 0; r < B * S; ++r) {
          for (int64_t j = 0; j < H * D; ++j) ASSERT_EQ(got[r * row + j], gq[r * H * D + j]) << "q row " << r;
          for (int64_t j = 0; j < Hkv * D; ++j)
            ASSERT_EQ(got[r * row + H * D + j], gk[r * Hkv * D + j]) << "k row " << r;
          for (int64_t j = (H + Hkv) * D; j < row; ++j) ASSERT_EQ(got[r * row + j], qkv[r * row + j]) << "v row " << r;
        }
        std::vector<float> ref = qkv;
        if (dir > 0) cpu::rope_forward(ref.data(), B, S, H + Hkv, D, row, theta);
        else cpu::rope_backward(ref.data(), B, S, H + Hkv, D, row, theta);
        EXPECT_LE(rel_err(got, ref), tol(t));
      }
    }
  }
}

// upload_async from host_alloc memory round-trips without a host wait; the
// download that checks it counts one. The timer ring: marks queue, elapsed
// waits (one sync) and returns >= 0; slots are bounds-checked.
TEST_F(CudaKernels, UploadAsyncAndTimerRing) {
  const int64_t n = 10007;
  const auto vals = rnd(n, 1400);
  const size_t bytes = static_cast<size_t>(n) * 4;
  void* h = be_->host_alloc(bytes + 64);
  ASSERT_NE(h, nullptr);
  std::memcpy(h, vals.data(), bytes);
  Tensor x = make(DType::f32, {n}), y = make(DType::f32, {10});
  const int64_t c = be_->host_syncs();
  be_->upload_async(x, h, bytes);
  be_->upload_async(y, static_cast<char*>(h) + 40, 40);  // a range inside the buffer
  EXPECT_EQ(be_->host_syncs(), c) << "upload_async waited for the device";
  EXPECT_EQ(get(x), vals);
  EXPECT_EQ(be_->host_syncs(), c + 1);  // the download
  EXPECT_EQ(get(y), std::vector<float>(vals.begin() + 10, vals.begin() + 20));
  std::vector<float> pageable = vals;
  EXPECT_THROW(be_->upload_async(y, pageable.data(), 40), Error);                   // not from host_alloc
  EXPECT_THROW(be_->upload_async(x, static_cast<char*>(h) + 128, bytes), Error);  // runs past the buffer
  EXPECT_THROW(be_->host_free(pageable.data()), Error);
  be_->host_free(h);
  void* z = be_->host_alloc(0);
  EXPECT_NE(z, nullptr);
  be_->host_free(z);

  EXPECT_THROW(be_->timer_mark(0), Error);  // no ring yet
  be_->timer_reserve(3);
  const int64_t c2 = be_->host_syncs();
  be_->timer_mark(0);
  for (int i = 0; i < 20; ++i) be_->scale(x, 1.0001f);
  be_->timer_mark(2);
  EXPECT_EQ(be_->host_syncs(), c2) << "timer_mark waited for the device";
  const double ms = be_->timer_elapsed_ms(0, 2);
  EXPECT_GE(ms, 0.0);
  EXPECT_EQ(be_->host_syncs(), c2 + 1);
  EXPECT_THROW(be_->timer_mark(3), Error);
  EXPECT_THROW(be_->timer_mark(-1), Error);
  EXPECT_THROW(be_->timer_elapsed_ms(0, 3), Error);
  EXPECT_THROW(be_->timer_elapsed_ms(0, 1), Error);  // slot 1 was never marked
  be_->timer_reserve(2);                             // a new ring replaces the old one
  EXPECT_THROW(be_->timer_mark(2), Error);
  EXPECT_THROW(be_->timer_elapsed_ms(0, 1), Error);  // nothing marked in the new ring
  be_->timer_mark(0);
  be_->timer_mark(1);
  EXPECT_GE(be_->timer_elapsed_ms(0, 1), 0.0);
  EXPECT_THROW(be_->timer_reserve(0), Error);
}

// host_syncs counts exactly the calls that wait for the device.
TEST_F(CudaKernels, HostSyncsCountOnlyBlockingCalls) {
  const int64_t n = 4099;
  Tensor x = put(rnd(n, 1500), DType::f32, {n}), y = make(DType::f32, {n});
  Tensor p = put(rnd(n, 1501, -0.05f, 0.05f), DType::f32, {n}), m = put(rnd(n, 1502), DType::f32, {n}),
         v = put(rnd(n, 1503, 0.f, 0.01f), DType::f32, {n});
  Tensor s = put_f64({4.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0});
  Tensor acc = view(s, kNormSq, {1});
  Tensor r = put(rnd(2 * 17 * 8, 1504), DType::f32, {1, 17, 2, 8});
  void* h = be_->host_alloc(static_cast<size_t>(n) * 4);
  be_->timer_reserve(2);
  int64_t c = be_->host_syncs();
  // Queued work: no wait.
  be_->upload_async(y, h, static_cast<size_t>(n) * 4);
  be_->zero(y);
  be_->copy(y, x);
  be_->scale(y, 0.5f);
  be_->add(y, y, x);
  be_->accumulate(y, x);
  be_->sum_into(acc, x, 0, n, true);
  be_->clip_scale(s, 1.f, 1.f);
  Backend::AdamWArgs a = adam_args();
  a.scalars = s.ptr<const double>();
  be_->adamw(p, nullptr, x, m, v, a);
  be_->timer_mark(0);
  EXPECT_EQ(be_->host_syncs(), c);
  // Each blocking call: one.
  be_->synchronize();
  EXPECT_EQ(be_->host_syncs(), ++c) << "synchronize";
  std::vector<float> host(static_cast<size_t>(n));
  be_->download(host.data(), x, host.size() * 4);
  EXPECT_EQ(be_->host_syncs(), ++c) << "download";
  be_->upload(y, host.data(), host.size() * 4);
  EXPECT_EQ(be_->host_syncs(), ++c) << "upload";
  be_->sum(x);
  EXPECT_EQ(be_->host_syncs(), ++c) << "sum";
  be_->sq_norm(x, 0, n);
  EXPECT_EQ(be_->host_syncs(), ++c) << "sq_norm";
  be_->timer_start();
  be_->timer_stop_ms();
  EXPECT_EQ(be_->host_syncs(), ++c) << "timer_stop_ms";
  be_->timer_mark(1);
  be_->timer_elapsed_ms(0, 1);
  EXPECT_EQ(be_->host_syncs(), ++c) << "timer_elapsed_ms";
  be_->prepare_rope(17, 8, 10000.0);  // the table upload, once
  EXPECT_EQ(be_->host_syncs(), ++c) << "prepare_rope";
  be_->prepare_rope(17, 8, 10000.0);
  be_->rope_forward(r, 10000.0);
  be_->rope_backward(r, 10000.0);
  EXPECT_EQ(be_->host_syncs(), c) << "a prepared RoPE table is not uploaded again";
  be_->synchronize();
  be_->host_free(h);
}

// moe_read_counts lands the [2E + 1] expert counts and offsets in a pinned
// buffer made at creation: it holds E = 4096, the most model.num_experts
// accepts (it held 2047 experts, and a larger model failed at its first MoE
// layer).
TEST_F(CudaKernels, MoeReadCountsHoldsTheMostExpertsTheConfigAccepts) {
  for (const int64_t E : {int64_t{1}, loom::kMaxExperts / 2, loom::kMaxExperts}) {  // model.num_experts' range
    const int64_t n = 2 * E + 1;
    std::vector<int64_t> want(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) want[static_cast<size_t>(i)] = i * 1000003 + 7;
    Tensor buf = make(DType::f64, {n});  // int64 moved as 8-byte elements
    be_->upload(buf, want.data(), want.size() * sizeof(int64_t));
    MoeRouting r;
    r.E = E;
    r.counts = static_cast<int64_t*>(buf.data);
    r.offsets = r.counts + E;
    std::vector<int64_t> got(static_cast<size_t>(n), -1);
    be_->moe_read_counts(got.data(), r);
    EXPECT_EQ(got, want) << "E=" << E;
  }
}

// AdamWArgs::consume_grad: the gradient is zeroed once read — on an applied
// and on a skipped step — and the update is bitwise the one without it; on
// the side queue (the optimizer overlapping the model) the result is the same
// once the compute queue waits for its marker.
TEST_F(CudaKernels, AdamWConsumesGradientsOnEitherQueue) {
  const int64_t n = 4099;
  const auto p = rnd(n, 77, -0.05f, 0.05f), g = rnd(n, 78), m = rnd(n, 79, -0.1f, 0.1f), v = rnd(n, 80, 0.f, 0.01f);
  for (bool skip : {false, true}) {
    for (bool side : {false, true}) {
      SCOPED_TRACE(cat(skip ? "skipped" : "applied", side ? ", side queue" : ", compute queue"));
      auto run = [&](bool consume) {
        Tensor dp = put(p, DType::bf16, {n}), dmaster = put(p, DType::f32, {n}), dg = put(g, DType::f32, {n});
        Tensor dm = put(m, DType::f32, {n}), dv = put(v, DType::f32, {n});
        Tensor sc = put_f64({1.0, 2.0, 3.0, skip ? 1.0 : 0.0, 0.5, 0.0, 0.0, 0.0});
        Backend::AdamWArgs a = adam_args();
        a.scalars = sc.ptr<const double>();
        a.consume_grad = consume;
        const ExecContext& q = side ? be_->side_ctx() : be_->ctx();
        be_->wait(q, be_->mark(be_->ctx()));  // the uploads (compute queue) come first
        {
          QueueScope on(*be_, q);
          be_->adamw(dp, &dmaster, dg, dm, dv, a);
        }
        be_->wait(be_->ctx(), be_->mark(q));
        return std::make_pair(std::vector<std::vector<uint8_t>>{get_bytes(dp), get_bytes(dmaster), get_bytes(dm),
                                                                get_bytes(dv)},
                              get(dg));
      };
      const auto kept = run(false), consumed = run(true);
      EXPECT_EQ(kept.first, consumed.first) << "consuming the gradient changed the update";
      EXPECT_EQ(kept.second, std::vector<float>(g.begin(), g.end()));
      EXPECT_EQ(consumed.second, std::vector<float>(static_cast<size_t>(n), 0.f));
    }
  }
}

// Backend::timestamp (the device's global timer) times the same span as CUDA
// events: around ~20 ms of queued reductions the two agree within 2% or 50 us
// (events and %globaltimer read the same clock; the slack covers the one
// tiny kernel and the timer's microsecond granularity).
TEST_F(CudaKernels, TimestampsAgreeWithEvents) {
  const int64_t n = int64_t{1} << 24;
  std::vector<float> host(static_cast<size_t>(n));
  for (size_t i = 0; i < host.size(); ++i) host[i] = 0.001f * static_cast<float>(i % 977) - 0.3f;
  Tensor x = put(host, DType::f32, {n});
  Tensor stamps = make(DType::f64, {3});
  Tensor t0 = view(stamps, 0, {1}), t1 = view(stamps, 1, {1}), acc = view(stamps, 2, {1});
  be_->zero(acc);
  be_->timer_reserve(2);
  be_->timestamp(t0);  // loads the kernel (lazy module loading), so the timed launches are warm
  be_->sum_into(acc, x, 0, n, true);
  be_->synchronize();
  const int64_t syncs = be_->host_syncs();
  be_->timer_mark(0);
  be_->timestamp(t0);
  for (int i = 0; i < 200; ++i) be_->sum_into(acc, x, 0, n, true);
  be_->timestamp(t1);
  be_->timer_mark(1);
  EXPECT_EQ(be_->host_syncs(), syncs);  // timestamps are queued, never waited for
  const double events_ms = be_->timer_elapsed_ms(0, 1);
  double t[3];
  be_->download(t, stamps, sizeof t);
  const double stamp_ms = t[1] - t[0];
  EXPECT_GT(stamp_ms, 0.0);
  EXPECT_LE(stamp_ms, events_ms + 0.05);
  EXPECT_NEAR(stamp_ms, events_ms, std::max(0.02 * events_ms, 0.05)) << "events " << events_ms << " ms";
  std::printf("[timestamp] %.3f ms by the global timer, %.3f ms by events\n", stamp_ms, events_ms);
}

TEST_F(CudaKernels, RefusesUnsupportedDtypes) {
  Tensor a = make(DType::f32, {8}), b = make(DType::bf16, {8});
  Tensor x = make(DType::f32, {4, 8}), w = make(DType::bf16, {8}), rstd = make(DType::f32, {4});
  EXPECT_THROW(be_->add(a, a, b), Error);
  EXPECT_THROW(be_->rmsnorm_forward(x, rstd, x, w, 1e-5f), Error);
  Tensor dx = make(DType::f32, {4, 8}), dw = make(DType::bf16, {8}), wf = make(DType::f32, {8});
  EXPECT_THROW(be_->rmsnorm_backward(dx, dw, dx, dx, wf, rstd), Error);  // (f32 act, bf16 grad) is no recipe
  Tensor h = make(DType::f16, {8});
  EXPECT_THROW(be_->scale(h, 2.f), Error);
}

}  // namespace
}  // namespace loom

#else  // built without CUDA

TEST(CudaKernels, SkippedWithoutCuda) { GTEST_SKIP() << "built without CUDA"; }

#endif
