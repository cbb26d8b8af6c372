// Naive attention on CUDA (see the header): the CPU reference's formulas,
//
//   s_ij = scale * q_i . k_j (j <= i when causal; with document positions also
//          j >= i - pos_i: the keys of the query's own span), lse_i = log sum_j exp(s_ij)
//   P_ij = exp(s_ij - lse_i),  o_i = sum_j P_ij v_j
//   dP_ij = do_i . v_j,  D_i = sum_j P_ij dP_ij,  dS_ij = P_ij (dP_ij - D_i)
//   dq_i = scale sum_j dS_ij k_j,  dk_j = scale sum_i dS_ij q_i,  dv_j = sum_i P_ij do_i
//
// as a handful of one-thread-per-output kernels over the materialised
// [B, H, S, S] score matrix. Correctness and reproducibility over speed: each
// sum runs in one thread in index order, or in one block through a fixed tree.
// D_i is summed from P and dP (as on the CPU), not taken as do_i . o_i, so that
// backward depends only on q, k, v, dout and the stats.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "attention/naive/attention_naive_cuda.hpp"
#include "loom/error.hpp"

namespace loom::naive::cuda {
namespace {

using bf16_t = __nv_bfloat16;

constexpr int kThreads = 256;        // per block, every kernel; a power of two (tree reductions)
constexpr int64_t kMaxBlocks = 1 << 20;  // grid-stride loops cover the rest

__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const bf16_t* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void st(float* p, float x) { *p = x; }
__device__ __forceinline__ void st(bf16_t* p, float x) { *p = __float2bfloat16_rn(x); }

template <typename T>
__device__ __forceinline__ float dot(const T* a, const T* b, int64_t n) {
  float s = 0.f;
  for (int64_t c = 0; c < n; ++c) s = fmaf(ld(a + c), ld(b + c), s);
  return s;
}

struct Dims {
  int64_t B, S, H, Hkv, D, group;
  float scale;
  bool causal;
  const int32_t* pos;  // document positions [B * S] (device), or null
  // The first key query i of row b sees: its document span's first token.
  __device__ int64_t first_key(int64_t b, int64_t i) const { return pos ? i - pos[b * S + i] : 0; }
};

Dims dims_of(const AttnDims& d) {
  return {d.B, d.S, d.H, d.Hkv, d.D, d.H / d.Hkv, static_cast<float>(d.scale), d.causal, d.positions};
}

// Block-wide reduction over kThreads values through a fixed tree: the result
// depends only on the inputs, never on timing. Every thread gets the result.
template <typename Op>
__device__ float block_reduce(float x, float* smem, Op op) {
  smem[threadIdx.x] = x;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) smem[threadIdx.x] = op(smem[threadIdx.x], smem[threadIdx.x + w]);
    __syncthreads();
  }
  const float r = smem[0];
  __syncthreads();  // smem is reused by the next reduction
  return r;
}

// ws[bh, i, j] = s_ij (stats == null) or P_ij = exp(s_ij - lse_i) (stats
// given: backward rebuilds P from forward's lse). Masked entries get 0 so
// that every later kernel may treat them as zero probability.
template <typename T>
__global__ void scores_kernel(Dims d, const T* q, Bshd qs, const T* k, Bshd ks, const float* stats, float* ws) {
  const int64_t n = d.B * d.H * d.S * d.S;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = idx % d.S, i = (idx / d.S) % d.S, bh = idx / (d.S * d.S);
    const int64_t b = bh / d.H, h = bh % d.H, hk = h / d.group;
    if ((d.causal && j > i) || j < d.first_key(b, i)) {
      ws[idx] = 0.f;
      continue;
    }
    const float s = d.scale * dot(q + b * qs.b + i * qs.s + h * qs.h, k + b * ks.b + j * ks.s + hk * ks.h, d.D);
    ws[idx] = stats ? expf(s - stats[bh * d.S + i]) : s;
  }
}

// One block per query row: lse from the row's scores (max-subtracted so no
// exp overflows), then the row becomes P in place.
__global__ void softmax_rows_kernel(Dims d, float* ws, float* stats) {
  __shared__ float smem[kThreads];
  const int64_t rows = d.B * d.H * d.S;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t i = r % d.S, jend = d.causal ? i + 1 : d.S, jbeg = d.first_key(r / (d.H * d.S), i);
    float* row = ws + r * d.S;
    float m = -INFINITY;
    for (int64_t j = jbeg + threadIdx.x; j < jend; j += kThreads) m = fmaxf(m, row[j]);
    m = block_reduce(m, smem, [](float a, float b) { return fmaxf(a, b); });
    float sum = 0.f;
    for (int64_t j = jbeg + threadIdx.x; j < jend; j += kThreads) sum += expf(row[j] - m);
    sum = block_reduce(sum, smem, [](float a, float b) { return a + b; });
    const float lse = m + logf(sum);
    for (int64_t j = jbeg + threadIdx.x; j < jend; j += kThreads) row[j] = expf(row[j] - lse);
    if (threadIdx.x == 0) stats[r] = lse;  // r = (b*H + h)*S + i: the [B, H, S] layout
  }
}

