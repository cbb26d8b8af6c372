// fp8_gemm_bench: cuBLASLt bf16 against FP8 GEMMs on the linear shapes of
// llama-1b and llama2-7b, the FP8 cast kernels, and a probe of block-scaled
// FP8 (DeepSeek-V3 style 1x128 / 128x128 scales) in cuBLASLt.
//
//   build/bin/fp8_gemm_bench [--model=llama-1b|llama2-7b|all] [--iters=N] [--warmup=N]
//                            [--gemm-algo=fastest|heuristic] [--probe-only] [--algos]
//
// For every linear of a layer (qkv, o_proj, gate_up packed [2 ffn, hidden],
// down) and each of its GEMMs (fprop y = x W^T, dgrad dx = dy W, wgrad
// dW += dy^T x), the bf16 GEMM as the bf16 recipe runs it (plugins/precision/
// common/cublaslt_linear.cpp: TN / NN / NT) and the FP8 GEMM as
// loom/ops/gemm.hpp maps it (all TN on transposed FP8 copies, E4M3
// x/W, E5M2 dy, fast accumulation for fprop only); the wgrad twice, adding to
// fp32 dW (a later micro-batch with fp32 gradients) and writing bf16 dW (the
// one micro-batch of the bf16_pure and FP8 bench workloads, master = "bf16"),
// each timed with CUDA events around every call: `warmup` calls, then the
// median of `iters` (>= 20). Every GEMM runs on the algorithm the recipes pick
// under `--gemm-algo` (default "fastest", what precision.gemm_algo = "auto"
// runs: the fastest of the heuristic's first 8 answers, timed once per
// problem by loom/gemm_algo.hpp during the warm-up calls; "heuristic": its
// first answer), for bf16 and FP8 alike. TFLOP/s counts 2 m n k. The casts (x, W, dy to
// FP8 with their transposed copies and amax, fp8_cast) are timed the same way
// and reported apart; the W cast runs once per optimizer step, so with
// gradient accumulation its share per micro-batch shrinks. Beside them, the
// block-scaled GEMMs of the fp8_block recipe (loom/ops/gemm.hpp:
// E4M3, x and dy in 1x128 tiles, W in 128x128 blocks, wgrad operands in 1x128
// tiles along the tokens, no fast accumulation) and its block casts (x and
// dy: the 1x128 cast plus the transposed 128x1 cast; W: 128x128 into W and
// W^T), per layer alone and with the casts. Output: markdown
// tables, the per-layer totals and the FP8/bf16 ratio (goal >= 1.6x on the
// 7B shapes), then the probe: for each pair of A/B scale modes, what
// cublasLtMatmulDescSetAttribute and cublasLtMatmulAlgoGetHeuristic answer
// (status, algorithms found) and, where an algorithm exists, whether a
// matmul runs and how fast.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <random>
#include <string>
#include <vector>

#include "hf/safetensors.hpp"
#include "loom/error.hpp"
#include "loom/fp8_block.hpp"
#include "loom/gemm_algo.hpp"
#include "loom/ops/cuda_check.hpp"
#include "loom/ops/fp8_block_cast.hpp"
#include "loom/ops/fp8_cast.hpp"
#include "loom/ops/gemm.hpp"
#include "bench_util.hpp"

