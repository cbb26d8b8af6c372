// The CUDA attention plugins against their references:
//   naive on cuda  vs  naive on the CPU (fp32 and bf16 inputs),
//   cudnn          vs  naive on cuda (bf16; MHA and GQA, D 64/128, S 100/257,
//                      packed tensors and views into one fused QKV buffer),
// deterministic backward run twice (bitwise equal), and the limits cudnn's
// supports() names. Plugins are loaded from the build tree through the
// registry, as the trainer loads them. Every output is poisoned (all bits set:
// NaN in fp32 and bf16) before each call, so a value a kernel forgot to write
// fails the comparison.
//
// GPU cases skip where no CUDA device is present (CI); the supports() checks
// need no device and run wherever the plugin was built.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "loom/attention.hpp"
#include "loom/registry.hpp"

#ifdef LOOM_HAVE_CUDA
#include <cuda_runtime.h>

namespace {

using loom::AttentionShape;
using loom::DType;
using loom::Device;
using loom::Tensor;

// The device check uses the CUDA runtime directly: these tests need a GPU and
// the plugins, not the core's CUDA backend.
bool gpu_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define REQUIRE_GPU()                                                                       \
  do {                                                                                      \
    if (!gpu_present()) GTEST_SKIP() << "no CUDA device here: GPU attention test skipped"; \
  } while (0)

#define CUDA_OK(call)                                                                                      \
  do {                                                                                                     \
    const cudaError_t e_ = (call);                                                                         \
    if (e_ != cudaSuccess) throw loom::Error(loom::cat(#call, ": ", cudaGetErrorName(e_), " (", cudaGetErrorString(e_), ")")); \
  } while (0)

const std::filesystem::path kPluginDir = LOOM_TEST_PLUGIN_DIR;
bool plugin_built(const char* name) {
  return std::filesystem::exists(kPluginDir / (std::string("libloom-attention-") + name + ".so"));
}

std::unique_ptr<loom::Attention> load(const std::string& name, Device device, bool deterministic = false) {
  loom::PluginRegistry reg({kPluginDir});
  loom::PluginInit init;
  init.device = device;
  init.deterministic = deterministic;
  return reg.create_as<loom::PluginKind::attention>(name, init);
}

// Host bf16: round to nearest even, as __float2bfloat16_rn does.
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct DeviceBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceBuf(size_t n) : bytes(n) {
    if (n) CUDA_OK(cudaMalloc(&p, n));
  }
  ~DeviceBuf() {
    if (p) cudaFree(p);
  }
  DeviceBuf(const DeviceBuf&) = delete;
  DeviceBuf& operator=(const DeviceBuf&) = delete;
};

// Elements from t.data to the last one its strides reach.
int64_t extent(const Tensor& t) {
  int64_t e = 1;
  for (int i = 0; i < t.ndim; ++i) e += (t.shape[i] - 1) * t.stride[i];
  return e;
}

// Calls f(flat offset in the view, packed index) for each element of a 4-d view.
template <typename F>
void for_each4(const Tensor& t, F f) {
  int64_t n = 0;
  for (int64_t a = 0; a < t.shape[0]; ++a)
    for (int64_t b = 0; b < t.shape[1]; ++b)
      for (int64_t c = 0; c < t.shape[2]; ++c)
        for (int64_t d = 0; d < t.shape[3]; ++d)
          f(a * t.stride[0] + b * t.stride[1] + c * t.stride[2] + d * t.stride[3], n++);
}

std::vector<float> download(const Tensor& t) {
  const int64_t e = extent(t);
  std::vector<float> flat(e);
  if (t.dtype == DType::f32) {
    CUDA_OK(cudaMemcpy(flat.data(), t.data, e * 4, cudaMemcpyDeviceToHost));
  } else {
    std::vector<uint16_t> h(e);
    CUDA_OK(cudaMemcpy(h.data(), t.data, e * 2, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < e; ++i) flat[i] = from_bf16(h[i]);
  }
  if (t.ndim != 4) return flat;  // stats: contiguous
  std::vector<float> packed(t.numel());
  for_each4(t, [&](int64_t off, int64_t i) { packed[i] = flat[off]; });
  return packed;
}

// Writes packed host values into the view, leaving the buffer's other elements
// (the other tensors of a fused buffer) as they are.
void upload(const Tensor& t, const std::vector<float>& packed) {
  ASSERT_EQ(static_cast<int64_t>(packed.size()), t.numel());
  const int64_t e = extent(t);
  if (t.dtype == DType::f32) {
    std::vector<float> flat(e);
    CUDA_OK(cudaMemcpy(flat.data(), t.data, e * 4, cudaMemcpyDeviceToHost));
    for_each4(t, [&](int64_t off, int64_t i) { flat[off] = packed[i]; });
    CUDA_OK(cudaMemcpy(t.data, flat.data(), e * 4, cudaMemcpyHostToDevice));
  } else {
    std::vector<uint16_t> flat(e);
    CUDA_OK(cudaMemcpy(flat.data(), t.data, e * 2, cudaMemcpyDeviceToHost));
    for_each4(t, [&](int64_t off, int64_t i) { flat[off] = to_bf16(packed[i]); });
    CUDA_OK(cudaMemcpy(t.data, flat.data(), e * 2, cudaMemcpyHostToDevice));
  }
}

// ||a - b|| / ||b||; infinite when a holds a NaN (an unwritten, poisoned value).
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct Case {
  int64_t B, S, H, Hkv, D;
  bool fused = false;  // q/k/v and dq/dk/dv as views into one [B, S, (H + 2 Hkv) D] buffer each
  AttentionShape shape() const {
    return {B, S, H, Hkv, D, true, static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)))};
  }
  std::string name() const {
    return loom::cat("B=", B, " S=", S, " H=", H, " Hkv=", Hkv, " D=", D, fused ? " fused-qkv" : "");
  }
};

