// The precision plugins' cuBLASLt GEMMs (fp32 on CUDA, bf16, bf16_pure),
// loaded as the host loads them and checked against a host fp64 reference.
// GEMM tests skip where no CUDA device is present; the construction and
// argument-checking tests need no device and run in every CUDA build.
#include <gtest/gtest.h>

#ifdef LOOM_HAVE_CUDA
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "alloc_counter.hpp"
#include "cuda_test_util.hpp"
#include "hf/safetensors.hpp"
#include "loom/config.hpp"
#include "loom/cpu_gemm.hpp"
#include "loom/gemm_algo.hpp"
#include "loom/precision.hpp"
#include "loom/registry.hpp"

namespace {

using loom::DType;
using loom::Device;

constexpr size_t kWorkspace = size_t{32} << 20;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Its own check rather than the backend's: this suite needs only the CUDA runtime.
bool gpu_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define REQUIRE_GPU()                                                                  \
  do {                                                                                 \
    if (!gpu_present()) GTEST_SKIP() << "no CUDA device here: GPU GEMM test skipped"; \
  } while (0)

loom::PluginRegistry& registry() {
  // Plugins are never unloaded; one registry for the whole suite.
  static auto* reg = new loom::PluginRegistry({std::filesystem::path(LOOM_TEST_PLUGIN_DIR)});
  return *reg;
}

std::unique_ptr<loom::Precision> make(const std::string& name, Device device,
                                      const loom::ConfigTable& config = loom::ConfigTable(),
                                      bool deterministic = false) {
  loom::PluginInit init;
  init.config = config;
  init.device = device;
  init.deterministic = deterministic;
  return registry().create_as<loom::PluginKind::precision>(name, init);
}

loom::ConfigTable precision_table(const std::string& body) {
  loom::ConfigTable t = loom::parse_config_table("[precision]\n" + body, "test.toml").table("precision");
  t.mark_used("plugin");  // as the core does: `plugin` is its key, not the recipe's
  return t;
}

struct Recipe {
  const char* name;
  DType act, param, grad;
  double tol;  // relative, ||got - ref|| / ||ref||
};
const Recipe kRecipes[] = {
    {"fp32", DType::f32, DType::f32, DType::f32, 1e-5},
    {"bf16", DType::bf16, DType::bf16, DType::f32, 1e-2},
    {"bf16_pure", DType::bf16, DType::bf16, DType::bf16, 1e-2},
};

// Host values as the device stores them: bf16-rounded where the dtype is bf16,
// so the fp64 reference sees exactly the GEMM's inputs.
std::vector<float> random_values(size_t n, DType t, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) {
    x = u(rng);
    if (t == DType::bf16) x = loom::hf::bf16_to_f32(loom::hf::f32_to_bf16(x));
  }
  return v;
}

