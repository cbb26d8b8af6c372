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
// reruns) are checked where the contract promises them.
// Without a GPU every test skips; built without CUDA the suite is one skip.
#include <gtest/gtest.h>

#ifdef LOOM_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gpu_test_util.hpp"
#include "hf/safetensors.hpp"
#include "kernels/cpu/cpu_kernels.hpp"
#include "loom/arena.hpp"
#include "model/backend.hpp"

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
    be_ = make_cuda_backend(0);
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

  std::unique_ptr<Backend> be_;
  std::vector<void*> allocs_;
};

// (activation = param, grad) dtypes of backend.hpp.
struct Recipe {
  DType act, grad;
};
const Recipe kRecipes[] = {{DType::f32, DType::f32}, {DType::bf16, DType::f32}, {DType::bf16, DType::bf16}};

std::string name(const Recipe& r) { return cat("act=", dtype_name(r.act), " grad=", dtype_name(r.grad)); }

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
      if (v != 2) ASSERT_EQ(got[v * h + j], dw0[v * h + j]) << "row " << v;
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

TEST_F(CudaKernels, RmsnormBackwardAccumulatesAndIsDeterministic) {
  uint32_t seed = 300;
  for (const Recipe& r : kRecipes) {
    for (int64_t N : {37, 301}) {  // 301 rows: several dw chunks
      SCOPED_TRACE(name(r) + cat(" N=", N));
      const int64_t h = 104;
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
  for (DType t : {DType::f32, DType::bf16}) {
    for (int64_t V : {1000, 1001, 32000}) {
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
