// The CUDA attention plugins against their references:
//   naive on cuda  vs  naive on the CPU (fp32 and bf16 inputs),
//   cudnn          vs  naive on cuda (bf16; MHA and GQA, D 64/128, S 100/257,
//                      packed tensors and views into one fused QKV buffer),
// deterministic backward run twice (bitwise equal), the fused attention
// block's layout (q/k/v and dq/dk/dv as views of packed [B, S, (H + 2 Hkv) D]
// buffers) against separate packed tensors, no allocation after the first call
// (tests/alloc_counter.hpp), and the limits cudnn's supports() names. Plugins
// are loaded from the build tree through the registry, as the trainer loads
// them. Every output is poisoned (all bits set: NaN in fp32 and bf16) before
// each call, so a value a kernel forgot to write fails the comparison.
//
// GPU cases skip where no CUDA device is present (CI); the supports() checks
// need no device and run wherever the plugin was built.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "loom/attention.hpp"
#include "loom/config.hpp"
#include "loom/registry.hpp"

#ifdef LOOM_HAVE_CUDA
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdio>

#include "alloc_counter.hpp"

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

// Graphs the loaded cudnn plugin has built so far (its exported counter), or
// null when the library is not loaded.
using GraphsBuilt = int64_t (*)();
GraphsBuilt cudnn_graph_counter() {
  const std::string file = (kPluginDir / "libloom-attention-cudnn.so").string();
  void* lib = dlopen(file.c_str(), RTLD_NOW | RTLD_NOLOAD);
  return lib ? reinterpret_cast<GraphsBuilt>(dlsym(lib, "loom_attention_cudnn_graphs_built")) : nullptr;
}

std::unique_ptr<loom::Attention> load(const std::string& name, Device device, bool deterministic = false,
                                      const std::string& toml = "") {
  loom::PluginRegistry reg({kPluginDir});
  loom::PluginInit init;
  init.device = device;
  init.deterministic = deterministic;
  if (!toml.empty()) init.config = loom::parse_config_table("[attention]\n" + toml, "attention.toml").table("attention");
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

// ||a - b|| / ||b||; infinite when a holds a NaN (an unwritten, poisoned
// value). floor2 > 0: ||b||^2 taken as at least floor2 (for a b that may be 0).
double rel_err(const std::vector<float>& a, const std::vector<float>& b, double floor2 = 0) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, floor2));
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