// Inputs, packed BSHD on the host; with `bf16` every value is a bf16 value, so
// the fp32 CPU reference sees exactly what the GPU reads.
struct Inputs {
  std::vector<float> q, k, v, dout;
};
Inputs make_inputs(const Case& c, bool bf16, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> nd(0.f, 1.f);  // unit scores after the 1/sqrt(D) scale: a peaked softmax
  auto fill = [&](int64_t n) {
    std::vector<float> x(n);
    for (float& e : x) e = bf16 ? from_bf16(to_bf16(nd(gen))) : nd(gen);
    return x;
  };
  Inputs in;
  in.q = fill(c.B * c.S * c.H * c.D);
  in.k = fill(c.B * c.S * c.Hkv * c.D);
  in.v = fill(c.B * c.S * c.Hkv * c.D);
  in.dout = fill(c.B * c.S * c.H * c.D);
  return in;
}

struct Results {
  std::vector<float> out, stats, dq, dk, dv;
};

// Device tensors of one case: q/k/v and dq/dk/dv either packed or views into
// one fused buffer each; out, dout and stats packed.
struct DeviceCase {
  Case c;
  DType dt;
  size_t es;
  std::vector<std::unique_ptr<DeviceBuf>> bufs;
  Tensor q, k, v, out, dout, stats, dq, dk, dv;

  DeviceCase(const Case& cs, DType t) : c(cs), dt(t), es(loom::dtype_size(t)) {
    const int64_t B = c.B, S = c.S, H = c.H, Hkv = c.Hkv, D = c.D;
    auto alloc = [&](size_t bytes) { return bufs.emplace_back(std::make_unique<DeviceBuf>(bytes))->p; };
    auto packed = [&](int64_t heads) { return Tensor(alloc(B * S * heads * D * es), dt, Device::cuda, {B, S, heads, D}); };
    if (!c.fused) {
      q = packed(H), k = packed(Hkv), v = packed(Hkv), dq = packed(H), dk = packed(Hkv), dv = packed(Hkv);
    } else {
      const int64_t W = (H + 2 * Hkv) * D;
      auto views = [&](Tensor& tq, Tensor& tk, Tensor& tv) {
        char* base = static_cast<char*>(alloc(B * S * W * es));
        auto view = [&](int64_t off, int64_t heads) {
          Tensor t(base + off * es, dt, Device::cuda, {B, S, heads, D});
          t.stride = {S * W, W, D, 1};
          return t;
        };
        tq = view(0, H), tk = view(H * D, Hkv), tv = view((H + Hkv) * D, Hkv);
      };
      views(q, k, v);
      views(dq, dk, dv);
    }
    out = packed(H), dout = packed(H);
    stats = Tensor(alloc(B * H * S * 4), DType::f32, Device::cuda, {B, H, S});
  }
  void upload_inputs(const Inputs& in) {
    upload(q, in.q), upload(k, in.k), upload(v, in.v), upload(dout, in.dout);
  }
};