namespace {

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

using loom::Device;
using loom::DType;
using loom::Tensor;
using loom::bench::DevMem;
using loom::bench::fill_bf16;

struct Model {
  const char* name;
  int64_t hidden, ffn, heads, kv_heads, head_dim, tokens;
};
const Model kModels[] = {
    {"llama-1b", 2048, 5632, 32, 4, 64, 16384},
    {"llama2-7b", 4096, 11008, 32, 32, 128, 2048},
};

struct Linear {
  const char* name;
  int64_t out, in;
};
std::vector<Linear> linears_of(const Model& m) {
  return {{"qkv", (m.heads + 2 * m.kv_heads) * m.head_dim, m.hidden},
          {"o_proj", m.hidden, m.heads * m.head_dim},
          {"gate_up", 2 * m.ffn, m.hidden},
          {"down", m.hidden, m.ffn}};
}

// Median of `iters` event-timed calls after `warmup` untimed ones, in ms.
template <typename F>
double time_ms(cudaStream_t s, int warmup, int iters, F&& f) {
  cudaEvent_t a, b;
  LOOM_CUDA_CHECK(cudaEventCreate(&a), "event");
  LOOM_CUDA_CHECK(cudaEventCreate(&b), "event");
  for (int i = 0; i < warmup; ++i) f();
  std::vector<float> t(static_cast<size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    LOOM_CUDA_CHECK(cudaEventRecord(a, s), "record");
    f();
    LOOM_CUDA_CHECK(cudaEventRecord(b, s), "record");
    LOOM_CUDA_CHECK(cudaEventSynchronize(b), "sync");
    LOOM_CUDA_CHECK(cudaEventElapsedTime(&t[static_cast<size_t>(i)], a, b), "elapsed");
  }
  LOOM_CUDA_CHECK(cudaEventDestroy(a), "event");
  LOOM_CUDA_CHECK(cudaEventDestroy(b), "event");
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// A column-major cuBLASLt problem D[M, N] = op(A) op(B) (+ beta D), built
// once: its descriptor and layouts (C takes D's layout), destroyed with it,
// and the algorithm. The bench builds these raw plans itself for the bf16
// GEMMs the bf16 recipe runs and for the probe of scale modes, which the
// plan cache (loom/ops/gemm.hpp) keeps to itself.
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  LtPlan() = default;
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;
  ~LtPlan() {  // host-side objects: nothing worth reporting at teardown
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// Up to `want` of the heuristic's answers for plan p (C = D's layout) with a
// ws-byte workspace, into r; the status of the query.
cublasStatus_t heuristic(cublasLtHandle_t h, const LtPlan& p, size_t ws, int want, cublasLtMatmulHeuristicResult_t* r,
                         int* found) {
  cublasLtMatmulPreference_t pref;
  LT_CHECK(cublasLtMatmulPreferenceCreate(&pref), "pref");
  const uint64_t w = ws;
  const cublasStatus_t set =
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w, sizeof(w));
  const cublasStatus_t st =
      set != CUBLAS_STATUS_SUCCESS ? set : cublasLtMatmulAlgoGetHeuristic(h, p.op, p.a, p.b, p.d, p.d, pref, want, r, found);
  cublasLtMatmulPreferenceDestroy(pref);
  return st;
}

// The bf16 recipe's GEMM: bf16 A and B, fp32 compute, D of type td; the
// heuristic's first answer, and with `cand` up to `want` answers there.
void bf16_plan(LtPlan& p, cublasLtHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int64_t M, int64_t N,
               int64_t K, int64_t lda, int64_t ldb, cudaDataType_t td, int64_t ldd, size_t ws,
               cublasLtMatmulHeuristicResult_t* cand = nullptr, int want = 1, int* found_out = nullptr) {
  LT_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "bf16 ", M, "x", N, "x", K);
  LT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "transa");
  LT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "transb");
  LT_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, ta == CUBLAS_OP_N ? M : K, ta == CUBLAS_OP_N ? K : M, lda),
           "A");
  LT_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, tb == CUBLAS_OP_N ? K : N, tb == CUBLAS_OP_N ? N : K, ldb),
           "B");
  LT_CHECK(cublasLtMatrixLayoutCreate(&p.d, td, M, N, ldd), "D");
  cublasLtMatmulHeuristicResult_t one{};
  cublasLtMatmulHeuristicResult_t* r = cand != nullptr ? cand : &one;
  int found = 0;
  LT_CHECK(heuristic(h, p, ws, cand != nullptr ? want : 1, r, &found), "bf16 heuristic ", M, "x", N, "x", K);
  if (found == 0) throw loom::Error(loom::cat("bf16 GEMM ", M, "x", N, "x", K, ": no cuBLASLt algorithm"));
  p.algo = r[0].algo;
  if (found_out != nullptr) *found_out = found;
}

// How a wgrad meets the weight gradient: adds to fp32 dW (a later
// micro-batch with fp32 gradients), or writes bf16 dW (the first micro-batch
// with bf16 gradients: bf16_pure, and the FP8 recipes with master = "bf16",
// as every bf16_pure and FP8 bench workload runs at grad_accum = 1).
enum class Wgrad { none, accumulate_f32, write_bf16 };

struct Row {
  std::string model, linear, gemm;
  int64_t m, n, k;
  double bf16_ms, fp8_ms;
  double block_ms;  // block-scaled FP8 (fp8_block: 1x128 tiles, 128x128 weight blocks, E4M3, no fast accumulation)
  Wgrad wgrad = Wgrad::none;  // fprop and dgrad: none
};

double tflops(int64_t m, int64_t n, int64_t k, double ms) { return 2.0 * m * n * k / (ms * 1e-3) / 1e12; }

struct Args {
  std::string model = "all";
  int iters = 25, warmup = 5;
  bool probe_only = false;
  bool algos = false;
  loom::GemmAlgo gemm_algo = loom::GemmAlgo::fastest;
};

