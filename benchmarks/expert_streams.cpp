// expert_streams_bench: would the MoE block gain from running its experts'
// GEMMs on several CUDA streams?
//
//   build/bin/expert_streams_bench [--rows=r0,r1,...] [--hidden=H] [--ffn=F] [--layers=L] [--iters=N]
//
// The MoE block (blocks/ffn_moe.cpp) runs each expert's GEMMs
// one after another on the compute stream: forward [w1; w3] (y = x W13^T,
// [rows, 2f]) and w2; backward w2's dgrad and wgrad, then [w1; w3]'s dgrad
// and wgrad. Each expert's GEMM has a few waves of tiles, and its last wave
// leaves SMs idle that the next expert's GEMM could use if it were on another
// stream. This benchmark runs those GEMMs (bf16, fp32 compute, bf16 D, the
// layouts of plugins/precision/common/cublaslt_linear.cpp, the heuristic's
// first algorithm, a 32 MiB workspace per stream) for `layers` layers of E
// experts, with expert e on stream e mod S for S = 1..4 (events fork and join
// the streams once per layer, as a block would), and prints the median of
// `iters` timed passes per direction. Four sets of weights rotate over the
// layers so that no layer finds its weights in L2.
//
// Defaults: mixtral-small's experts (hidden 2048, ffn 5632, 16 layers, 8
// experts) with a spread of rows like its router's at the start of training
// (16384 rows = 8192 tokens x top-2).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_util.hpp"

namespace {


constexpr size_t kWorkspace = size_t{32} << 20;

// One column-major cuBLASLt problem D[m, n] = op(A) op(B), its algorithm and operands.
struct Gemm {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  const void *pa = nullptr, *pb = nullptr;
  void* pd = nullptr;
};

Gemm make_gemm(cublasLtHandle_t lt, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k,
               const void* a, int64_t lda, const void* b, int64_t ldb, void* d, const std::string& what) {
  Gemm g;
  g.pa = a;
  g.pb = b;
  g.pd = d;
  LT_CHECK(cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), what);
  LT_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), what);
  LT_CHECK(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), what);
  LT_CHECK(cublasLtMatrixLayoutCreate(&g.a, CUDA_R_16BF, ta == CUBLAS_OP_N ? m : k, ta == CUBLAS_OP_N ? k : m, lda),
           what, " A");
  LT_CHECK(cublasLtMatrixLayoutCreate(&g.b, CUDA_R_16BF, tb == CUBLAS_OP_N ? k : n, tb == CUBLAS_OP_N ? n : k, ldb),
           what, " B");
  LT_CHECK(cublasLtMatrixLayoutCreate(&g.d, CUDA_R_16BF, m, n, m), what, " D");
  cublasLtMatmulPreference_t pref;
  LT_CHECK(cublasLtMatmulPreferenceCreate(&pref), what);
  const uint64_t ws = kWorkspace;
  LT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)), what);
  cublasLtMatmulHeuristicResult_t r{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, g.op, g.a, g.b, g.d, g.d, pref, 1, &r, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  LT_CHECK(st, what, " heuristic");
  if (found == 0) throw loom::Error(loom::cat(what, ": cuBLASLt has no algorithm"));
  g.algo = r.algo;
  return g;
}

// A device buffer of n bytes, with random bf16 values ~ N(0, sd) when sd > 0.
struct DevMem : loom::bench::DevMem {
  explicit DevMem(size_t n, float sd = 0.f, uint32_t seed = 0) : loom::bench::DevMem(n) {
    if (sd > 0.f) loom::bench::fill_bf16(p, n / 2, sd, seed);
  }
};

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  size_t i = 0;
  while (i <= s.size()) {
    const size_t j = std::min(s.find(',', i), s.size());
    const std::string t = s.substr(i, j - i);
    char* end = nullptr;
    const long long x = std::strtoll(t.c_str(), &end, 10);
    if (t.empty() || *end != '\0' || x < 1 || x > (1 << 20))
      throw loom::Error(loom::cat("--rows=", s, ": '", t, "' is not a row count in [1, 1048576]"));
    v.push_back(x);
    i = j + 1;
  }
  return v;
}

int64_t parse_int(const std::string& arg, size_t prefix, int64_t lo, int64_t hi) {
  char* end = nullptr;
  const long long x = std::strtoll(arg.c_str() + prefix, &end, 10);
  if (arg.size() == prefix || *end != '\0' || x < lo || x > hi)
    throw loom::Error(loom::cat(arg, ": expected an integer in [", lo, ", ", hi, "]"));
  return x;
}