// Forward then backward on the GPU, with every output poisoned first.
Results run_gpu(loom::Attention& a, const Case& c, DType dt, const Inputs& in, bool deterministic = false) {
  DeviceCase d(c, dt);
  d.upload_inputs(in);
  const AttentionShape sh = c.shape();
  const loom::Support sup = a.supports(sh, dt, Device::cuda);
  EXPECT_TRUE(sup.ok) << c.name() << ": " << sup.reason;
  DeviceBuf ws(a.workspace_bytes(sh, dt, Device::cuda));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  loom::ExecContext ctx;
  ctx.device = Device::cuda;
  ctx.stream = stream;
  ctx.deterministic = deterministic;
  for (Tensor* t : {&d.out, &d.stats}) CUDA_OK(cudaMemset(t->data, 0xFF, extent(*t) * loom::dtype_size(t->dtype)));
  a.forward(ctx, sh, d.q, d.k, d.v, d.out, d.stats, ws.p);
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaGetLastError());
  for (Tensor* t : {&d.dq, &d.dk, &d.dv}) CUDA_OK(cudaMemset(t->data, 0xFF, extent(*t) * loom::dtype_size(t->dtype)));
  a.backward(ctx, sh, d.q, d.k, d.v, d.out, d.dout, d.stats, d.dq, d.dk, d.dv, ws.p);
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaStreamDestroy(stream));
  return {download(d.out), download(d.stats), download(d.dq), download(d.dk), download(d.dv)};
}

// The CPU naive plugin on the same (fp32) inputs: the exact reference.
Results run_cpu(const Case& c, const Inputs& in) {
  auto a = load("naive", Device::cpu);
  const AttentionShape sh = c.shape();
  Results r;
  r.out.assign(in.q.size(), NAN), r.stats.assign(c.B * c.H * c.S, NAN);
  r.dq.assign(in.q.size(), NAN), r.dk.assign(in.k.size(), NAN), r.dv.assign(in.v.size(), NAN);
  Inputs x = in;  // the plugin takes non-const data pointers
  auto T = [&](std::vector<float>& v, int64_t heads) {
    return Tensor(v.data(), DType::f32, Device::cpu, {c.B, c.S, heads, c.D});
  };
  Tensor q = T(x.q, c.H), k = T(x.k, c.Hkv), v = T(x.v, c.Hkv), dout = T(x.dout, c.H), out = T(r.out, c.H),
         dq = T(r.dq, c.H), dk = T(r.dk, c.Hkv), dv = T(r.dv, c.Hkv);
  Tensor stats(r.stats.data(), DType::f32, Device::cpu, {c.B, c.H, c.S});
  std::vector<double> ws(a->workspace_bytes(sh, DType::f32, Device::cpu) / sizeof(double));
  const loom::ExecContext ctx;
  a->forward(ctx, sh, q, k, v, out, stats, ws.data());
  a->backward(ctx, sh, q, k, v, out, dout, stats, dq, dk, dv, ws.data());
  return r;
}

