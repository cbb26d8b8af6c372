// Token embedding on the GPU: a row gather forward, a deterministic row
// scatter-add backward.
//
// Backward without atomics. Several tokens of a batch can share an id, so a
// parallel scatter over tokens needs float atomics whose order (and so the
// rounding of the sums) changes from run to run. Sorting the tokens (cub radix
// sort) would fix the order but needs temporary storage sized by N. Instead
// each block OWNS kRows consecutive vocabulary rows and scans all N token
// ids in order, staging the positions that hit its rows in shared memory
// (an ordered compaction: ballots and warp offsets keep increasing n). For
// each owned row that was hit it then sums the matching dout rows in fp32 in
// increasing n and adds the sum to dwte once. Every dwte element is written
// by one thread, with its additions in a fixed order: bitwise reproducible,
// no scratch memory, and rows that no token hit are not touched.
// Cost: ceil(V / kRows) blocks each read the N token ids (from L2): for
// V = 128k, N = 16k that is 2000 x 64 KiB of L2 reads, tens of microseconds.
// Out-of-range ids (< 0 or >= V) match no block, so they are skipped.
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.hpp"

namespace loom::gpu {
namespace {

constexpr int kFwdThreads = 128;
constexpr int kRows = 64;        // vocabulary rows owned by one backward block (fits list_r's uint8)
constexpr int kBwdThreads = 256;
constexpr int kListCap = 2048;   // staged matches before they are added out

// One block per token row. An id outside [0, V) writes NaN: reading wte there
// would be out of bounds, and a NaN loss makes the bad data visible (the
// trainer checks ids on the host before upload; see cpu::check_tokens).
template <int K, typename T>
__global__ void embedding_forward_kernel(T* out, const int32_t* tokens, const T* wte, int64_t h, int64_t V) {
  const int64_t n = blockIdx.x;
  const int64_t tok = tokens[n];
  const bool valid = tok >= 0 && tok < V;
  const T* src = wte + (valid ? tok : 0) * h;
  T* dst = out + n * h;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * K; j < h; j += static_cast<int64_t>(blockDim.x) * K) {
    float v[K];
    if (valid) {
      load_vec<K>(src + j, v);
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] = __int_as_float(0x7fc00000);
    }
    store_vec<K>(dst + j, v);
  }
}

// Adds the staged matches into dwte: for each owned row with hits, the
// matching dout rows summed in list order (= increasing n). Called by the
// whole block; resets the list.
template <int K, typename TG, typename TA>
__device__ void embedding_flush(TG* dwte, const TA* dout, int64_t h, int64_t v0, int rows, const int32_t* list_n,
                                const uint8_t* list_r, int* row_count, int* list_len) {
  const int len = *list_len;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * K; j < h; j += static_cast<int64_t>(blockDim.x) * K) {
    for (int r = 0; r < rows; ++r) {
      if (row_count[r] == 0) continue;
      float acc[K];
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] = 0.f;
      for (int e = 0; e < len; ++e) {
        if (list_r[e] != r) continue;
        float d[K];
        load_vec<K>(dout + static_cast<int64_t>(list_n[e]) * h + j, d);
#pragma unroll
        for (int k = 0; k < K; ++k) acc[k] += d[k];
      }
      TG* dst = dwte + (v0 + r) * h + j;
      float cur[K];
      load_vec<K>(dst, cur);
#pragma unroll
      for (int k = 0; k < K; ++k) cur[k] += acc[k];
      store_vec<K>(dst, cur);
    }
  }
  __syncthreads();  // everyone is done reading the list
  if (threadIdx.x < kRows) row_count[threadIdx.x] = 0;
  if (threadIdx.x == 0) *list_len = 0;
  __syncthreads();
}

template <int K, typename TG, typename TA>
__global__ void __launch_bounds__(kBwdThreads) embedding_backward_kernel(TG* dwte, const TA* dout,
                                                                         const int32_t* tokens, int64_t N, int64_t h,
                                                                         int64_t V) {
  __shared__ int32_t list_n[kListCap];
  __shared__ uint8_t list_r[kListCap];
  __shared__ int warp_count[kBwdThreads / 32];
  __shared__ int row_count[kRows];
  __shared__ int list_len;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t v0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int rows = static_cast<int>(V - v0 < kRows ? V - v0 : kRows);
  if (threadIdx.x < kRows) row_count[threadIdx.x] = 0;
  if (threadIdx.x == 0) list_len = 0;
  __syncthreads();

  for (int64_t base = 0; base < N; base += kBwdThreads) {
    // list_len is block-uniform here (last written before a barrier).
    if (list_len + kBwdThreads > kListCap)
      embedding_flush<K>(dwte, dout, h, v0, rows, list_n, list_r, row_count, &list_len);
    const int64_t n = base + threadIdx.x;
    int r = -1;
    if (n < N) {
      const int64_t t = tokens[n];
      if (t >= v0 && t < v0 + rows) r = static_cast<int>(t - v0);
    }
    const unsigned hits = __ballot_sync(0xffffffffu, r >= 0);
    if (lane == 0) warp_count[warp] = __popc(hits);
    __syncthreads();
    if (r >= 0) {
      int pos = list_len;
      for (int w = 0; w < warp; ++w) pos += warp_count[w];
      pos += __popc(hits & ((1u << lane) - 1u));
      list_n[pos] = static_cast<int32_t>(n);
      list_r[pos] = static_cast<uint8_t>(r);
      atomicAdd(&row_count[r], 1);  // an integer count: the same whatever the order
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int total = 0;
      for (int w = 0; w < kBwdThreads / 32; ++w) total += warp_count[w];
      list_len += total;
    }
    __syncthreads();
  }
  embedding_flush<K>(dwte, dout, h, v0, rows, list_n, list_r, row_count, &list_len);
}