// Forward then backward on the GPU, with every output poisoned first. With
// `graphs` (the cudnn plugin's counter), *built_by_calls receives how many
// graphs forward and backward built beyond those workspace_bytes() built.
Results run_gpu(loom::Attention& a, const Case& c, DType dt, const Inputs& in, bool deterministic = false,
                GraphsBuilt graphs = nullptr, int64_t* built_by_calls = nullptr) {
  DeviceCase d(c, dt);
  d.upload_inputs(in);
  const AttentionShape sh = c.shape();
  const loom::Support sup = a.supports(sh, dt, Device::cuda);
  EXPECT_TRUE(sup.ok) << c.name() << ": " << sup.reason;
  DeviceBuf ws(a.workspace_bytes(sh, dt, Device::cuda));
  const int64_t graphs_before = graphs ? graphs() : 0;
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
  if (graphs && built_by_calls) *built_by_calls = graphs() - graphs_before;
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

// attention.sdpa_forward: each forward implementation against naive (GQA,
// the fused QKV layout, head dims 64 and 128; MatchesNaiveCuda's
// tolerances; the backward reads each one's out and stats). "composite" is
// cuDNN's graph of separate operations, which every cuDNN 9 supports;
// "unified" needs a newer library: where it cannot build a graph, the
// refusal must name the key and the way out.
TEST(CudnnAttention, EachForwardImplementationMatchesNaive) {
  REQUIRE_GPU();
  if (!plugin_built("cudnn")) GTEST_SKIP() << "the cudnn plugin was not built (see the CMake warning)";
  auto naive = load("naive", Device::cuda);
  const Case cases[] = {{2, 257, 8, 2, 64}, {2, 100, 8, 2, 128, true}, {1, 512, 4, 4, 128}};
  for (const char* impl : {"composite", "unified", "auto"}) {
    auto cudnn = load("cudnn", Device::cuda, false, std::string("sdpa_forward = \"") + impl + "\"");
    for (const Case& c : cases) {
      // supports() builds the graphs, as the core asks before any GPU work.
      const loom::Support sup = cudnn->supports(c.shape(), DType::bf16, Device::cuda);
      if (!sup.ok) {
        EXPECT_EQ(std::string(impl), "unified") << impl << " " << c.name() << ": " << sup.reason;
        EXPECT_NE(sup.reason.find("attention.sdpa_forward = \"unified\""), std::string::npos) << sup.reason;
        std::printf("[sdpa_forward] unified refused for %s: %s\n", c.name().c_str(), sup.reason.c_str());
        continue;
      }
      const Inputs in = make_inputs(c, true, 31 + static_cast<uint32_t>(c.S));
      const Results want = run_gpu(*naive, c, DType::bf16, in);
      const Results got = run_gpu(*cudnn, c, DType::bf16, in);
      expect_close(got, want, 2e-2, 1e-3, std::string("cudnn (") + impl + ") vs naive " + c.name());
    }
  }
}

// A value outside the three is refused when the plugin is made (before any
// device work, so on any machine), naming the key, the value and the choices.
TEST(CudnnAttention, UnknownForwardImplementationIsRefused) {
  if (!plugin_built("cudnn")) GTEST_SKIP() << "the cudnn plugin was not built (see the CMake warning)";
  try {
    load("cudnn", Device::cuda, false, "sdpa_forward = \"unifed\"");
    ADD_FAILURE() << "sdpa_forward = \"unifed\" was accepted";
  } catch (const loom::Error& e) {
    const std::string m = e.what();
    for (const char* part : {"sdpa_forward", "unifed", "composite", "unified", "auto"})
      EXPECT_NE(m.find(part), std::string::npos) << "missing '" << part << "' in: " << m;
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

// The fused attention block's layout (fused_key in cudnn_attention.cpp): q, k
// and v as views of one packed [B, S, (H + 2 Hkv) D] buffer (heads [0, H),
// [H, H + Hkv), the rest), dq/dk/dv as the same views of one packed gradient
// buffer, out and dout packed [B, S, H D]; against separate packed tensors
// holding the same values. GQA, S not a multiple of any tile, forward and
// backward, with ExecContext::deterministic off and on.
//   naive on cuda: the same kernels summing in the same order, only the
//     addresses differ, so the layouts agree bitwise.
//   cudnn: the layouts may run different engines, so they agree to the bf16
//     outputs' rounding: 1e-2 relative (one bf16 ulp is 2^-8 of a value; a view
//     reading the wrong heads is off by O(1)); stats (fp32) to 1e-3, the bound
//     MatchesNaiveCuda uses. workspace_bytes() must have built every graph the
//     calls use (the calls build none), which is what proves fused_key is this layout.
//   deterministic: two runs of each layout are bitwise equal, for both plugins.
TEST(FusedQkvLayout, MatchesSeparatePackedTensors) {
  REQUIRE_GPU();
  const Case packed{2, 257, 8, 2, 64}, fused{2, 257, 8, 2, 64, true};
  const Inputs in = make_inputs(packed, true, 2024);
  auto expect_bitwise = [](const Results& a, const Results& b, const std::string& what) {
    EXPECT_TRUE(bitwise_equal(a.out, b.out)) << what << ": out";
    EXPECT_TRUE(bitwise_equal(a.stats, b.stats)) << what << ": stats";
    EXPECT_TRUE(bitwise_equal(a.dq, b.dq)) << what << ": dq";
    EXPECT_TRUE(bitwise_equal(a.dk, b.dk)) << what << ": dk";
    EXPECT_TRUE(bitwise_equal(a.dv, b.dv)) << what << ": dv";
  };
  for (bool det : {false, true}) {
    const std::string mode = det ? " (deterministic)" : "";
    auto naive = load("naive", Device::cuda, det);
    const Results np = run_gpu(*naive, packed, DType::bf16, in, det);
    const Results nf = run_gpu(*naive, fused, DType::bf16, in, det);
    expect_bitwise(nf, np, "naive cuda: fused views vs packed" + mode);
    if (det) expect_bitwise(run_gpu(*naive, fused, DType::bf16, in, det), nf, "naive cuda: fused, run twice");

    if (!plugin_built("cudnn")) continue;
    auto cudnn = load("cudnn", Device::cuda, det);
    const GraphsBuilt graphs = cudnn_graph_counter();
    ASSERT_NE(graphs, nullptr) << "loom_attention_cudnn_graphs_built missing from the cudnn plugin";
    int64_t built_packed = -1, built_fused = -1;
    const Results cp = run_gpu(*cudnn, packed, DType::bf16, in, det, graphs, &built_packed);
    const Results cf = run_gpu(*cudnn, fused, DType::bf16, in, det, graphs, &built_fused);
    EXPECT_EQ(built_packed, 0) << "packed tensors" << mode << " used a graph workspace_bytes() had not built";
    EXPECT_EQ(built_fused, 0) << "fused views" << mode << " used a graph workspace_bytes() had not built";
    expect_close(cf, cp, 1e-2, 1e-3, "cudnn: fused views vs packed" + mode);
    expect_close(cf, np, 2e-2, 1e-3, "cudnn fused views vs naive" + mode);
    if (det) {
      expect_bitwise(run_gpu(*cudnn, fused, DType::bf16, in, det), cf, "cudnn: fused, run twice");
      expect_bitwise(run_gpu(*cudnn, packed, DType::bf16, in, det), cp, "cudnn: packed, run twice");
    }
  }
}

// Attention runs once per layer and direction each step: after the first call
// of a (shape, strides, dtype, direction) nothing may be allocated. Packed and
// fused-view calls alternate, so the cudnn plugin's last-graph fast path misses
// every call and its cache lookup is measured too. tests/alloc_counter.hpp
// counts operator new/delete in the whole process; allocations inside NVIDIA's
// libraries (cuDNN's backend creates a descriptor per execute) are reported, not ours.
TEST(AttentionHotPath, AllocatesNothingAfterTheFirstCall) {
  REQUIRE_GPU();
  loom_test::AllocCounter counter;
  struct Run {
    const char* plugin;
    DType dt;
    bool deterministic;
  };
  const Run runs[] = {{"naive", DType::bf16, false},
                      {"naive", DType::f32, false},
                      {"cudnn", DType::bf16, false},
                      {"cudnn", DType::bf16, true}};
  for (const Run& r : runs) {
    if (std::string(r.plugin) == "cudnn" && !plugin_built("cudnn")) continue;
    const std::string who = loom::cat(r.plugin, " ", loom::dtype_name(r.dt), r.deterministic ? " deterministic" : "");
    SCOPED_TRACE(who);
    auto a = load(r.plugin, Device::cuda, r.deterministic);
    const Case packed{2, 257, 8, 2, 64}, fused{2, 257, 8, 2, 64, true};
    const Inputs in = make_inputs(packed, r.dt == DType::bf16, 5);
    DeviceCase dp(packed, r.dt), df(fused, r.dt);
    dp.upload_inputs(in);
    df.upload_inputs(in);
    const AttentionShape sh = packed.shape();
    const loom::Support sup = a->supports(sh, r.dt, Device::cuda);
    ASSERT_TRUE(sup.ok) << sup.reason;
    DeviceBuf ws(a->workspace_bytes(sh, r.dt, Device::cuda));
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreate(&stream));
    loom::ExecContext ctx;
    ctx.device = Device::cuda;
    ctx.stream = stream;
    ctx.deterministic = r.deterministic;
    auto step = [&] {
      for (DeviceCase* d : {&dp, &df}) {
        a->forward(ctx, sh, d->q, d->k, d->v, d->out, d->stats, ws.p);
        a->backward(ctx, sh, d->q, d->k, d->v, d->out, d->dout, d->stats, d->dq, d->dk, d->dv, ws.p);
      }
    };
    step();  // warm-up: the first call of each graph
    CUDA_OK(cudaStreamSynchronize(stream));
    const GraphsBuilt graphs = std::string(r.plugin) == "cudnn" ? cudnn_graph_counter() : nullptr;
    const int64_t graphs_before = graphs ? graphs() : 0;

    counter.start();
    for (int i = 0; i < 100; ++i) step();
    const loom_test::AllocCounts c = counter.stop();
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaGetLastError());
    EXPECT_EQ(c.ours_new, 0) << "400 attention calls allocated; the first allocation came from:" << c.first_ours;
    EXPECT_EQ(c.ours_delete, 0);
    if (graphs) EXPECT_EQ(graphs(), graphs_before) << "calls after the warm-up built graphs";
    std::printf("[ %s ] 400 attention calls: %lld allocations and %lld frees inside NVIDIA's libraries (not ours)\n",
                who.c_str(), static_cast<long long>(c.vendor_new), static_cast<long long>(c.vendor_delete));

    // The counter sees what the plugin allocates: a refused call formats its message.
    Tensor bad_stats = dp.stats;
    bad_stats.shape[2] = sh.seq - 1;
    counter.start();
    try {
      a->forward(ctx, sh, dp.q, dp.k, dp.v, dp.out, bad_stats, ws.p);
    } catch (const loom::Error&) {
    }
    const loom_test::AllocCounts err = counter.stop();
    EXPECT_GT(err.ours_new, 0) << "the counting operator new does not see the plugin's allocations";
    CUDA_OK(cudaStreamDestroy(stream));
  }
}

// Document masking (AttentionShape::documents): cuDNN's ragged SDPA against
// the naive plugin on CUDA (a query sees its own span's keys only), on spans
// of every kind: one per row, a few of random lengths, many short ones, and
// every token a span of its own (the last sequence-count bucket), for packed
// tensors and fused-QKV views, in bf16 (tolerance as MatchesNaiveCuda: 2e-2
// relative, bf16 outputs and another summation order). The stats are each
// plugin's own layout and are not compared. workspace_bytes() builds every
// graph: the calls, over several count buckets, build none; after a first
// round they allocate nothing either.
struct DeviceSpans {
  std::unique_ptr<DeviceBuf> buf;
  loom::DocumentSpans spans;
};
// The spans of rows of S tokens with documents beginning where `begins` is
// set (a row's first token always begins one), as the token stager derives them.
DeviceSpans make_spans(int64_t B, int64_t S, const std::vector<uint8_t>& begins, uint64_t serial) {
  const int64_t N = B * S;
  std::vector<int32_t> pos(N), cu(N + 1, static_cast<int32_t>(N)), len(N, 0);
  int64_t k = 0, longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t start = 0;
    for (int64_t p = 0; p <= S; ++p) {
      if (p == S || (p > 0 && begins[b * S + p])) {
        len[k] = static_cast<int32_t>(p - start);
        cu[k] = static_cast<int32_t>(b * S + start);
        longest = std::max(longest, p - start);
        ++k;
        start = p;
      }
      if (p < S) pos[b * S + p] = static_cast<int32_t>(p - start);
    }
  }
  DeviceSpans d;
  d.buf = std::make_unique<DeviceBuf>((3 * N + 1) * 4);
  auto* base = static_cast<int32_t*>(d.buf->p);
  CUDA_OK(cudaMemcpy(base, pos.data(), N * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(base + N, cu.data(), (N + 1) * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(base + 2 * N + 1, len.data(), N * 4, cudaMemcpyHostToDevice));
  d.spans.positions = Tensor(base, DType::i32, Device::cuda, {N});
  d.spans.cu_seqlens = Tensor(base + N, DType::i32, Device::cuda, {N + 1});
  d.spans.lengths = Tensor(base + 2 * N + 1, DType::i32, Device::cuda, {N});
  d.spans.count = k;
  d.spans.longest = longest;
  d.spans.serial = serial;
  return d;
}

TEST(CudnnAttention, DocumentSpansMatchNaiveCuda) {
  REQUIRE_GPU();
  if (!plugin_built("cudnn")) GTEST_SKIP() << "the cudnn plugin was not built (see the CMake warning)";
  const int64_t B = 2, S = 257;
  std::mt19937 gen(17);
  std::vector<std::vector<uint8_t>> patterns;
  patterns.emplace_back(B * S, 0);  // one span a row
  // Spans of random lengths, about `every` tokens; every 2: half the spans
  // one token long beside longer ones, in a large bucket.
  for (int every : {60, 9, 2}) {
    std::vector<uint8_t> p(B * S);
    for (auto& f : p) f = gen() % static_cast<unsigned>(every) == 0;
    patterns.push_back(p);
  }
  patterns.emplace_back(B * S, 1);  // every token a span: the last bucket
  auto naive = load("naive", Device::cuda);
  auto cudnn = load("cudnn", Device::cuda);
  const GraphsBuilt graphs = cudnn_graph_counter();
  ASSERT_NE(graphs, nullptr) << "loom_attention_cudnn_graphs_built missing from the cudnn plugin";
  for (bool fused : {false, true}) {
    const Case c{B, S, 8, 2, 64, fused};
    const Inputs in = make_inputs(c, true, 4242);
    AttentionShape sh = c.shape();
    sh.documents = true;
    // Both plugins' graphs and workspaces, before any call.
    DeviceBuf ws_naive(naive->workspace_bytes(sh, DType::bf16, Device::cuda));
    ASSERT_TRUE(cudnn->supports(sh, DType::bf16, Device::cuda).ok);
    DeviceBuf ws(cudnn->workspace_bytes(sh, DType::bf16, Device::cuda));
    const int64_t graphs_before = graphs();
    DeviceCase dn(c, DType::bf16), dc(c, DType::bf16);
    dn.upload_inputs(in);
    dc.upload_inputs(in);
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreate(&stream));
    loom::ExecContext ctx;
    ctx.device = Device::cuda;
    ctx.stream = stream;
    std::vector<DeviceSpans> spans;
    uint64_t serial = 0;
    for (const auto& p : patterns) spans.push_back(make_spans(B, S, p, ++serial));
    auto call = [&](loom::Attention& a, DeviceCase& d, void* w) {
      a.forward(ctx, sh, d.q, d.k, d.v, d.out, d.stats, w);
      a.backward(ctx, sh, d.q, d.k, d.v, d.out, d.dout, d.stats, d.dq, d.dk, d.dv, w);
    };
    std::vector<float> causal_out;
    std::array<double, 4> causal_norm2{};
    const std::array<const char*, 4> kNames{"out", "dq", "dk", "dv"};
    for (DeviceSpans& ds : spans) {
      sh.spans = &ds.spans;
      for (DeviceCase* d : {&dn, &dc})
        for (Tensor* t : {&d->out, &d->dq, &d->dk, &d->dv})
          CUDA_OK(cudaMemset(t->data, 0xFF, extent(*t) * loom::dtype_size(t->dtype)));
      call(*naive, dn, ws_naive.p);
      call(*cudnn, dc, ws.p);
      CUDA_OK(cudaStreamSynchronize(stream));
      CUDA_OK(cudaGetLastError());
      const std::string what = loom::cat(c.name(), ", ", ds.spans.count, " spans, the longest ", ds.spans.longest);
      const std::vector<float> naive_out = download(dn.out);
      // The reference itself masks: every pattern but the first (one span a
      // row, plain causal attention) moves the outputs far beyond the tolerance.
      if (&ds == &spans.front()) causal_out = naive_out;
      else EXPECT_GT(rel_err(naive_out, causal_out), 0.1) << what << ": the naive plugin did not mask";
      // The error relative to the reference's norm, but at least a tenth of
      // the norm of the same tensor under plain causal attention (the first
      // pattern): with every span one token long the exact dq and dk are 0
      // (a one-token softmax is constant), and cuDNN's differ from 0 by
      // rounding (dS = P (dP - D), with dP and D the same dot product summed
      // in another order).
      const std::array<Tensor*, 4> cn{&dc.out, &dc.dq, &dc.dk, &dc.dv}, nn{&dn.out, &dn.dq, &dn.dk, &dn.dv};
      for (size_t i = 0; i < cn.size(); ++i) {
        const std::vector<float> want = download(*nn[i]);
        double norm2 = 0;
        for (float f : want) norm2 += double(f) * f;
        if (&ds == &spans.front()) causal_norm2[i] = norm2;
        const double floor2 = 0.01 * causal_norm2[i];
        EXPECT_LE(rel_err(download(*cn[i]), want, floor2), 2e-2)
            << what << ": " << kNames[i] << " (reference norm " << std::sqrt(norm2) << ")";
      }
    }
    EXPECT_EQ(graphs(), graphs_before) << c.name() << ": a call built a graph workspace_bytes() had not built";
    // Then every pattern again, counting allocations: none of ours.
    loom_test::AllocCounter counter;
    counter.start();
    for (DeviceSpans& ds : spans) {
      sh.spans = &ds.spans;
      call(*cudnn, dc, ws.p);
    }
    const loom_test::AllocCounts n = counter.stop();
    CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_EQ(n.ours_new, 0) << c.name() << ": document-masked calls allocated; first at\n" << n.first_ours;
    std::printf("[docmask cudnn %s] %zu span patterns (1 to %lld spans) within 2e-2 of naive; no graph built, "
                "no allocation in the calls\n",
                c.name().c_str(), spans.size(), static_cast<long long>(B * S));
    CUDA_OK(cudaStreamDestroy(stream));
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