void bench_model(const Model& md, const Args& args, cublasLtHandle_t lt, void* ws, size_t ws_bytes, cudaStream_t s,
                 std::vector<Row>& rows, std::vector<std::pair<std::string, double>>& cast_ms,
                 std::vector<std::pair<std::string, double>>& block_cast_ms) {
  const int64_t T = md.tokens;
  const std::vector<Linear> lins = linears_of(md);
  int64_t max_in = 0, max_out = 0, max_w = 0;
  for (const Linear& l : lins) {
    max_in = std::max(max_in, l.in);
    max_out = std::max(max_out, l.out);
    max_w = std::max(max_w, l.in * l.out);
  }
  const auto tin = static_cast<size_t>(T * max_in), tout = static_cast<size_t>(T * max_out),
             wsz = static_cast<size_t>(max_w);
  DevMem x(tin * 2), dx(tin * 2), y(tout * 2), dy(tout * 2), w(wsz * 2), dw(wsz * 4), dwb(wsz * 2);
  DevMem xq(tin), xqt(tin), dyq(tout), dyqt(tout), wq(wsz), wqt(wsz), sc(64), am(64), inv(64);
  fill_bf16(x.p, tin, 1.0f, 1);
  fill_bf16(dy.p, tout, 1e-3f, 2);
  fill_bf16(w.p, wsz, 0.02f, 3);
  LOOM_CUDA_CHECK(cudaMemset(dw.p, 0, dw.bytes), "dW");
  LOOM_CUDA_CHECK(cudaMemset(am.p, 0, am.bytes), "amax");
  const std::vector<float> ones(16, 1.0f);
  LOOM_CUDA_CHECK(cudaMemcpy(sc.p, ones.data(), 64, cudaMemcpyHostToDevice), "scales");
  float* amax = static_cast<float*>(am.p);
  float* scale = static_cast<float*>(sc.p);
  float* scale_inv = static_cast<float*>(inv.p);
  loom::ops::GemmPlans fp8(lt, ws, ws_bytes, args.gemm_algo);
  // Block-scaled: one scale inverse per 128 elements (tiles) or 128x128 (blocks), 16-byte aligned.
  const size_t tile_scales = static_cast<size_t>(T * std::max(max_in, max_out) / 128) * 4 + 256;
  DevMem sx(tile_scales), sxt(tile_scales), sdy(tile_scales), sdyt(tile_scales), sw(tile_scales), swt(tile_scales);
  loom::ops::GemmPlans blockgemm(lt, ws, ws_bytes, args.gemm_algo);
  using BM = loom::fp8::block::ScaleMode;

  for (const Linear& l : lins) {
    Tensor tx(x.p, DType::bf16, Device::cuda, {T, l.in}), tw(w.p, DType::bf16, Device::cuda, {l.out, l.in}),
        tdy(dy.p, DType::bf16, Device::cuda, {T, l.out});
    Tensor txq(xq.p, DType::e4m3, Device::cuda, {T, l.in}), txqt(xqt.p, DType::e4m3, Device::cuda, {l.in, T});
    Tensor twq(wq.p, DType::e4m3, Device::cuda, {l.out, l.in}), twqt(wqt.p, DType::e4m3, Device::cuda, {l.in, l.out});
    Tensor tdyq(dyq.p, DType::e5m2, Device::cuda, {T, l.out}), tdyqt(dyqt.p, DType::e5m2, Device::cuda, {l.out, T});
    Tensor ty(y.p, DType::bf16, Device::cuda, {T, l.out}), tdx(dx.p, DType::bf16, Device::cuda, {T, l.in}),
        tdw(dw.p, DType::f32, Device::cuda, {l.out, l.in}), tdwb(dwb.p, DType::bf16, Device::cuda, {l.out, l.in});
    // Scales from the tensors' amaxes (slots x, w, dy; hybrid), as a recipe's first step would.
    LOOM_CUDA_CHECK(cudaMemsetAsync(amax, 0, 12, s), "amax");
    loom::gpu::fp8_amax(tx, amax + 0, s);
    loom::gpu::fp8_amax(tw, amax + 1, s);
    loom::gpu::fp8_amax(tdy, amax + 2, s);
    loom::gpu::fp8_update_scales(amax, scale, scale_inv, 0, 3, loom::fp8::Formats::hybrid, 0, nullptr, s);
    const std::string lname = l.name;
    // The casts: each writes the row-major and the transposed copy and its amax.
    const double cx =
        time_ms(s, args.warmup, args.iters, [&] { loom::gpu::fp8_cast(tx, &txq, &txqt, scale + 0, amax + 0, s); });
    const double cw =
        time_ms(s, args.warmup, args.iters, [&] { loom::gpu::fp8_cast(tw, &twq, &twqt, scale + 1, amax + 1, s); });
    const double cdy =
        time_ms(s, args.warmup, args.iters, [&] { loom::gpu::fp8_cast(tdy, &tdyq, &tdyqt, scale + 2, amax + 2, s); });
    cast_ms.push_back({lname + " x [" + std::to_string(T) + "," + std::to_string(l.in) + "]", cx});
    cast_ms.push_back({lname + " W [" + std::to_string(l.out) + "," + std::to_string(l.in) + "]", cw});
    cast_ms.push_back({lname + " dy [" + std::to_string(T) + "," + std::to_string(l.out) + "]", cdy});

    // bf16, as plugins/precision/common/cublaslt_linear.cpp maps the three GEMMs.
    LtPlan pf, pd, pw, pwb;
    const float one = 1.0f, zero = 0.0f;
    // The heuristic's first answers; under "fastest" the quickest of them on
    // these operands (D, and the accumulated dW's C, in the timing's scratch),
    // as the bf16 recipes' plans pick (cublaslt_linear.cpp).
    auto plan = [&](LtPlan& p, cublasOperation_t ta, cublasOperation_t tb, int64_t M, int64_t N, int64_t K,
                    int64_t lda, int64_t ldb, cudaDataType_t td, const void* a, const void* b, const float* beta,
                    const char* gemm) {
      cublasLtMatmulHeuristicResult_t cand[loom::kGemmAlgoCandidates]{};
      int found = 0;
      bf16_plan(p, lt, ta, tb, M, N, K, lda, ldb, td, M, ws_bytes, cand, loom::kGemmAlgoCandidates, &found);
      if (args.gemm_algo != loom::GemmAlgo::fastest) return;
      const size_t d_bytes = static_cast<size_t>(M * N) * (td == CUDA_R_32F ? 4 : 2);
      const int pick = loom::time_gemm_candidates(
          s, found, d_bytes,
          [&](int i, void* d) {
            return cublasLtMatmul(lt, p.op, &one, a, p.a, b, p.b, beta, d, p.d, d, p.d, &cand[i].algo, ws, ws_bytes,
                                  s) == CUBLAS_STATUS_SUCCESS;
          },
          loom::cat("fp8_gemm_bench ", md.name, " ", lname, " bf16 ", gemm));
      p.algo = cand[pick].algo;
    };
    plan(pf, CUBLAS_OP_T, CUBLAS_OP_N, l.out, T, l.in, l.in, l.in, CUDA_R_16BF, w.p, x.p, &zero, "fprop");
    plan(pd, CUBLAS_OP_N, CUBLAS_OP_N, l.in, T, l.out, l.in, l.out, CUDA_R_16BF, w.p, dy.p, &zero, "dgrad");
    plan(pw, CUBLAS_OP_N, CUBLAS_OP_T, l.in, l.out, T, l.in, l.out, CUDA_R_32F, x.p, dy.p, &one, "wgrad");
    plan(pwb, CUBLAS_OP_N, CUBLAS_OP_T, l.in, l.out, T, l.in, l.out, CUDA_R_16BF, x.p, dy.p, &zero, "wgrad bf16");
    auto run_bf16 = [&](LtPlan& p, const void* a, const void* b, void* d, const float* beta) {
      LT_CHECK(cublasLtMatmul(lt, p.op, &one, a, p.a, b, p.b, beta, d, p.d, d, p.d, &p.algo, ws, ws_bytes, s), md.name,
               " ", lname, " bf16");
    };
    const double bf = time_ms(s, args.warmup, args.iters, [&] { run_bf16(pf, w.p, x.p, y.p, &zero); });
    const double bd = time_ms(s, args.warmup, args.iters, [&] { run_bf16(pd, w.p, dy.p, dx.p, &zero); });
    const double bw = time_ms(s, args.warmup, args.iters, [&] { run_bf16(pw, x.p, dy.p, dw.p, &one); });
    const double bwb = time_ms(s, args.warmup, args.iters, [&] { run_bf16(pwb, x.p, dy.p, dwb.p, &zero); });

    loom::ops::Fp8GemmOptions of, od, ow, owb;
    of.fast_accum = true;
    ow.c = &tdw;
    const double ff =
        time_ms(s, args.warmup, args.iters, [&] { loom::ops::fp8_gemm(fp8, txq, scale_inv + 0, twq, scale_inv + 1, ty, of, s); });
    const double fd =
        time_ms(s, args.warmup, args.iters, [&] { loom::ops::fp8_gemm(fp8, tdyq, scale_inv + 2, twqt, scale_inv + 1, tdx, od, s); });
    const double fw =
        time_ms(s, args.warmup, args.iters, [&] { loom::ops::fp8_gemm(fp8, tdyqt, scale_inv + 2, txqt, scale_inv + 0, tdw, ow, s); });
    const double fwb =
        time_ms(s, args.warmup, args.iters, [&] { loom::ops::fp8_gemm(fp8, tdyqt, scale_inv + 2, txqt, scale_inv + 0, tdwb, owb, s); });

    // Block-scaled (the fp8_block recipe): E4M3 everywhere; x and dy cast in 1x128 tiles and, transposed, in
    // 128x1 tiles (one pass each, fp8_block_cast_rows_cols as the recipe), W in 128x128 blocks into W and W^T.
    Tensor bdyq(dyq.p, DType::e4m3, Device::cuda, {T, l.out}), bdyqt(dyqt.p, DType::e4m3, Device::cuda, {l.out, T});
    auto f32 = [](DevMem& m) { return static_cast<float*>(m.p); };
    const double kx = time_ms(s, args.warmup, args.iters, [&] {
      loom::gpu::fp8_block_cast_rows_cols(tx, txq, f32(sx), txqt, f32(sxt), nullptr, s);
    });
    const double kw = time_ms(s, args.warmup, args.iters, [&] {
      loom::gpu::fp8_block_cast_blocks(tw, &twq, &twqt, f32(sw), f32(swt), nullptr, s);
    });
    const double kdy = time_ms(s, args.warmup, args.iters, [&] {
      loom::gpu::fp8_block_cast_rows_cols(tdy, bdyq, f32(sdy), bdyqt, f32(sdyt), nullptr, s);
    });
    block_cast_ms.push_back({lname + " x [" + std::to_string(T) + "," + std::to_string(l.in) + "]", kx});
    block_cast_ms.push_back({lname + " W [" + std::to_string(l.out) + "," + std::to_string(l.in) + "]", kw});
    block_cast_ms.push_back({lname + " dy [" + std::to_string(T) + "," + std::to_string(l.out) + "]", kdy});
    const double gf = time_ms(s, args.warmup, args.iters, [&] {
      block_gemm(blockgemm, {&txq, f32(sx), BM::tile_1x128}, {&twq, f32(sw), BM::block_128x128}, ty, nullptr, s);
    });
    const double gd = time_ms(s, args.warmup, args.iters, [&] {
      block_gemm(blockgemm, {&bdyq, f32(sdy), BM::tile_1x128}, {&twqt, f32(swt), BM::block_128x128}, tdx, nullptr, s);
    });
    const double gw = time_ms(s, args.warmup, args.iters, [&] {
      block_gemm(blockgemm, {&bdyqt, f32(sdyt), BM::tile_1x128}, {&txqt, f32(sxt), BM::tile_1x128}, tdw, &tdw, s);
    });
    const double gwb = time_ms(s, args.warmup, args.iters, [&] {
      block_gemm(blockgemm, {&bdyqt, f32(sdyt), BM::tile_1x128}, {&txqt, f32(sxt), BM::tile_1x128}, tdwb, nullptr, s);
    });
    rows.push_back({md.name, lname, "fprop", T, l.out, l.in, bf, ff, gf});
    rows.push_back({md.name, lname, "dgrad", T, l.in, l.out, bd, fd, gd});
    rows.push_back({md.name, lname, "wgrad, fp32 dW accumulated", l.out, l.in, T, bw, fw, gw, Wgrad::accumulate_f32});
    rows.push_back({md.name, lname, "wgrad, bf16 dW written", l.out, l.in, T, bwb, fwb, gwb, Wgrad::write_bf16});
  }
}