// y[b, i, h, c] = alpha * sum_j M[bh, i, j] x[b, j, h/group, c] over the
// row's visible keys: out = P v (alpha 1) and dq = scale * dS k.
template <typename T>
__global__ void rows_times_kv_kernel(Dims d, const float* M, const T* x, Bshd xs, T* y, Bshd ys, float alpha) {
  const int64_t n = d.B * d.H * d.S * d.D;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = idx % d.D, i = (idx / d.D) % d.S, bh = idx / (d.D * d.S);
    const int64_t b = bh / d.H, h = bh % d.H, hk = h / d.group;
    const int64_t jend = d.causal ? i + 1 : d.S;
    const float* m = M + (bh * d.S + i) * d.S;
    const T* xc = x + b * xs.b + hk * xs.h + c;
    float acc = 0.f;
    for (int64_t j = d.first_key(b, i); j < jend; ++j) acc = fmaf(m[j], ld(xc + j * xs.s), acc);
    st(y + b * ys.b + i * ys.s + h * ys.h + c, alpha * acc);
  }
}

// y[b, j, hk, c] = alpha * sum_{h in group hk} sum_i M[bh, i, j] x[b, i, h, c]
// over the queries that see key j: dv = P^T do (alpha 1), dk = scale * dS^T q.
// The query heads of a group are summed here, in one thread, in head order:
// GQA's reduction without atomics.
template <typename T>
__global__ void cols_times_q_kernel(Dims d, const float* M, const T* x, Bshd xs, T* y, Bshd ys, float alpha) {
  const int64_t n = d.B * d.Hkv * d.S * d.D;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = idx % d.D, j = (idx / d.D) % d.S, bg = idx / (d.D * d.S);
    const int64_t b = bg / d.Hkv, hk = bg % d.Hkv;
    const int64_t ibeg = d.causal ? j : 0;
    float acc = 0.f;
    for (int64_t h = hk * d.group; h < (hk + 1) * d.group; ++h) {
      const float* m = M + (b * d.H + h) * d.S * d.S + j;
      const T* xc = x + b * xs.b + h * xs.h + c;
      // Queries of later documents do not see key j (their first key only grows with i).
      for (int64_t i = ibeg; i < d.S && d.first_key(b, i) <= j; ++i) acc = fmaf(m[i * d.S], ld(xc + i * xs.s), acc);
    }
    st(y + b * ys.b + j * ys.s + hk * ys.h + c, alpha * acc);
  }
}

// One block per query row: D_i = sum_j P_ij dP_ij, then the row of P becomes
// dS_ij = P_ij (dP_ij - D_i) in place (dP recomputed rather than stored: one
// S x S buffer instead of two).
template <typename T>
__global__ void dscores_rows_kernel(Dims d, float* ws, const T* dout, Bshd dos, const T* v, Bshd vs) {
  __shared__ float smem[kThreads];
  const int64_t rows = d.B * d.H * d.S;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t i = r % d.S, bh = r / d.S, b = bh / d.H, h = bh % d.H, hk = h / d.group;
    const int64_t jend = d.causal ? i + 1 : d.S, jbeg = d.first_key(b, i);
    const T* doi = dout + b * dos.b + i * dos.s + h * dos.h;
    const T* vb = v + b * vs.b + hk * vs.h;
    float* row = ws + r * d.S;
    float part = 0.f;
    for (int64_t j = jbeg + threadIdx.x; j < jend; j += kThreads)
      part = fmaf(row[j], dot(doi, vb + j * vs.s, d.D), part);
    const float Di = block_reduce(part, smem, [](float a, float b) { return a + b; });
    for (int64_t j = jbeg + threadIdx.x; j < jend; j += kThreads)
      row[j] = row[j] * (dot(doi, vb + j * vs.s, d.D) - Di);
  }
}

unsigned blocks_for(int64_t work_items) {
  return static_cast<unsigned>(std::clamp<int64_t>((work_items + kThreads - 1) / kThreads, 1, kMaxBlocks));
}
unsigned row_blocks(const Dims& d) { return static_cast<unsigned>(std::clamp<int64_t>(d.B * d.H * d.S, 1, kMaxBlocks)); }