void check_tokens_tensor(const Tensor& tokens, const char* what) {
  check_device(tokens, what);
  LOOM_CHECK(tokens.dtype == DType::i32, what, ": token ids must be int32, got ", dtype_name(tokens.dtype));
  check_contiguous(tokens, what);
}

}  // namespace

void embedding_forward(Tensor& out, const Tensor& tokens, const Tensor& wte, cudaStream_t stream) {
  check_device(out, "embedding out");
  check_device(wte, "wte");
  check_tokens_tensor(tokens, "embedding tokens");
  check_contiguous(out, "embedding out");
  check_contiguous(wte, "wte");
  LOOM_CHECK(wte.ndim == 2, "wte must be [V, h], got ", wte.shape_str());
  LOOM_CHECK(out.dtype == wte.dtype, "embedding: out is ", dtype_name(out.dtype), " but wte is ",
             dtype_name(wte.dtype), " (activations and params share a dtype in every supported recipe)");
  const int64_t V = wte.size(0), h = wte.size(1), N = tokens.numel();
  LOOM_CHECK(out.numel() == N * h, "embedding out ", out.shape_str(), " is not [", N, ", ", h, "]");
  if (N == 0) return;
  LOOM_CHECK(N <= 0x7fffffff, "embedding: ", N, " tokens exceed the grid limit");
  dispatch_float(out.dtype, "embedding_forward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const bool vec = h % K == 0 && aligned_bytes(out.data, K * sizeof(T)) && aligned_bytes(wte.data, K * sizeof(T));
    const int threads = row_threads(vec ? h / K : h, kFwdThreads);
    if (vec)
      embedding_forward_kernel<K, T><<<static_cast<unsigned>(N), threads, 0, stream>>>(
          out.ptr<T>(), tokens.ptr<int32_t>(), wte.ptr<T>(), h, V);
    else
      embedding_forward_kernel<1, T><<<static_cast<unsigned>(N), threads, 0, stream>>>(
          out.ptr<T>(), tokens.ptr<int32_t>(), wte.ptr<T>(), h, V);
    LOOM_CUDA_LAUNCH_CHECK("embedding_forward_kernel", "N=", N, " h=", h, " V=", V, " threads=", threads,
                           " vectorised=", vec);
  });
}

void embedding_backward(Tensor& dwte, const Tensor& dout, const Tensor& tokens, cudaStream_t stream) {
  check_device(dwte, "dwte");
  check_device(dout, "embedding dout");
  check_tokens_tensor(tokens, "embedding tokens");
  check_contiguous(dwte, "dwte");
  check_contiguous(dout, "embedding dout");
  LOOM_CHECK(dwte.ndim == 2, "dwte must be [V, h], got ", dwte.shape_str());
  const int64_t V = dwte.size(0), h = dwte.size(1), N = tokens.numel();
  LOOM_CHECK(dout.numel() == N * h, "embedding dout ", dout.shape_str(), " is not [", N, ", ", h, "]");
  LOOM_CHECK(N <= 0x7fffffff, "embedding: ", N, " tokens exceed int32 positions");
  if (N == 0 || V == 0) return;
  dispatch_act_grad(dout.dtype, dwte.dtype, "embedding_backward", [&](auto ta, auto tg) {
    using TA = decltype(ta);
    using TG = decltype(tg);
    constexpr int K = vec_width<TA, TG>();
    const bool vec = h % K == 0 && aligned_bytes(dout.data, K * sizeof(TA)) && aligned_bytes(dwte.data, K * sizeof(TG));
    const int64_t blocks = (V + kRows - 1) / kRows;
    if (vec)
      embedding_backward_kernel<K, TG, TA><<<static_cast<unsigned>(blocks), kBwdThreads, 0, stream>>>(
          dwte.ptr<TG>(), dout.ptr<TA>(), tokens.ptr<int32_t>(), N, h, V);
    else
      embedding_backward_kernel<1, TG, TA><<<static_cast<unsigned>(blocks), kBwdThreads, 0, stream>>>(
          dwte.ptr<TG>(), dout.ptr<TA>(), tokens.ptr<int32_t>(), N, h, V);
    LOOM_CUDA_LAUNCH_CHECK("embedding_backward_kernel", "N=", N, " h=", h, " V=", V, " blocks=", blocks,
                           " vectorised=", vec);
  });
}

}  // namespace loom::gpu