int run(int argc, char** argv) {
  std::vector<int64_t> rows = {1856, 2240, 2096, 2144, 1824, 2208, 1984, 2032};
  int64_t h = 2048, f = 5632, layers = 16, iters = 7;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--rows=", 0) == 0) rows = parse_list(a.substr(7));
    else if (a.rfind("--hidden=", 0) == 0) h = parse_int(a, 9, 16, 65536);
    else if (a.rfind("--ffn=", 0) == 0) f = parse_int(a, 6, 16, 262144);
    else if (a.rfind("--layers=", 0) == 0) layers = parse_int(a, 9, 1, 1024);
    else if (a.rfind("--iters=", 0) == 0) iters = parse_int(a, 8, 3, 1000);
    else {
      std::fprintf(stderr,
                   "expert_streams_bench: unknown argument '%s'\nusage: expert_streams_bench [--rows=r0,r1,...] "
                   "[--hidden=H] [--ffn=F] [--layers=L] [--iters=N]\n",
                   a.c_str());
      return 2;
    }
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::fprintf(stderr, "expert_streams_bench: no CUDA device here\n");
    return 1;
  }
  const int64_t E = static_cast<int64_t>(rows.size());
  int64_t total = 0;
  for (int64_t r : rows) total += r;
  constexpr int kSets = 4, kMaxStreams = 4;
  cublasLtHandle_t lt;
  LT_CHECK(cublasLtCreate(&lt), "handle");
  const size_t B = 2;  // bf16
  // Inputs random (x, act: activations; deout, dgu: gradients); outputs written by the GEMMs.
  DevMem x(total * h * B, 1.0f, 1), gu(total * 2 * f * B), act(total * f * B, 0.5f, 2), eout(total * h * B),
      dgu(total * 2 * f * B, 1e-3f, 3), dact(total * f * B), dx(total * h * B), deout(total * h * B, 1e-3f, 4);
  std::vector<std::unique_ptr<DevMem>> weights;
  std::vector<std::vector<Gemm>> fwd(kSets * E), bwd(kSets * E);
  auto at = [](void* base, int64_t row, int64_t cols) { return static_cast<char*>(base) + row * cols * 2; };
  for (int s = 0; s < kSets; ++s) {
    int64_t r0 = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t m = rows[static_cast<size_t>(e)];
      const auto seed = static_cast<uint32_t>(10 + s * E + e);
      auto w13 = std::make_unique<DevMem>(2 * f * h * B, 0.02f, seed), w2 = std::make_unique<DevMem>(h * f * B, 0.02f, seed),
           dw13 = std::make_unique<DevMem>(2 * f * h * B), dw2 = std::make_unique<DevMem>(h * f * B);
      const std::string what = loom::cat("set ", s, " expert ", e, " (", m, " rows)");
      auto& F = fwd[static_cast<size_t>(s * E + e)];
      auto& G = bwd[static_cast<size_t>(s * E + e)];
      // fprop "TN": D^T[out, rows] = W^T^T x^T
      F.push_back(make_gemm(lt, CUBLAS_OP_T, CUBLAS_OP_N, 2 * f, m, h, w13->p, h, at(x.p, r0, h), h,
                            at(gu.p, r0, 2 * f), what + " w13 fprop"));
      F.push_back(make_gemm(lt, CUBLAS_OP_T, CUBLAS_OP_N, h, m, f, w2->p, f, at(act.p, r0, f), f, at(eout.p, r0, h),
                            what + " w2 fprop"));
      // dgrad "NN": dx^T[in, rows] = W^T dy^T; wgrad "NT": dW^T[in, out] = x^T dy
      G.push_back(make_gemm(lt, CUBLAS_OP_N, CUBLAS_OP_N, f, m, h, w2->p, f, at(deout.p, r0, h), h,
                            at(dact.p, r0, f), what + " w2 dgrad"));
      G.push_back(make_gemm(lt, CUBLAS_OP_N, CUBLAS_OP_T, f, h, m, at(act.p, r0, f), f, at(deout.p, r0, h), h,
                            dw2->p, what + " w2 wgrad"));
      G.push_back(make_gemm(lt, CUBLAS_OP_N, CUBLAS_OP_N, h, m, 2 * f, w13->p, h, at(dgu.p, r0, 2 * f), 2 * f,
                            at(dx.p, r0, h), what + " w13 dgrad"));
      G.push_back(make_gemm(lt, CUBLAS_OP_N, CUBLAS_OP_T, h, 2 * f, m, at(x.p, r0, h), h, at(dgu.p, r0, 2 * f), 2 * f,
                            dw13->p, what + " w13 wgrad"));
      for (auto* w : {&w13, &w2, &dw13, &dw2}) weights.push_back(std::move(*w));
      r0 += m;
    }
  }
  cudaStream_t st[kMaxStreams];
  std::vector<std::unique_ptr<DevMem>> ws;
  for (auto& s : st) {
    LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
    ws.push_back(std::make_unique<DevMem>(kWorkspace));
  }
  cudaEvent_t fork, join[kMaxStreams], t0, t1;
  LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), "event");
  for (auto& e : join) LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event");
  LOOM_CUDA_CHECK(cudaEventCreate(&t0), "event");
  LOOM_CUDA_CHECK(cudaEventCreate(&t1), "event");
  const float one = 1.0f, zero = 0.0f;
  auto pass = [&](int S, bool backward) {
    for (int64_t l = 0; l < layers; ++l) {
      if (S > 1) {
        LOOM_CUDA_CHECK(cudaEventRecord(fork, st[0]), "fork");
        for (int j = 1; j < S; ++j) LOOM_CUDA_CHECK(cudaStreamWaitEvent(st[j], fork), "fork wait");
      }
      for (int64_t e = 0; e < E; ++e) {
        const int j = static_cast<int>(e % S);
        for (Gemm& g : (backward ? bwd : fwd)[static_cast<size_t>((l % kSets) * E + e)])
          LT_CHECK(cublasLtMatmul(lt, g.op, &one, g.pa, g.a, g.pb, g.b, &zero, g.pd, g.d, g.pd, g.d, &g.algo,
                                  ws[static_cast<size_t>(j)]->p, kWorkspace, st[j]),
                   "layer ", l, " expert ", e, " stream ", j);
      }
      for (int j = 1; j < S; ++j) {
        LOOM_CUDA_CHECK(cudaEventRecord(join[j], st[j]), "join");
        LOOM_CUDA_CHECK(cudaStreamWaitEvent(st[0], join[j]), "join wait");
      }
    }
  };
  double flops = 0;
  for (int64_t r : rows) flops += 2.0 * static_cast<double>(r) * static_cast<double>(h) * 3.0 * static_cast<double>(f);
  flops *= static_cast<double>(layers);
  cudaDeviceProp prop{};
  LOOM_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0), "device 0");
  std::printf("# Expert GEMMs on 1 to %d streams\n\nGPU: %s; %lld layers x %lld experts, hidden %lld, ffn %lld, rows",
              kMaxStreams, prop.name, static_cast<long long>(layers), static_cast<long long>(E),
              static_cast<long long>(h), static_cast<long long>(f));
  for (int64_t r : rows) std::printf(" %lld", static_cast<long long>(r));
  std::printf("; median of %lld passes after 2 warm-up passes\n\n", static_cast<long long>(iters));
  std::printf("| streams | forward ms | TFLOP/s | backward ms | TFLOP/s | forward + backward ms | vs 1 stream |\n");
  std::printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  double base = 0;
  for (int S = 1; S <= kMaxStreams; ++S) {
    double ms[2];
    for (int back = 0; back < 2; ++back) {
      for (int w = 0; w < 2; ++w) pass(S, back != 0);
      std::vector<float> t;
      for (int64_t it = 0; it < iters; ++it) {
        LOOM_CUDA_CHECK(cudaEventRecord(t0, st[0]), "record");
        pass(S, back != 0);
        LOOM_CUDA_CHECK(cudaEventRecord(t1, st[0]), "record");
        LOOM_CUDA_CHECK(cudaEventSynchronize(t1), "sync");
        float x_ms = 0;
        LOOM_CUDA_CHECK(cudaEventElapsedTime(&x_ms, t0, t1), "elapsed");
        t.push_back(x_ms);
      }
      std::sort(t.begin(), t.end());
      ms[back] = t[t.size() / 2];
    }
    const double sum = ms[0] + ms[1];
    if (S == 1) base = sum;
    std::printf("| %d | %.2f | %.0f | %.2f | %.0f | %.2f | %.3fx |\n", S, ms[0], flops / ms[0] / 1e9, ms[1],
                2 * flops / ms[1] / 1e9, sum, sum / base);
  }
  LT_CHECK(cublasLtDestroy(lt), "destroy");
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return loom::bench::main_of("expert_streams_bench", run, argc, argv); }