std::vector<unsigned char> encode(const std::vector<float>& v, DType t) {
  std::vector<unsigned char> out(v.size() * loom::dtype_size(t));
  if (t == DType::f32) {
    std::memcpy(out.data(), v.data(), out.size());
  } else {
    for (size_t i = 0; i < v.size(); ++i) {
      const uint16_t h = loom::hf::f32_to_bf16(v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}
float decode_one(const unsigned char* p, DType t) {
  if (t == DType::f32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return loom::hf::bf16_to_f32(h);
}

// A device matrix [rows, cols] inside a buffer of row stride ld >= cols,
// starting `offset` elements in (a view like one slice of a fused activation).
struct DevMatrix {
  DType dtype = DType::f32;
  int64_t rows = 0, cols = 0, ld = 0, offset = 0;
  void* base = nullptr;
  size_t base_bytes = 0;
  DevMatrix(DType t, int64_t r, int64_t c, int64_t pad = 0, int64_t off = 0)
      : dtype(t), rows(r), cols(c), ld(c + pad), offset(off) {
    base_bytes = static_cast<size_t>(off + r * ld) * loom::dtype_size(t);
    if (cudaMalloc(&base, base_bytes) != cudaSuccess) base = nullptr;
  }
  ~DevMatrix() {
    if (base) cudaFree(base);
  }
  DevMatrix(const DevMatrix&) = delete;
  DevMatrix& operator=(const DevMatrix&) = delete;
  char* data() const { return static_cast<char*>(base) + offset * static_cast<int64_t>(loom::dtype_size(dtype)); }
  // The view the plugin sees; `batch` > 1 splits the rows into a leading dim.
  loom::Tensor tensor(int64_t batch = 1) const {
    loom::Tensor t = batch > 1 ? loom::Tensor(data(), dtype, Device::cuda, {batch, rows / batch, cols})
                               : loom::Tensor(data(), dtype, Device::cuda, {rows, cols});
    t.stride[t.ndim - 2] = ld;
    if (t.ndim == 3) t.stride[0] = ld * (rows / batch);
    return t;
  }
  // Whole buffer (padding included) to 0xFF bytes: NaN in fp32 and in bf16.
  void poison() const { ASSERT_EQ(cudaMemset(base, 0xFF, base_bytes), cudaSuccess); }
  void upload(const std::vector<float>& v) const {
    const std::vector<unsigned char> b = encode(v, dtype);
    const size_t row = static_cast<size_t>(cols) * loom::dtype_size(dtype);
    ASSERT_EQ(cudaMemcpy2D(data(), ld * loom::dtype_size(dtype), b.data(), row, row, rows, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<float> download() const {
    std::vector<unsigned char> b(static_cast<size_t>(rows * cols) * loom::dtype_size(dtype));
    const size_t row = static_cast<size_t>(cols) * loom::dtype_size(dtype);
    EXPECT_EQ(cudaMemcpy2D(b.data(), row, data(), ld * loom::dtype_size(dtype), row, rows, cudaMemcpyDeviceToHost),
              cudaSuccess);
    std::vector<float> v(static_cast<size_t>(rows * cols));
    for (size_t i = 0; i < v.size(); ++i) v[i] = decode_one(b.data() + i * loom::dtype_size(dtype), dtype);
    return v;
  }
  // Bytes outside the view (padding columns and the offset) still 0xFF: the
  // GEMM honoured the leading dimension.
  bool padding_untouched() const {
    std::vector<unsigned char> b(base_bytes);
    EXPECT_EQ(cudaMemcpy(b.data(), base, base_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    const size_t es = loom::dtype_size(dtype);
    for (size_t i = 0; i < base_bytes; ++i) {
      const int64_t e = static_cast<int64_t>(i / es) - offset;
      const bool inside = e >= 0 && e < rows * ld && (e % ld) < cols;
      if (!inside && b[i] != 0xFF) return false;
    }
    return true;
  }
};

double rel_error(const std::vector<float>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d;  // a NaN (poison left behind) makes the error NaN, which fails every bound
    den += ref[i] * ref[i];
  }
  return std::sqrt(num) / std::sqrt(den);
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Row-major fp64 GEMMs of the CPU reference (loom/cpu_gemm.hpp, itself checked
// against finite differences and a plain loop in test_cpu_kernels).
std::vector<double> ref_forward(const std::vector<double>& x, const std::vector<double>& w, int m, int k, int n) {
  std::vector<double> y(static_cast<size_t>(m) * n);
  loom::cpu::linear_forward(y.data(), n, x.data(), k, w.data(), m, k, n);
  return y;
}
std::vector<double> ref_dgrad(const std::vector<double>& dy, const std::vector<double>& w, int m, int k, int n) {
  std::vector<double> dx(static_cast<size_t>(m) * k);
  loom::cpu::linear_backward_input(dx.data(), k, dy.data(), n, w.data(), m, k, n);
  return dx;
}
std::vector<double> ref_wgrad(const std::vector<double>& dy, const std::vector<double>& x, int m, int k, int n,
                              std::vector<double> dw_before) {
  loom::cpu::linear_backward_weight(dw_before.data(), dy.data(), n, x.data(), k, m, k, n, /*accumulate=*/true);
  return dw_before;
}

// The stream, cuBLASLt handle and workspace the core would own.
class CudaGemm : public ::testing::Test {
 protected:
  void SetUp() override {
    REQUIRE_GPU();
    CUDA_OK(cudaStreamCreate(&stream_));
    ASSERT_EQ(cublasLtCreate(&lt_), CUBLAS_STATUS_SUCCESS);
    CUDA_OK(cudaMalloc(&workspace_, kWorkspace));
    ctx_.device = Device::cuda;
    ctx_.stream = stream_;
    ctx_.blas_handle = lt_;
  }
  void TearDown() override {
    if (workspace_) cudaFree(workspace_);
    if (lt_) cublasLtDestroy(lt_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  std::unique_ptr<loom::Precision> gpu_plugin(const char* name, const loom::ConfigTable& config = loom::ConfigTable(),
                                              bool deterministic = false) {
    auto p = make(name, Device::cuda, config, deterministic);
    EXPECT_EQ(p->workspace_bytes(), kWorkspace);
    p->set_workspace(workspace_, kWorkspace);
    return p;
  }
  void sync() { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }

  // One linear (m, k, n) through forward, dgrad and wgrad (written, then
  // accumulated onto a pre-filled dW). pad/off > 0 makes x, y, dy and dx row
  // views into wider buffers; batch > 1 hands x and y in as [batch, m/batch, .].
  void check_linear(const Recipe& r, int m, int k, int n, int64_t pad = 0, int64_t off = 0, int64_t batch = 1,
                    const loom::ConfigTable& config = loom::ConfigTable()) {
    SCOPED_TRACE(::testing::Message() << r.name << " m=" << m << " k=" << k << " n=" << n << " pad=" << pad
                                      << " off=" << off << " batch=" << batch);
    auto p = gpu_plugin(r.name, config);
    const int id = p->register_linear({"layer.0.mlp", k, n, m});
    std::mt19937 rng(1234u + static_cast<unsigned>(m * 31 + k * 7 + n));
    const std::vector<float> x = random_values(size_t(m) * k, r.act, rng), w = random_values(size_t(n) * k, r.param, rng),
                             dy = random_values(size_t(m) * n, r.act, rng),
                             dw0 = random_values(size_t(n) * k, r.grad, rng);
    DevMatrix xb(r.act, m, k, pad, off), dyb(r.act, m, n, pad, off), yb(r.act, m, n, pad, off),
        dxb(r.act, m, k, pad, off), dwb(r.grad, n, k), wb(r.param, n, k);
    ASSERT_TRUE(xb.base && dyb.base && yb.base && dxb.base && dwb.base && wb.base) << "cudaMalloc failed";
    xb.poison();  // padding of the input views too: a GEMM reading it would produce NaN
    dyb.poison();
    xb.upload(x);
    dyb.upload(dy);
    wb.upload(w);
    loom::Tensor tx = xb.tensor(batch), tw = wb.tensor(), tdy = dyb.tensor(), ty = yb.tensor(batch),
                 tdx = dxb.tensor(), tdw = dwb.tensor();

    const std::vector<double> xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
    yb.poison();
    p->linear_forward(ctx_, id, tx, tw, ty, nullptr);
    sync();
    EXPECT_LE(rel_error(yb.download(), ref_forward(xd, wd, m, k, n)), r.tol) << "forward";
    EXPECT_TRUE(yb.padding_untouched()) << "forward wrote outside y's rows";

    dxb.poison();
    dwb.poison();
    p->linear_backward(ctx_, id, tx, tw, tdy, &tdx, tdw, /*accumulate=*/false);
    sync();
    EXPECT_LE(rel_error(dxb.download(), ref_dgrad(dyd, wd, m, k, n)), r.tol) << "dx";
    EXPECT_TRUE(dxb.padding_untouched()) << "dgrad wrote outside dx's rows";
    const std::vector<double> zeros(size_t(n) * k, 0.0);
    EXPECT_LE(rel_error(dwb.download(), ref_wgrad(dyd, xd, m, k, n, zeros)), r.tol) << "dW written";

    // Accumulate: dW holds earlier micro-batches; dx skipped (null) as the
    // model may; a poisoned dx buffer must stay untouched.
    dwb.upload(dw0);
    dxb.poison();
    p->linear_backward(ctx_, id, tx, tw, tdy, nullptr, tdw, /*accumulate=*/true);
    sync();
    EXPECT_LE(rel_error(dwb.download(), ref_wgrad(dyd, xd, m, k, n, to_double(dw0))), r.tol) << "dW accumulated";
    std::vector<unsigned char> probe(4);
    ASSERT_EQ(cudaMemcpy(probe.data(), dxb.data(), 2, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(probe[0], 0xFF) << "dx was written although it was null";
  }

  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  void* workspace_ = nullptr;
  loom::ExecContext ctx_;
};

TEST_F(CudaGemm, MatchesFp64Reference) {
  for (const Recipe& r : kRecipes) {
    check_linear(r, 257, 96, 160);
    check_linear(r, 64, 128, 384, 0, 0, /*batch=*/4);
    check_linear(r, 2048, 768, 2304);
  }
}

TEST_F(CudaGemm, StridedRowViews) {
  // Row stride wider than the row and a start that is only 16 (bf16) or 32
  // (fp32) bytes aligned: the leading dimensions and the alignment hints must hold.
  for (const Recipe& r : kRecipes) {
    check_linear(r, 257, 96, 160, /*pad=*/40, /*off=*/8);
    check_linear(r, 128, 256, 64, /*pad=*/64, /*off=*/0);
  }
}

TEST_F(CudaGemm, PlansAreBuiltOnceAndReused) {
  for (const Recipe& r : kRecipes) {
    SCOPED_TRACE(r.name);
    const std::string file = std::string(LOOM_TEST_PLUGIN_DIR) + "/libloom-precision-" + r.name + ".so";
    auto p = gpu_plugin(r.name);  // loads the library
    void* lib = dlopen(file.c_str(), RTLD_NOW | RTLD_NOLOAD);
    ASSERT_NE(lib, nullptr) << file << " is not loaded: " << dlerror();
    auto plans_built = reinterpret_cast<int64_t (*)()>(dlsym(lib, "loom_precision_cublaslt_plans_built"));
    ASSERT_NE(plans_built, nullptr) << "loom_precision_cublaslt_plans_built missing from " << file;

    const int m = 512, k = 256, n = 768;
    const int a = p->register_linear({"layer.0.q_proj", k, n, m});
    const int b = p->register_linear({"layer.1.q_proj", k, n, m});
    std::mt19937 rng(7);
    DevMatrix x(r.act, m, k), w(r.param, n, k), y(r.act, m, n), dy(r.act, m, n), dx(r.act, m, k), dw(r.grad, n, k),
        wide(r.act, m, k, /*pad=*/32);
    x.upload(random_values(size_t(m) * k, r.act, rng));
    w.upload(random_values(size_t(n) * k, r.param, rng));
    dy.upload(random_values(size_t(m) * n, r.act, rng));
    wide.upload(random_values(size_t(m) * k, r.act, rng));
    loom::Tensor tx = x.tensor(), tw = w.tensor(), ty = y.tensor(), tdy = dy.tensor(), tdx = dx.tensor(),
                 tdw = dw.tensor(), twide = wide.tensor();

    const int64_t c0 = plans_built();
    p->linear_forward(ctx_, a, tx, tw, ty, nullptr);
    sync();
    const std::vector<float> first = y.download();
    EXPECT_EQ(plans_built(), c0 + 1) << "first forward builds one plan";
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 50; ++i) p->linear_forward(ctx_, a, tx, tw, ty, nullptr);
    sync();
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 50;
    EXPECT_EQ(plans_built(), c0 + 1) << "repeated forwards reuse the plan";
    EXPECT_LE(rel_error(y.download(), to_double(first)), 1e-6) << "a reused plan computes the same product";
    std::printf("[ %s ] forward %dx%dx%d: %.1f us per call with a cached plan\n", r.name, m, k, n, us);

    p->linear_backward(ctx_, a, tx, tw, tdy, &tdx, tdw, false);
    EXPECT_EQ(plans_built(), c0 + 3) << "dgrad and wgrad get a plan each";
    for (int i = 0; i < 5; ++i) p->linear_backward(ctx_, a, tx, tw, tdy, &tdx, tdw, i % 2 == 0);
    p->linear_backward(ctx_, a, tx, tw, tdy, nullptr, tdw, true);
    EXPECT_EQ(plans_built(), c0 + 3) << "beta and a skipped dx do not need new plans";

    p->linear_forward(ctx_, b, tx, tw, ty, nullptr);
    EXPECT_EQ(plans_built(), c0 + 3) << "a linear of the same shape shares the plan (one cache per problem)";
    p->linear_forward(ctx_, a, twide, tw, ty, nullptr);
    p->linear_forward(ctx_, a, twide, tw, ty, nullptr);
    EXPECT_EQ(plans_built(), c0 + 4) << "another leading dimension gets one more plan, built once";
    p->linear_forward(ctx_, a, tx, tw, ty, nullptr);
    EXPECT_EQ(plans_built(), c0 + 4) << "the first shape's plan is still there";
    sync();
  }
}

// The plan counter of a loaded precision plugin (see PlansAreBuiltOnceAndReused).
using PlansBuilt = int64_t (*)();
PlansBuilt plans_counter(const char* recipe) {
  const std::string file = std::string(LOOM_TEST_PLUGIN_DIR) + "/libloom-precision-" + recipe + ".so";
  void* lib = dlopen(file.c_str(), RTLD_NOW | RTLD_NOLOAD);
  return lib ? reinterpret_cast<PlansBuilt>(dlsym(lib, "loom_precision_cublaslt_plans_built")) : nullptr;
}

// precision.gemm_algo (cublaslt_linear.hpp). "auto" (the default, which the
// other cases run) is "fastest" outside deterministic runs: every problem is
// timed once, on scratch D/C, when its first plan is built. Here: a second
// linear of the same shape reuses the timing; "heuristic", and "auto" in a
// deterministic run, time nothing; and the fastest pick leaves the call's own
// outputs right, an accumulated dW included (check_linear against fp64, at
// the llama-125m qkv shape and the llama-1b down_proj shape, where the timing
// of 2026-11-25 on an H100 picked other algorithms than the first for wgrad).
TEST_F(CudaGemm, FastestTimesEachProblemOnceAndComputesTheSameProduct) {
  for (const char* name : {"bf16", "bf16_pure"}) {
    SCOPED_TRACE(name);
    const Recipe& r = name == std::string("bf16") ? kRecipes[1] : kRecipes[2];
    auto p = gpu_plugin(name);
    auto timed = [] { return loom::gemm_timing_counts().timed; };
    auto switched = [] { return loom::gemm_timing_counts().switched; };

    // One odd shape no other case uses, so that its problems are new here.
    const int m = 1000, k = 328, n = 584;
    DevMatrix x(r.act, m, k), w(r.param, n, k), y(r.act, m, n), dy(r.act, m, n), dx(r.act, m, k), dw(r.grad, n, k);
    ASSERT_TRUE(x.base && w.base && y.base && dy.base && dx.base && dw.base);
    std::mt19937 rng(7);
    x.upload(random_values(size_t(m) * k, r.act, rng));
    w.upload(random_values(size_t(n) * k, r.param, rng));
    dy.upload(random_values(size_t(m) * n, r.act, rng));
    loom::Tensor tx = x.tensor(), tw = w.tensor(), ty = y.tensor(), tdy = dy.tensor(), tdx = dx.tensor(),
                 tdw = dw.tensor();
    auto run = [&](loom::Precision& q, int id) {
      q.linear_forward(ctx_, id, tx, tw, ty, nullptr);
      q.linear_backward(ctx_, id, tx, tw, tdy, &tdx, tdw, /*accumulate=*/true);
      sync();
    };
    const int64_t t0 = timed();
    const int a = p->register_linear({"layer.0.a", k, n, m}), b = p->register_linear({"layer.1.a", k, n, m});
    run(*p, a);
    EXPECT_EQ(timed(), t0 + 3) << "fprop, dgrad and wgrad are three problems, each timed once";
    run(*p, a);
    run(*p, b);
    EXPECT_EQ(timed(), t0 + 3) << "a repeated call and another linear of the same shape time nothing";

    auto heuristic = gpu_plugin(name, precision_table("plugin = \"x\"\ngemm_algo = \"heuristic\"\n"));
    run(*heuristic, heuristic->register_linear({"layer.0.a", k, n, m}));
    auto deterministic = gpu_plugin(name, loom::ConfigTable(), /*deterministic=*/true);
    run(*deterministic, deterministic->register_linear({"layer.0.a", k, n, m}));
    EXPECT_EQ(timed(), t0 + 3) << "\"heuristic\" and a deterministic run's \"auto\" time nothing";
    EXPECT_LE(switched(), timed());

    for (const char* algo : {"fastest", "heuristic"}) {
      SCOPED_TRACE(algo);
      const loom::ConfigTable c = precision_table(loom::cat("plugin = \"x\"\ngemm_algo = \"", algo, "\"\n"));
      check_linear(r, 2048, 768, 2304, 0, 0, 1, c);
      check_linear(r, 2048, 5632, 2048, 0, 0, 1, c);
    }
  }
}

// "fastest" leaves variable-row linears (MoE experts) on the heuristic's
// answer (a pick timed at one row count may not run at another): nothing is
// timed, and every row count (smaller, the maximum, one, either side of a
// bucket's edge) computes the right product, the accumulated dW included
// (fp64 reference, the recipe's tolerance). The plans of every row bucket
// are built at the first call, shared by both experts: later row counts and
// the second expert build none.
TEST_F(CudaGemm, FastestOnVariableRowLinears) {
  for (const char* name : {"bf16", "bf16_pure"}) {
    SCOPED_TRACE(name);
    const Recipe& r = name == std::string("bf16") ? kRecipes[1] : kRecipes[2];
    auto p = gpu_plugin(name);
    const PlansBuilt plans_built = plans_counter(name);
    ASSERT_NE(plans_built, nullptr) << "loom_precision_cublaslt_plans_built missing from the " << name << " plugin";
    const int max_rows = 1536, k = 344, n = 712;  // a shape no other case uses
    loom::LinearDesc e0{"layer.0.expert.0.w1", k, n, max_rows, loom::LinearRole::hidden, true};
    loom::LinearDesc e1 = e0;
    e1.name = "layer.0.expert.1.w1";
    const int id0 = p->register_linear(e0), id1 = p->register_linear(e1);
    const int64_t t0 = loom::gemm_timing_counts().timed;
    std::mt19937 rng(11);
    int calls = 0;
    const int64_t c0 = plans_built();
    int64_t after_first = -1;
    for (int m : {600, 1536, 96, 1, 256, 257, 1535, 600}) {
      for (int id : {id0, id1}) {
        SCOPED_TRACE(::testing::Message() << "m=" << m << " expert " << id);
        const std::vector<float> x = random_values(size_t(m) * k, r.act, rng),
                                 w = random_values(size_t(n) * k, r.param, rng),
                                 dy = random_values(size_t(m) * n, r.act, rng),
                                 dw0 = random_values(size_t(n) * k, r.grad, rng);
        DevMatrix xb(r.act, m, k), wb(r.param, n, k), yb(r.act, m, n), dyb(r.act, m, n), dxb(r.act, m, k),
            dwb(r.grad, n, k);
        ASSERT_TRUE(xb.base && wb.base && yb.base && dyb.base && dxb.base && dwb.base);
        xb.upload(x);
        wb.upload(w);
        dyb.upload(dy);
        dwb.upload(dw0);
        loom::Tensor tx = xb.tensor(), tw = wb.tensor(), ty = yb.tensor(), tdy = dyb.tensor(), tdx = dxb.tensor(),
                     tdw = dwb.tensor();
        p->linear_forward(ctx_, id, tx, tw, ty, nullptr);
        p->linear_backward(ctx_, id, tx, tw, tdy, &tdx, tdw, /*accumulate=*/true);
        sync();
        const std::vector<double> xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
        EXPECT_LE(rel_error(yb.download(), ref_forward(xd, wd, m, k, n)), r.tol) << "forward";
        EXPECT_LE(rel_error(dxb.download(), ref_dgrad(dyd, wd, m, k, n)), r.tol) << "dx";
        EXPECT_LE(rel_error(dwb.download(), ref_wgrad(dyd, xd, m, k, n, to_double(dw0))), r.tol) << "dW accumulated";
        if (calls == 0) {
          after_first = plans_built();
          // 1536 rows: buckets 256, 512, ..., 1536 (6), for fprop, dgrad and wgrad.
          EXPECT_GE(after_first - c0, 18) << "the first call builds every bucket's plans";
        } else {
          EXPECT_EQ(plans_built(), after_first) << "a later row count or expert built a plan";
        }
        ++calls;
      }
    }
    EXPECT_EQ(calls, 16);
    EXPECT_EQ(loom::gemm_timing_counts().timed, t0) << "variable-row linears time nothing";
  }
}

// y = x W^T + residual, the residual being cuBLASLt's C input (beta = 1), in
// the three ways a fused layer hands it in: its own buffer, y itself (in place),
// and a row view of a wider buffer (own leading dimension, 16/32-byte aligned
// start); against the fp64 host reference of the same (device-rounded) inputs.
// Tolerances are the recipes' own (fp32 1e-5, bf16 1e-2), as for the plain
// forward: the residual is one more term of the fp32 epilogue before D is
// rounded once to its dtype, so the error budget is unchanged (bf16: the output
// rounding, 2^-9 relative; fp32: K = 96 fp32 products, ~1e-7), while a residual
// dropped, added twice or read with the wrong stride is off by O(1). Each case
// runs twice: the repeat must reuse the first call's plan.
TEST_F(CudaGemm, ResidualIsTheCInput) {
  for (const Recipe& r : kRecipes) {
    SCOPED_TRACE(r.name);
    auto p = gpu_plugin(r.name);  // loads the library
    const PlansBuilt plans_built = plans_counter(r.name);
    ASSERT_NE(plans_built, nullptr) << "loom_precision_cublaslt_plans_built missing from the " << r.name << " plugin";
    const int m = 257, k = 96, n = 160;
    const int id = p->register_linear({"layer.5.o_proj", k, n, m});
    std::mt19937 rng(4321);
    const std::vector<float> x = random_values(size_t(m) * k, r.act, rng),
                             w = random_values(size_t(n) * k, r.param, rng),
                             res = random_values(size_t(m) * n, r.act, rng);
    std::vector<double> ref = ref_forward(to_double(x), to_double(w), m, k, n);
    for (size_t i = 0; i < ref.size(); ++i) ref[i] += res[i];
    DevMatrix xb(r.act, m, k), wb(r.param, n, k);
    ASSERT_TRUE(xb.base && wb.base) << "cudaMalloc failed";
    xb.upload(x);
    wb.upload(w);
    const loom::Tensor tx = xb.tensor(), tw = wb.tensor();

    {
      SCOPED_TRACE("residual in its own buffer");
      DevMatrix yb(r.act, m, n), rb(r.act, m, n);
      ASSERT_TRUE(yb.base && rb.base);
      loom::Tensor ty = yb.tensor(), tr = rb.tensor();
      int64_t plans = 0;
      for (int rep = 0; rep < 2; ++rep) {
        yb.poison();
        rb.upload(res);
        p->linear_forward(ctx_, id, tx, tw, ty, &tr);
        sync();
        if (rep == 0) plans = plans_built();
        EXPECT_LE(rel_error(yb.download(), ref), r.tol) << "rep " << rep;
        EXPECT_TRUE(rb.download() == res) << "the residual was written";
      }
      EXPECT_EQ(plans_built(), plans) << "the repeated call built a plan";
    }
    {
      SCOPED_TRACE("residual is y");
      DevMatrix yb(r.act, m, n);
      ASSERT_TRUE(yb.base);
      loom::Tensor ty = yb.tensor();
      int64_t plans = 0;
      for (int rep = 0; rep < 2; ++rep) {
        yb.upload(res);
        p->linear_forward(ctx_, id, tx, tw, ty, &ty);
        sync();
        if (rep == 0) plans = plans_built();
        EXPECT_LE(rel_error(yb.download(), ref), r.tol) << "rep " << rep;
      }
      EXPECT_EQ(plans_built(), plans) << "the repeated call built a plan";
    }
    {
      SCOPED_TRACE("residual and y as row views of wider buffers");
      DevMatrix yb(r.act, m, n, /*pad=*/24, /*off=*/8), rb(r.act, m, n, /*pad=*/40, /*off=*/8);
      ASSERT_TRUE(yb.base && rb.base);
      loom::Tensor ty = yb.tensor(), tr = rb.tensor();
      int64_t plans = 0;
      for (int rep = 0; rep < 2; ++rep) {
        yb.poison();
        rb.poison();  // the residual's padding: a GEMM reading it with the wrong stride gets NaN
        rb.upload(res);
        p->linear_forward(ctx_, id, tx, tw, ty, &tr);
        sync();
        if (rep == 0) plans = plans_built();
        EXPECT_LE(rel_error(yb.download(), ref), r.tol) << "rep " << rep;
        EXPECT_TRUE(yb.padding_untouched()) << "the forward wrote outside y's rows";
        EXPECT_TRUE(rb.padding_untouched() && rb.download() == res) << "the residual's buffer was written";
      }
      EXPECT_EQ(plans_built(), plans) << "the repeated call built a plan";
    }
  }
}

// The GEMM wrappers run a few hundred times a step: once a shape's plans exist
// they must not allocate (tests/alloc_counter.hpp counts operator new/delete in
// the whole process while a window is open; allocations inside NVIDIA's
// libraries are reported apart). 100 steps of the five calls a layer makes.
TEST_F(CudaGemm, HotPathAllocatesNothing) {
  loom_test::AllocCounter counter;
  for (const Recipe& r : kRecipes) {
    SCOPED_TRACE(r.name);
    auto p = gpu_plugin(r.name);
    const PlansBuilt plans_built = plans_counter(r.name);
    ASSERT_NE(plans_built, nullptr);
    const int m = 256, k = 128, n = 384;
    const int id = p->register_linear({"layer.0.gate_proj", k, n, m});
    std::mt19937 rng(99);
    DevMatrix x(r.act, m, k), w(r.param, n, k), y(r.act, m, n), res(r.act, m, n), dy(r.act, m, n), dx(r.act, m, k),
        dw(r.grad, n, k);
    ASSERT_TRUE(x.base && w.base && y.base && res.base && dy.base && dx.base && dw.base) << "cudaMalloc failed";
    x.upload(random_values(size_t(m) * k, r.act, rng));
    w.upload(random_values(size_t(n) * k, r.param, rng));
    res.upload(random_values(size_t(m) * n, r.act, rng));
    dy.upload(random_values(size_t(m) * n, r.act, rng));
    const loom::Tensor tx = x.tensor(4), tw = w.tensor(), tres = res.tensor(), tdy = dy.tensor();
    loom::Tensor ty = y.tensor(4), tdx = dx.tensor(), tdw = dw.tensor();
    auto step = [&] {
      p->linear_forward(ctx_, id, tx, tw, ty, nullptr);
      p->linear_forward(ctx_, id, tx, tw, ty, &tres);
      p->linear_forward(ctx_, id, tx, tw, ty, &ty);
      p->linear_backward(ctx_, id, tx, tw, tdy, &tdx, tdw, /*accumulate=*/false);
      p->linear_backward(ctx_, id, tx, tw, tdy, nullptr, tdw, /*accumulate=*/true);
    };
    step();  // warm-up: builds the plans
    sync();
    const int64_t plans = plans_built();

    counter.start();
    for (int i = 0; i < 100; ++i) step();
    const loom_test::AllocCounts c = counter.stop();
    sync();
    EXPECT_EQ(c.ours_new, 0) << "500 GEMM calls allocated; the first allocation came from:" << c.first_ours;
    EXPECT_EQ(c.ours_delete, 0);
    EXPECT_EQ(plans_built(), plans) << "the calls after the warm-up built plans";
    std::printf("[ %s ] 500 GEMM calls: %lld allocations and %lld frees inside NVIDIA's libraries (not ours)\n",
                r.name, static_cast<long long>(c.vendor_new), static_cast<long long>(c.vendor_delete));

    // The counter sees what the plugin allocates: a refused call formats its message.
    counter.start();
    try {
      p->linear_forward(ctx_, id + 1, tx, tw, ty, nullptr);
    } catch (const loom::Error&) {
    }
    const loom_test::AllocCounts err = counter.stop();
    EXPECT_GT(err.ours_new, 0) << "the counting operator new does not see the plugin's allocations";
  }
}

// ---------------------------------------------------------------------------
// No device needed: construction, options and argument checks.
// ---------------------------------------------------------------------------
TEST(CudaGemmPlugins, Bf16RecipesRefuseTheCpu) {
  for (const char* name : {"bf16", "bf16_pure"}) {
    const std::string e = error_of([&] { make(name, Device::cpu); });
    EXPECT_TRUE(contains(e, loom::cat("precision.plugin = \"", name, "\" runs on CUDA only")) &&
                contains(e, "precision.plugin = \"fp32\" for the CPU reference"))
        << name << ": " << e;
  }
}

TEST(CudaGemmPlugins, DTypesAndOptions) {
  auto fp32 = make("fp32", Device::cuda);
  loom::PrecisionDTypes t = fp32->dtypes();
  EXPECT_TRUE(t.param == DType::f32 && t.grad == DType::f32 && t.activation == DType::f32 && !t.has_master);
  EXPECT_EQ(fp32->workspace_bytes(), kWorkspace);
  EXPECT_EQ(make("fp32", Device::cpu)->workspace_bytes(), 0u) << "the CPU path needs no device workspace";

  t = make("bf16", Device::cuda)->dtypes();
  EXPECT_TRUE(t.param == DType::bf16 && t.master == DType::f32 && t.grad == DType::f32 &&
              t.optim_state == DType::f32 && t.activation == DType::bf16 && t.has_master && !t.stochastic_rounding);

  t = make("bf16_pure", Device::cuda)->dtypes();
  EXPECT_TRUE(t.param == DType::bf16 && t.master == DType::bf16 && t.grad == DType::bf16 &&
              t.optim_state == DType::bf16 && t.activation == DType::bf16 && !t.has_master && !t.stochastic_rounding);
  t = make("bf16_pure", Device::cuda, precision_table("plugin = \"bf16_pure\"\nstochastic_rounding = true\n"))->dtypes();
  EXPECT_TRUE(t.stochastic_rounding);

  for (const char* name : {"fp32", "bf16", "bf16_pure"}) {
    const std::string e =
        error_of([&] { make(name, Device::cuda, precision_table("plugin = \"x\"\nstochastic_rounding_x = 1\n")); });
    EXPECT_TRUE(contains(e, "unknown key 'precision.stochastic_rounding_x'")) << name << ": " << e;
  }
}

TEST(CudaGemmPlugins, GemmAlgoOption) {
  for (const char* name : {"bf16", "bf16_pure"}) {
    SCOPED_TRACE(name);
    for (const char* v : {"auto", "heuristic", "fastest"})
      EXPECT_EQ(error_of([&] { make(name, Device::cuda, precision_table(loom::cat("plugin = \"x\"\ngemm_algo = \"", v, "\"\n"))); }),
                "")
          << v;
    std::string e = error_of([&] {
      make(name, Device::cuda, precision_table("plugin = \"x\"\ngemm_algo = \"fastest\"\n"), /*deterministic=*/true);
    });
    EXPECT_TRUE(contains(e, "gemm_algo") && contains(e, "run.deterministic = true") &&
                contains(e, "gemm_algo = \"heuristic\""))
        << e;
    EXPECT_EQ(error_of([&] { make(name, Device::cuda, loom::ConfigTable(), /*deterministic=*/true); }), "")
        << "\"auto\" is allowed in a deterministic run";
    e = error_of([&] { make(name, Device::cuda, precision_table("plugin = \"x\"\ngemm_algo = \"tuned\"\n")); });
    EXPECT_TRUE(contains(e, "gemm_algo") && contains(e, "tuned") && contains(e, "heuristic")) << e;
  }
}

TEST(CudaGemmPlugins, ArgumentErrorsNameTheLinear) {
  // Checks run before any CUDA call, so fake (never dereferenced) addresses do here.
  alignas(256) static unsigned char fake[512];
  auto p = make("bf16", Device::cuda);
  const int id = p->register_linear({"layer.3.up_proj", 8, 16, 32});
  loom::ExecContext ctx;
  ctx.device = Device::cuda;
  ctx.blas_handle = fake;
  loom::Tensor x(fake, DType::bf16, Device::cuda, {32, 8}), w(fake, DType::bf16, Device::cuda, {16, 8}),
      y(fake, DType::bf16, Device::cuda, {32, 16}), dw(fake, DType::f32, Device::cuda, {16, 8});

  EXPECT_TRUE(contains(error_of([&] { p->linear_forward(ctx, id, x, w, y, nullptr); }), "set_workspace"));
  p->set_workspace(fake, sizeof(fake));
  EXPECT_TRUE(contains(error_of([&] { p->set_workspace(fake + 8, 64); }), "256-byte aligned"));

  loom::Tensor bad = x;
  bad.dtype = DType::f32;
  std::string e = error_of([&] { p->linear_forward(ctx, id, bad, w, y, nullptr); });
  EXPECT_TRUE(contains(e, "layer.3.up_proj: x must be bf16, got fp32")) << e;
  loom::Tensor bad_dw = dw;
  bad_dw.dtype = DType::bf16;
  e = error_of([&] { p->linear_backward(ctx, id, x, w, y, nullptr, bad_dw, false); });
  EXPECT_TRUE(contains(e, "layer.3.up_proj: dw must be fp32, got bf16")) << e;
  loom::Tensor wt(fake, DType::bf16, Device::cuda, {8, 16});
  e = error_of([&] { p->linear_forward(ctx, id, x, wt, y, nullptr); });
  EXPECT_TRUE(contains(e, "[out, in] = [16,8]")) << e;
  loom::Tensor host = x;
  host.device = Device::cpu;
  e = error_of([&] { p->linear_forward(ctx, id, host, w, y, nullptr); });
  EXPECT_TRUE(contains(e, "x is on cpu")) << e;
  loom::Tensor many(fake, DType::bf16, Device::cuda, {64, 8});
  e = error_of([&] { p->linear_forward(ctx, id, many, w, y, nullptr); });
  EXPECT_TRUE(contains(e, "max_rows=32")) << e;
  // The residual (C input): y's dtype and shape, and y itself or no element of it.
  loom::Tensor r32 = y;
  r32.dtype = DType::f32;
  e = error_of([&] { p->linear_forward(ctx, id, x, w, y, &r32); });
  EXPECT_TRUE(contains(e, "layer.3.up_proj: residual must be bf16, got fp32")) << e;
  loom::Tensor rnarrow(fake, DType::bf16, Device::cuda, {32, 8});
  e = error_of([&] { p->linear_forward(ctx, id, x, w, y, &rnarrow); });
  EXPECT_TRUE(contains(e, "layer.3.up_proj: residual is [32, 8] but y is [32, 16]")) << e;
  loom::Tensor rshift(fake + 2, DType::bf16, Device::cuda, {32, 16});  // y one element on
  e = error_of([&] { p->linear_forward(ctx, id, x, w, y, &rshift); });
  EXPECT_TRUE(contains(e, "layer.3.up_proj: residual overlaps y without being y")) << e;
  loom::Tensor rstride = y;  // y's start with another row stride
  rstride.stride[0] = 24;
  e = error_of([&] { p->linear_forward(ctx, id, x, w, y, &rstride); });
  EXPECT_TRUE(contains(e, "layer.3.up_proj: residual overlaps y without being y")) << e;
  e = error_of([&] { p->linear_forward(ctx, 5, x, w, y, nullptr); });
  EXPECT_TRUE(contains(e, "linear id 5 was never registered")) << e;
  loom::ExecContext cpu_ctx;
  e = error_of([&] { p->linear_forward(cpu_ctx, id, x, w, y, nullptr); });
  EXPECT_TRUE(contains(e, "created for device cuda")) << e;
  ctx.blas_handle = nullptr;
  e = error_of([&] { p->linear_forward(ctx, id, x, w, y, nullptr); });
  EXPECT_TRUE(contains(e, "blas_handle is null")) << e;
}

}  // namespace

#else  // !LOOM_HAVE_CUDA

TEST(CudaGemm, Skipped) { GTEST_SKIP() << "loom built without CUDA: the cuBLASLt precision plugins do not exist"; }

#endif