void check_launch(const char* kernel, const AttnDims& d) {
  const cudaError_t e = cudaGetLastError();
  LOOM_CHECK(e == cudaSuccess, "naive attention (cuda): launching ", kernel, " for B=", d.B, " S=", d.S, " H=", d.H,
             " Hkv=", d.Hkv, " D=", d.D, " failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}

void check_args(const AttnDims& d, const void* workspace) {
  check_dims(d);
  LOOM_CHECK(workspace != nullptr, "naive attention (cuda): needs a device workspace of ", workspace_bytes(d),
             " bytes (workspace_bytes()), got none");
}

template <typename T>
void forward_impl(const AttnDims& ad, void* out, Bshd os, float* stats, const void* q, Bshd qs, const void* k, Bshd ks,
                  const void* v, Bshd vs, float* ws, cudaStream_t st) {
  const Dims d = dims_of(ad);
  scores_kernel<T><<<blocks_for(d.B * d.H * d.S * d.S), kThreads, 0, st>>>(d, static_cast<const T*>(q), qs,
                                                                           static_cast<const T*>(k), ks, nullptr, ws);
  check_launch("scores_kernel", ad);
  softmax_rows_kernel<<<row_blocks(d), kThreads, 0, st>>>(d, ws, stats);
  check_launch("softmax_rows_kernel", ad);
  rows_times_kv_kernel<T><<<blocks_for(d.B * d.H * d.S * d.D), kThreads, 0, st>>>(
      d, ws, static_cast<const T*>(v), vs, static_cast<T*>(out), os, 1.f);
  check_launch("rows_times_kv_kernel (out = P v)", ad);
}

template <typename T>
void backward_impl(const AttnDims& ad, void* dq, Bshd dqs, void* dk, Bshd dks, void* dv, Bshd dvs, const void* dout,
                   Bshd dos, const void* q, Bshd qs, const void* k, Bshd ks, const void* v, Bshd vs,
                   const float* stats, float* ws, cudaStream_t st) {
  const Dims d = dims_of(ad);
  const T* tq = static_cast<const T*>(q);
  const T* tk = static_cast<const T*>(k);
  const T* tv = static_cast<const T*>(v);
  const T* tdo = static_cast<const T*>(dout);
  scores_kernel<T><<<blocks_for(d.B * d.H * d.S * d.S), kThreads, 0, st>>>(d, tq, qs, tk, ks, stats, ws);
  check_launch("scores_kernel (P from stats)", ad);
  // dv needs P, which the next kernel overwrites with dS.
  cols_times_q_kernel<T><<<blocks_for(d.B * d.Hkv * d.S * d.D), kThreads, 0, st>>>(d, ws, tdo, dos,
                                                                                   static_cast<T*>(dv), dvs, 1.f);
  check_launch("cols_times_q_kernel (dv = P^T do)", ad);
  dscores_rows_kernel<T><<<row_blocks(d), kThreads, 0, st>>>(d, ws, tdo, dos, tv, vs);
  check_launch("dscores_rows_kernel", ad);
  rows_times_kv_kernel<T><<<blocks_for(d.B * d.H * d.S * d.D), kThreads, 0, st>>>(d, ws, tk, ks,
                                                                                  static_cast<T*>(dq), dqs, d.scale);
  check_launch("rows_times_kv_kernel (dq = scale dS k)", ad);
  cols_times_q_kernel<T><<<blocks_for(d.B * d.Hkv * d.S * d.D), kThreads, 0, st>>>(d, ws, tq, qs,
                                                                                   static_cast<T*>(dk), dks, d.scale);
  check_launch("cols_times_q_kernel (dk = scale dS^T q)", ad);
}

}  // namespace

size_t workspace_bytes(const AttnDims& d) {
  return static_cast<size_t>(d.B) * static_cast<size_t>(d.H) * static_cast<size_t>(d.S) * static_cast<size_t>(d.S) *
         sizeof(float);
}

void attention_forward(const AttnDims& d, bool bf16, void* out, Bshd os, float* stats, const void* q, Bshd qs,
                       const void* k, Bshd ks, const void* v, Bshd vs, void* workspace, void* stream) {
  check_args(d, workspace);
  auto* ws = static_cast<float*>(workspace);
  auto st = static_cast<cudaStream_t>(stream);
  if (bf16)
    forward_impl<bf16_t>(d, out, os, stats, q, qs, k, ks, v, vs, ws, st);
  else
    forward_impl<float>(d, out, os, stats, q, qs, k, ks, v, vs, ws, st);
}

void attention_backward(const AttnDims& d, bool bf16, void* dq, Bshd dqs, void* dk, Bshd dks, void* dv, Bshd dvs,
                        const void* dout, Bshd dos, const void* q, Bshd qs, const void* k, Bshd ks, const void* v,
                        Bshd vs, const float* stats, void* workspace, void* stream) {
  check_args(d, workspace);
  auto* ws = static_cast<float*>(workspace);
  auto st = static_cast<cudaStream_t>(stream);
  if (bf16)
    backward_impl<bf16_t>(d, dq, dqs, dk, dks, dv, dvs, dout, dos, q, qs, k, ks, v, vs, stats, ws, st);
  else
    backward_impl<float>(d, dq, dqs, dk, dks, dv, dvs, dout, dos, q, qs, k, ks, v, vs, stats, ws, st);
}

}  // namespace loom::naive::cuda