// --algos: how much cuBLASLt's other algorithms would gain over the
// heuristic's first choice (the one every Loom GEMM plan takes) on the bf16
// GEMMs of the bench workloads. For each linear of a layer and the LM head (at
// the fused head's 4096-token chunk), each of fprop / dgrad / wgrad as the bf16
// recipes map them (wgrad's dW in fp32 for `bf16`, in bf16 for `bf16_pure`,
// accumulated with beta = 1), up to 16 algorithms from
// cublasLtMatmulAlgoGetHeuristic are each timed (median of `iters`).
struct AlgoModel {
  const char* name;
  int64_t hidden, ffn, heads, kv_heads, head_dim, tokens, vocab;
  cudaDataType_t grad;
};
const AlgoModel kAlgoModels[] = {
    {"llama-125m", 768, 2048, 12, 12, 64, 16384, 32000, CUDA_R_32F},
    {"llama-1b", 2048, 5632, 32, 4, 64, 16384, 32000, CUDA_R_32F},
    {"llama2-7b", 4096, 11008, 32, 32, 128, 2048, 32000, CUDA_R_16BF},
};

void bench_algos(const AlgoModel& md, const Args& args, cublasLtHandle_t lt, void* ws, size_t ws_bytes,
                 cudaStream_t s) {
  std::vector<Linear> lins = {{"qkv", (md.heads + 2 * md.kv_heads) * md.head_dim, md.hidden},
                              {"o_proj", md.hidden, md.heads * md.head_dim},
                              {"gate_up", 2 * md.ffn, md.hidden},
                              {"down", md.hidden, md.ffn},
                              {"lm_head", md.vocab, md.hidden}};
  int64_t max_in = 0, max_out = 0, max_w = 0;
  for (const Linear& l : lins) {
    max_in = std::max(max_in, l.in);
    max_out = std::max(max_out, l.out);
    max_w = std::max(max_w, l.in * l.out);
  }
  const auto tin = static_cast<size_t>(md.tokens * max_in), tout = static_cast<size_t>(md.tokens * max_out);
  DevMem x(tin * 2), dx(tin * 2), y(tout * 2), dy(tout * 2), w(static_cast<size_t>(max_w) * 2),
      dw(static_cast<size_t>(max_w) * 4);
  fill_bf16(x.p, tin, 1.0f, 1);
  fill_bf16(dy.p, tout, 1e-3f, 2);
  fill_bf16(w.p, static_cast<size_t>(max_w), 0.02f, 3);
  LOOM_CUDA_CHECK(cudaMemset(dw.p, 0, dw.bytes), "dW");
  std::printf("\n## %s: cuBLASLt algorithms on the bf16 GEMMs (wgrad dW %s)\n\n", md.name,
              md.grad == CUDA_R_32F ? "fp32" : "bf16");
  std::printf("| linear | GEMM | m x n x k | algorithms | first ms | best ms | best # | first / best |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  double first_layer = 0, best_layer = 0, first_head = 0, best_head = 0;
  for (const Linear& l : lins) {
    const bool head = std::string(l.name) == "lm_head";
    const int64_t T = head ? std::min<int64_t>(4096, md.tokens) : md.tokens;
    struct G {
      const char* name;
      cublasOperation_t ta, tb;
      int64_t M, N, K, lda, ldb, ldd;
      cudaDataType_t td;
      const void *a, *b;
      void* d;
      float beta;
    };
    const G gs[] = {{"fprop", CUBLAS_OP_T, CUBLAS_OP_N, l.out, T, l.in, l.in, l.in, l.out, CUDA_R_16BF, w.p, x.p, y.p, 0.f},
                    {"dgrad", CUBLAS_OP_N, CUBLAS_OP_N, l.in, T, l.out, l.in, l.out, l.in, CUDA_R_16BF, w.p, dy.p, dx.p, 0.f},
                    {"wgrad", CUBLAS_OP_N, CUBLAS_OP_T, l.in, l.out, T, l.in, l.out, l.in, md.grad, x.p, dy.p, dw.p, 1.f}};
    for (const G& g : gs) {
      LtPlan p;
      cublasLtMatmulHeuristicResult_t r[16]{};
      int found = 0;
      bf16_plan(p, lt, g.ta, g.tb, g.M, g.N, g.K, g.lda, g.ldb, g.td, g.ldd, ws_bytes, r, 16, &found);
      const float one = 1.0f;
      double first = 0, best = 1e30;
      int best_i = -1;
      for (int i = 0; i < found; ++i) {
        if (r[i].state != CUBLAS_STATUS_SUCCESS || r[i].workspaceSize > ws_bytes) continue;
        const double ms = time_ms(s, args.warmup, args.iters, [&] {
          LT_CHECK(cublasLtMatmul(lt, p.op, &one, g.a, p.a, g.b, p.b, &g.beta, g.d, p.d, g.d, p.d, &r[i].algo, ws,
                                  ws_bytes, s),
                   md.name, " ", l.name, " ", g.name, " algorithm ", i);
        });
        if (i == 0) first = ms;
        if (ms < best) {
          best = ms;
          best_i = i;
        }
      }
      std::printf("| %s | %s | %lld x %lld x %lld | %d | %.3f | %.3f | %d | %.3f |\n", l.name, g.name,
                  static_cast<long long>(g.M), static_cast<long long>(g.N), static_cast<long long>(g.K), found, first,
                  best, best_i, first / best);
      (head ? first_head : first_layer) += first;
      (head ? best_head : best_layer) += best;
    }
  }
  std::printf("\nPer decoder layer: first %.3f ms, best %.3f ms (%.3fx); LM head per %lld-token chunk: first %.3f, "
              "best %.3f ms (%.3fx)\n",
              first_layer, best_layer, first_layer / best_layer, static_cast<long long>(std::min<int64_t>(4096, md.tokens)),
              first_head, best_head, first_head / best_head);
}

const char* mode_name(int32_t m) {
  switch (m) {
    case CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F: return "SCALAR_32F";
    case CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F: return "VEC128_32F (1x128)";
    case CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F: return "BLK128x128_32F (128x128)";
    default: return "?";
  }
}

// Block-scaled FP8 in cuBLASLt: E4M3 x E4M3 -> bf16, TN, with per-block
// scale modes on A and B. In the fprop mapping cuBLASLt's A is the weight
// (DeepSeek-V3: 128x128 blocks) and its B the activation (1x128 tiles).
// Three more variants per mode pair answer the fp8_block recipe's questions:
// B in E5M2 (a "hybrid" gradient operand), fast accumulation, and fp32 D
// (the wgrad's dW, accumulated in fp32).
void probe_block_scaling(cublasLtHandle_t lt, void* ws, size_t ws_bytes, cudaStream_t s, const Args& args) {
  std::printf("\n## Block-scaled FP8 probe (cuBLASLt %zu, A E4M3, B E4M3 or E5M2 -> bf16, TN)\n\n",
              cublasLtGetVersion());
  std::printf("| M' x N' x K' | A scale mode | B scale mode | variant | set A/B mode | heuristic | algorithms | matmul "
              "| ms |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  const int64_t shapes[][3] = {{4096, 2048, 4096}, {11008, 2048, 4096}, {4096, 4096, 11008}};
  const int32_t modes[][2] = {
      {CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F, CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F},
      {CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F},
      {CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F},
      {CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F},
      {CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F}};
  for (const auto& sh : shapes) {
    const int64_t M = sh[0], N = sh[1], K = sh[2];
    DevMem a(static_cast<size_t>(M * K)), b(static_cast<size_t>(N * K)), d(static_cast<size_t>(M * N) * 4);
    LOOM_CUDA_CHECK(cudaMemset(a.p, 0x38, a.bytes), "A = 1.0 (E4M3 0x38)");
    LOOM_CUDA_CHECK(cudaMemset(b.p, 0x38, b.bytes), "B = 1.0");
    // Scale buffers large enough for either layout (one float per row per 128 k).
    const int64_t kb = (K + 127) / 128;
    const std::vector<float> ones(static_cast<size_t>(std::max(M, N) * kb), 1.0f);
    DevMem sa(ones.size() * 4), sb(ones.size() * 4);
    LOOM_CUDA_CHECK(cudaMemcpy(sa.p, ones.data(), sa.bytes, cudaMemcpyHostToDevice), "A scales");
    LOOM_CUDA_CHECK(cudaMemcpy(sb.p, ones.data(), sb.bytes, cudaMemcpyHostToDevice), "B scales");
    for (const auto& md : modes)
    for (int variant = 0; variant < 4; ++variant) {
      // 0: E4M3 x E4M3; 1: B (the activation / gradient) in E5M2; 2: E4M3 x E4M3 with fast accumulation;
      // 3: E4M3 x E4M3 into fp32 D.
      const bool b_e5m2 = variant == 1, fast = variant == 2, d_f32 = variant == 3;
      LOOM_CUDA_CHECK(cudaMemset(b.p, b_e5m2 ? 0x3C : 0x38, b.bytes), "B = 1.0 (E5M2 0x3C, E4M3 0x38)");
      cublasStatus_t sma = CUBLAS_STATUS_NOT_INITIALIZED, smb = sma, sh_st = sma;
      int found = 0;
      std::string run = "-", ms = "-";
      try {
        LtPlan p;
        LT_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "probe");
        const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
        LT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)), "probe");
        LT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)), "probe");
        sma = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &md[0], 4);
        smb = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &md[1], 4);
        const void* pa = sa.p;
        const void* pb = sb.p;
        LT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &pa, sizeof(pa)), "probe");
        LT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &pb, sizeof(pb)), "probe");
        LT_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_8F_E4M3, K, M, K), "probe");
        LT_CHECK(cublasLtMatrixLayoutCreate(&p.b, b_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3, K, N, K), "probe");
        const int8_t fa = fast ? 1 : 0;
        LT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fa, sizeof(fa)), "probe");
        LT_CHECK(cublasLtMatrixLayoutCreate(&p.d, d_f32 ? CUDA_R_32F : CUDA_R_16BF, M, N, M), "probe");
        cublasLtMatmulHeuristicResult_t r[8]{};
        sh_st = heuristic(lt, p, ws_bytes, 8, r, &found);
        if (sh_st == CUBLAS_STATUS_SUCCESS && found > 0) {
          const float one = 1.0f, zero = 0.0f;
          auto go = [&] {
            return cublasLtMatmul(lt, p.op, &one, a.p, p.a, b.p, p.b, &zero, d.p, p.d, d.p, p.d, &r[0].algo, ws,
                                  ws_bytes, s);
          };
          const cublasStatus_t rs = go();
          const cudaError_t ce = cudaStreamSynchronize(s);
          run = std::string(cublasLtGetStatusName(rs)) +
                (ce == cudaSuccess ? "" : std::string(" / ") + cudaGetErrorName(ce));
          if (rs == CUBLAS_STATUS_SUCCESS && ce == cudaSuccess) {
            // All ones with unit scales: every D element is K (exact in bf16 for these K).
            uint16_t h = 0;
            float hf = 0.0f;
            if (d_f32) LOOM_CUDA_CHECK(cudaMemcpy(&hf, d.p, 4, cudaMemcpyDeviceToHost), "probe D[0] (fp32)");
            else LOOM_CUDA_CHECK(cudaMemcpy(&h, d.p, 2, cudaMemcpyDeviceToHost), "probe D[0]");
            run += " D[0]=" + std::to_string(d_f32 ? hf : loom::hf::bf16_to_f32(h));
            char buf[32];
            std::snprintf(buf, sizeof buf, "%.3f", time_ms(s, 2, std::max(args.iters, 20), [&] { go(); }));
            ms = buf;
          }
        }
      } catch (const std::exception& e) {
        run = std::string("error: ") + e.what();  // a setup call failed: the row says which
      }
      std::printf("| %lld x %lld x %lld | %s | %s | %s | %s / %s | %s | %d | %s | %s |\n", static_cast<long long>(M),
                  static_cast<long long>(N), static_cast<long long>(K), mode_name(md[0]), mode_name(md[1]),
                  variant == 0 ? "E4M3 x E4M3" : (variant == 1 ? "B E5M2" : (variant == 2 ? "fast accum" : "D fp32")),
                  cublasLtGetStatusName(sma), cublasLtGetStatusName(smb), cublasLtGetStatusName(sh_st), found,
                  run.c_str(), ms.c_str());
    }
  }
}