void expect_close(const Results& got, const Results& want, double tol, double stats_tol, const std::string& what) {
  EXPECT_LE(rel_err(got.out, want.out), tol) << what << ": out";
  EXPECT_LE(rel_err(got.stats, want.stats), stats_tol) << what << ": stats";
  EXPECT_LE(rel_err(got.dq, want.dq), tol) << what << ": dq";
  EXPECT_LE(rel_err(got.dk, want.dk), tol) << what << ": dk";
  EXPECT_LE(rel_err(got.dv, want.dv), tol) << what << ": dv";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(NaiveCuda, MatchesTheCpuKernels) {
  REQUIRE_GPU();
  auto gpu = load("naive", Device::cuda);
  const Case cases[] = {{2, 100, 8, 2, 64}, {2, 257, 4, 4, 128}, {2, 100, 8, 2, 64, true}, {1, 5, 2, 1, 8}};
  for (const Case& c : cases) {
    for (DType dt : {DType::f32, DType::bf16}) {
      const bool bf = dt == DType::bf16;
      const Inputs in = make_inputs(c, bf, 1234 + static_cast<uint32_t>(c.S));
      const Results want = run_cpu(c, in);
      const Results got = run_gpu(*gpu, c, dt, in);
      // fp32: only the order of fp32 sums differs from the CPU's double ones;
      // bf16: the outputs are rounded to bf16 (2^-9 relative).
      const double tol = bf ? 1e-2 : 1e-5;
      // stats are fp32 in both cases, from the same inputs.
      expect_close(got, want, tol, 1e-5, c.name() + " " + std::string(loom::dtype_name(dt)));
    }
  }
}

TEST(CudnnAttention, MatchesNaiveCuda) {
  REQUIRE_GPU();
  if (!plugin_built("cudnn")) GTEST_SKIP() << "the cudnn plugin was not built (see the CMake warning)";
  auto naive = load("naive", Device::cuda);
  auto cudnn = load("cudnn", Device::cuda);
  const Case cases[] = {
      {2, 100, 8, 8, 64},        {2, 257, 8, 8, 128},       {2, 257, 8, 2, 64},  {2, 100, 8, 2, 128},
      {2, 100, 8, 2, 64, true},  {2, 257, 8, 8, 128, true},
  };
  for (const Case& c : cases) {
    const Inputs in = make_inputs(c, true, 99 + static_cast<uint32_t>(c.D + c.S));
    const Results want = run_gpu(*naive, c, DType::bf16, in);
    const Results got = run_gpu(*cudnn, c, DType::bf16, in);
    expect_close(got, want, 2e-2, 1e-3, "cudnn vs naive " + c.name());
  }
}

TEST(CudnnAttention, DeterministicBackwardIsBitwiseRepeatable) {
  REQUIRE_GPU();
  if (!plugin_built("cudnn")) GTEST_SKIP() << "the cudnn plugin was not built (see the CMake warning)";
  auto cudnn = load("cudnn", Device::cuda, /*deterministic=*/true);
  auto naive = load("naive", Device::cuda, true);
  for (const Case& c : {Case{2, 257, 8, 2, 64}, Case{2, 100, 8, 2, 128, true}}) {
    const Inputs in = make_inputs(c, true, 7);
    for (loom::Attention* a : {cudnn.get(), naive.get()}) {
      const Results r1 = run_gpu(*a, c, DType::bf16, in, true);
      const Results r2 = run_gpu(*a, c, DType::bf16, in, true);
      const std::string who = (a == cudnn.get() ? "cudnn " : "naive ") + c.name();
      EXPECT_TRUE(bitwise_equal(r1.out, r2.out)) << who << ": out";
      EXPECT_TRUE(bitwise_equal(r1.dq, r2.dq)) << who << ": dq";
      EXPECT_TRUE(bitwise_equal(r1.dk, r2.dk)) << who << ": dk";
      EXPECT_TRUE(bitwise_equal(r1.dv, r2.dv)) << who << ": dv";
    }
  }
}

// Needs no device: the refusals come before any cuDNN call.
TEST(CudnnAttention, SupportsNamesTheLimit) {
  if (!plugin_built("cudnn")) GTEST_SKIP() << "the cudnn plugin was not built (see the CMake warning)";
  auto a = load("cudnn", Device::cuda);
  const Case base{2, 100, 8, 2, 64};
  const std::string use_naive = "attention.plugin = \"naive\"";
  struct Refusal {
    int64_t D;
    DType dt;
    Device dev;
    const char* says;
  };
  const Refusal refusals[] = {{73, DType::bf16, Device::cuda, "head_dim=73 is not a positive multiple of 8"},
                              {512, DType::bf16, Device::cuda, "head_dim=512 is above cuDNN SDPA's limit of 256"},
                              {64, DType::f32, Device::cuda, "bf16 or fp16 tensors (cuDNN SDPA), got fp32"},
                              {64, DType::bf16, Device::cpu, "runs on cuda only, got device cpu"}};
  for (const Refusal& r : refusals) {
    Case c = base;
    c.D = r.D;
    const loom::Support s = a->supports(c.shape(), r.dt, r.dev);
    EXPECT_FALSE(s.ok) << r.says;
    EXPECT_TRUE(contains(s.reason, r.says)) << s.reason;
    EXPECT_TRUE(contains(s.reason, use_naive)) << s.reason;
  }
  if (gpu_present()) {
    const loom::Support ok = a->supports(base.shape(), DType::bf16, Device::cuda);
    EXPECT_TRUE(ok.ok) << ok.reason;
  }
}

// Needs no device: each call is refused before any data is touched.
TEST(CudaAttentionErrors, NameTheProblem) {
  auto error_of = [](auto f) -> std::string {  // the message is printed by the EXPECT below on failure
    try {
      f();
    } catch (const loom::Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  const Case c{1, 4, 2, 1, 64};
  const AttentionShape sh = c.shape();
  float dummy[4] = {};  // never read: the calls throw first
  auto T = [&](DType dt, int64_t d0, int64_t d1, int64_t d2, int64_t d3) {
    return Tensor(dummy, dt, Device::cuda, {d0, d1, d2, d3});
  };
  Tensor q = T(DType::f32, 1, 4, 2, 64), kv = T(DType::f32, 1, 4, 1, 64), out = T(DType::f32, 1, 4, 2, 64);
  Tensor stats(dummy, DType::f32, Device::cuda, {1, 2, 4});
  loom::ExecContext ctx;
  ctx.device = Device::cuda;

  auto naive = load("naive", Device::cuda);
  {
    const std::string msg = error_of([&] { naive->forward(ctx, sh, q, kv, kv, out, stats, nullptr); });
    EXPECT_TRUE(contains(msg, "needs a workspace")) << msg;
  }
  loom::ExecContext cpu_ctx;
  {
    const std::string msg = error_of([&] { naive->forward(cpu_ctx, sh, q, kv, kv, out, stats, dummy); });
    EXPECT_TRUE(contains(msg, "called on cpu but the plugin was created for cuda")) << msg;
  }

  if (!plugin_built("cudnn")) return;
  auto cudnn = load("cudnn", Device::cuda);
  {
    const std::string msg = error_of([&] { cudnn->forward(ctx, sh, q, kv, kv, out, stats, nullptr); });
    EXPECT_TRUE(contains(msg, "bf16 or fp16 tensors (cuDNN SDPA), got q in fp32")) << msg;
  }
  {
    const std::string msg = error_of([&] { cudnn->forward(cpu_ctx, sh, q, kv, kv, out, stats, nullptr); });
    EXPECT_TRUE(contains(msg, "it runs on cuda only")) << msg;
  }
}

TEST(NaiveCuda, SupportsFp32AndBf16OnCuda) {
  auto a = load("naive", Device::cuda);
  const AttentionShape sh = Case{2, 100, 8, 2, 64}.shape();
  EXPECT_TRUE(a->supports(sh, DType::f32, Device::cuda).ok);
  EXPECT_TRUE(a->supports(sh, DType::bf16, Device::cuda).ok);
  EXPECT_TRUE(a->supports(sh, DType::f32, Device::cpu).ok);
  const loom::Support f16 = a->supports(sh, DType::f16, Device::cuda);
  EXPECT_FALSE(f16.ok);
  EXPECT_TRUE(contains(f16.reason, "fp32 or bf16")) << f16.reason;
  const loom::Support cpu_bf16 = a->supports(sh, DType::bf16, Device::cpu);
  EXPECT_FALSE(cpu_bf16.ok);
  EXPECT_TRUE(contains(cpu_bf16.reason, "fp32 only")) << cpu_bf16.reason;
  // Scores [B, H, S, S] in fp32.
  EXPECT_EQ(a->workspace_bytes(sh, DType::bf16, Device::cuda), size_t{2 * 8 * 100 * 100 * 4});
}

}  // namespace

#else  // no CUDA backend in this build

TEST(CudaAttention, NeedsTheCudaBackend) {
  GTEST_SKIP() << "loom built without CUDA (LOOM_WITH_CUDA=OFF): CUDA attention tests skipped";
}

#endif