int run(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--model=", 0) == 0)
      args.model = a.substr(8);
    else if (a.rfind("--iters=", 0) == 0)
      args.iters = std::atoi(a.c_str() + 8);
    else if (a.rfind("--warmup=", 0) == 0)
      args.warmup = std::atoi(a.c_str() + 9);
    else if (a == "--probe-only")
      args.probe_only = true;
    else if (a == "--algos")
      args.algos = true;
    else if (a == "--gemm-algo=fastest")
      args.gemm_algo = loom::GemmAlgo::fastest;
    else if (a == "--gemm-algo=heuristic")
      args.gemm_algo = loom::GemmAlgo::heuristic;
    else {
      std::fprintf(stderr,
                   "fp8_gemm_bench: unknown argument '%s'\nusage: fp8_gemm_bench [--model=llama-1b|llama2-7b|all] "
                   "[--iters=N (>= 20)] [--warmup=N] [--gemm-algo=fastest|heuristic] [--probe-only] [--algos]\n",
                   a.c_str());
      return 2;
    }
  }
  if (args.iters < 20) {
    std::fprintf(stderr, "fp8_gemm_bench: --iters=%d: the median needs at least 20 timed calls\n", args.iters);
    return 2;
  }
  if (args.warmup < 1) {
    std::fprintf(stderr, "fp8_gemm_bench: --warmup=%d: at least 1 (a problem's first call picks its algorithm)\n",
                 args.warmup);
    return 2;
  }
  if (args.model != "all" && args.model != "llama-1b" && args.model != "llama2-7b") {
    std::fprintf(stderr, "fp8_gemm_bench: --model=%s: choose llama-1b, llama2-7b or all\n", args.model.c_str());
    return 2;
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::fprintf(stderr, "fp8_gemm_bench: no CUDA device here\n");
    return 1;
  }
  cudaDeviceProp prop{};
  LOOM_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0), "device 0");
  int rt = 0;
  LOOM_CUDA_CHECK(cudaRuntimeGetVersion(&rt), "runtime version");
  std::printf(
      "# FP8 GEMM benchmark\n\nGPU: %s (sm_%d%d), CUDA runtime %d, cuBLASLt %zu; median of %d calls after %d "
      "warm-up; algorithms: %s\n",
      prop.name, prop.major, prop.minor, rt, cublasLtGetVersion(), args.iters, args.warmup,
      args.gemm_algo == loom::GemmAlgo::fastest ? "the fastest of the heuristic's first 8 (gemm_algo = \"auto\")"
                                                : "the heuristic's first answer");
  cudaStream_t s;
  LOOM_CUDA_CHECK(cudaStreamCreate(&s), "stream");
  cublasLtHandle_t lt;
  LT_CHECK(cublasLtCreate(&lt), "handle");
  const size_t ws_bytes = loom::ops::GemmPlans::kWorkspaceBytes;
  DevMem ws(ws_bytes);

  if (args.algos) {
    for (const AlgoModel& md : kAlgoModels) bench_algos(md, args, lt, ws.p, ws_bytes, s);
    LT_CHECK(cublasLtDestroy(lt), "destroy");
    LOOM_CUDA_CHECK(cudaStreamDestroy(s), "stream");
    return 0;
  }
  if (!args.probe_only) {
    for (const Model& md : kModels) {
      if (args.model != "all" && args.model != md.name) continue;
      std::vector<Row> rows;
      std::vector<std::pair<std::string, double>> casts, block_casts;
      bench_model(md, args, lt, ws.p, ws_bytes, s, rows, casts, block_casts);
      std::printf("\n## %s (hidden %lld, ffn %lld, %lld heads / %lld kv heads, head dim %lld, %lld tokens)\n\n",
                  md.name, static_cast<long long>(md.hidden), static_cast<long long>(md.ffn),
                  static_cast<long long>(md.heads), static_cast<long long>(md.kv_heads),
                  static_cast<long long>(md.head_dim), static_cast<long long>(md.tokens));
      std::printf("| linear | GEMM | m x n x k | bf16 ms | bf16 TFLOP/s | FP8 ms | FP8 TFLOP/s | FP8 / bf16 | "
                  "block FP8 ms | block TFLOP/s | block / bf16 |\n");
      std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
      for (const Row& r : rows)
        std::printf("| %s | %s | %lld x %lld x %lld | %.3f | %.0f | %.3f | %.0f | %.2fx | %.3f | %.0f | %.2fx |\n",
                    r.linear.c_str(), r.gemm.c_str(), static_cast<long long>(r.m), static_cast<long long>(r.n),
                    static_cast<long long>(r.k), r.bf16_ms, tflops(r.m, r.n, r.k, r.bf16_ms), r.fp8_ms,
                    tflops(r.m, r.n, r.k, r.fp8_ms), r.bf16_ms / r.fp8_ms, r.block_ms,
                    tflops(r.m, r.n, r.k, r.block_ms), r.bf16_ms / r.block_ms);
      std::printf("\n| cast (q + q_t + amax) | ms |\n|---|---|\n");
      double tc = 0, tc_w = 0;
      for (const auto& [name, ms] : casts) {
        std::printf("| %s | %.3f |\n", name.c_str(), ms);
        tc += ms;
        if (name.find(" W [") != std::string::npos) tc_w += ms;
      }
      double kc = 0, kc_w = 0;
      for (const auto& [name, ms] : block_casts) {
        kc += ms;
        if (name.find(" W [") != std::string::npos) kc_w += ms;
      }
      std::printf("\n| block cast (1x128 rows + 128x1 transposed, or 128x128 W + W^T) | ms |\n|---|---|\n");
      for (const auto& [name, ms] : block_casts) std::printf("| %s | %.3f |\n", name.c_str(), ms);
      // Per layer, once with each wgrad: accumulating into fp32 dW, and
      // writing bf16 dW as the bf16_pure and FP8 (master = "bf16") bench
      // workloads' steps do (grad_accum = 1: every step's one micro-batch
      // writes the gradients).
      for (const Wgrad mode : {Wgrad::accumulate_f32, Wgrad::write_bf16}) {
        double tb = 0, tf = 0, tk = 0, flops = 0;
        for (const Row& r : rows) {
          if (r.wgrad != Wgrad::none && r.wgrad != mode) continue;
          tb += r.bf16_ms;
          tf += r.fp8_ms;
          tk += r.block_ms;
          flops += 2.0 * r.m * r.n * r.k;
        }
        const char* how = mode == Wgrad::accumulate_f32 ? "wgrad adding to fp32 dW" : "wgrad writing bf16 dW";
        std::printf("\nPer layer, %s (4 linears x fprop, dgrad, wgrad; %.2f TFLOP):\n\n", how, flops / 1e12);
        std::printf("| | ms | FP8 speed-up over bf16 |\n|---|---|---|\n");
        std::printf("| bf16 GEMMs | %.3f | 1.00x |\n", tb);
        std::printf("| FP8 GEMMs | %.3f | %.2fx |\n", tf, tb / tf);
        std::printf("| FP8 GEMMs + x, dy casts (W cast once per optimizer step) | %.3f | %.2fx |\n", tf + tc - tc_w,
                    tb / (tf + tc - tc_w));
        std::printf("| FP8 GEMMs + every cast (W cast every micro-batch) | %.3f | %.2fx |\n", tf + tc, tb / (tf + tc));
        std::printf("| block-scaled FP8 GEMMs (fp8_block) | %.3f | %.2fx |\n", tk, tb / tk);
        std::printf("| block-scaled FP8 GEMMs + x, dy block casts (W cast once per optimizer step) | %.3f | %.2fx |\n",
                    tk + kc - kc_w, tb / (tk + kc - kc_w));
        std::printf("| block-scaled FP8 GEMMs + every block cast | %.3f | %.2fx |\n", tk + kc, tb / (tk + kc));
        if (std::string(md.name) == "llama2-7b")
          std::printf(
              "\nGoal >= 1.6x bf16 on the 7B shapes, %s: GEMMs alone %.2fx (%s), with the x and dy casts %.2fx "
              "(%s)\n",
              how, tb / tf, tb / tf >= 1.6 ? "met" : "missed", tb / (tf + tc - tc_w),
              tb / (tf + tc - tc_w) >= 1.6 ? "met" : "missed");
      }
    }
  }
  probe_block_scaling(lt, ws.p, ws_bytes, s, args);
  LT_CHECK(cublasLtDestroy(lt), "destroy");
  LOOM_CUDA_CHECK(cudaStreamDestroy(s), "stream");
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return loom::bench::main_of("fp8_gemm_bench", run, argc, argv); }
