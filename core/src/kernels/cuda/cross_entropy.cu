// Fused softmax + cross-entropy on the GPU, one block per row of the logits:
//   pass 1: online max and sum of exp (each thread keeps a running (max, sum)
//           rescaled when its max grows), combined across the block in a
//           fixed order -> lse = max + log(sum)
//   pass 2 (when dlogits_scale != 0): the gradient (softmax - onehot) * scale
//           written over the logits, as llm.c's fused classifier does (the
//           logits are dead after the loss, so no [N, V] buffer is needed).
// Two reads and one write of the row; fp32 math whatever the storage type.
//
// Targets: < 0 is an ignored position (loss 0, zero gradient row), as on
// the CPU. >= V cannot be looked up: the CPU throws, but a kernel cannot, so
// the row's loss is NaN (the loss becomes visibly non-finite) and its
// gradient row is zero; nothing outside the row is read.
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.hpp"

namespace loom::gpu {
namespace {

constexpr int kMaxThreads = 512;

// Merge two (max, sum-of-exp relative to max) pairs. An empty side has
// max = -inf and sum = 0; two empty sides stay empty (no -inf - -inf NaN).
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  const float M = fmaxf(m, m2);
  if (M == -INFINITY) return;
  s = s * expf(m - M) + s2 * expf(m2 - M);
  m = M;
}

template <int K, typename T>
__global__ void __launch_bounds__(kMaxThreads) cross_entropy_kernel(T* logits, const int32_t* targets,
                                                                    float* losses, int64_t V, float scale) {
  __shared__ float red_m[32], red_s[32];
  const int64_t n = blockIdx.x;
  T* row = logits + n * V;
  const int64_t t = targets[n];
  const int64_t step = static_cast<int64_t>(blockDim.x) * K;
  const int64_t j0 = static_cast<int64_t>(threadIdx.x) * K;

  if (t < 0 || t >= V) {  // block-uniform branch
    if (threadIdx.x == 0) losses[n] = t < 0 ? 0.f : __int_as_float(0x7fc00000);
    if (scale != 0.f) {
      float z[K];
#pragma unroll
      for (int k = 0; k < K; ++k) z[k] = 0.f;
      for (int64_t j = j0; j < V; j += step) store_vec<K>(row + j, z);
    }
    return;
  }

  // Read before pass 2 overwrites the row; the barriers of the reduction
  // below order this read before every write.
  const float lt = to_f32(row[t]);

  float m = -INFINITY, s = 0.f;
  for (int64_t j = j0; j < V; j += step) {
    float v[K];
    load_vec<K>(row + j, v);
    float vm = v[0];
#pragma unroll
    for (int k = 1; k < K; ++k) vm = fmaxf(vm, v[k]);
    if (vm > m) {
      s *= expf(m - vm);  // m = -inf at first: expf(-inf) = 0, and s is 0 anyway
      m = vm;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) s += expf(v[k] - m);
  }
  // Warp, then block: fixed shuffle pattern and warp order.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
    lse_merge(m, s, m2, s2);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  if (lane == 0) {
    red_m[warp] = m;
    red_s[warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
    float bm = lane < nwarps ? red_m[lane] : -INFINITY;
    float bs = lane < nwarps ? red_s[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, bm, o);
      const float s2 = __shfl_xor_sync(0xffffffffu, bs, o);
      lse_merge(bm, bs, m2, s2);
    }
    if (lane == 0) {
      red_m[0] = bm;
      red_s[0] = bs;
    }
  }
  __syncthreads();
  const float lse = red_m[0] + logf(red_s[0]);
  if (threadIdx.x == 0) losses[n] = lse - lt;
  if (scale == 0.f) return;

  for (int64_t j = j0; j < V; j += step) {
    float v[K];
    load_vec<K>(row + j, v);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float p = expf(v[k] - lse);
      v[k] = (j + k == t ? p - 1.f : p) * scale;
    }
    store_vec<K>(row + j, v);
  }
}

}  // namespace

void cross_entropy(Tensor& logits, const Tensor& targets, Tensor& losses, float dlogits_scale, cudaStream_t stream) {
  check_device(logits, "logits");
  check_device(targets, "targets");
  check_device(losses, "losses");
  check_contiguous(logits, "logits");
  check_contiguous(targets, "targets");
  check_contiguous(losses, "losses");
  LOOM_CHECK(targets.dtype == DType::i32, "cross_entropy: targets must be int32, got ", dtype_name(targets.dtype));
  LOOM_CHECK(losses.dtype == DType::f32, "cross_entropy: losses must be fp32, got ", dtype_name(losses.dtype));
  LOOM_CHECK(logits.ndim >= 1, "cross_entropy: logits need a vocabulary dimension");
  const int64_t V = logits.size(-1);
  LOOM_CHECK(V > 0, "cross_entropy: vocabulary size must be positive, got V=", V);
  const int64_t N = logits.numel() / V;
  LOOM_CHECK(targets.numel() == N && losses.numel() == N, "cross_entropy: logits ", logits.shape_str(),
             " need ", N, " targets and losses, got ", targets.shape_str(), " and ", losses.shape_str());
  if (N == 0) return;
  LOOM_CHECK(N <= 0x7fffffff, "cross_entropy: ", N, " rows exceed the grid limit");
  dispatch_float(logits.dtype, "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const bool vec = V % K == 0 && aligned_bytes(logits.data, K * sizeof(T));
    const int threads = row_threads(vec ? V / K : V, kMaxThreads);
    if (vec)
      cross_entropy_kernel<K, T><<<static_cast<unsigned>(N), threads, 0, stream>>>(
          logits.ptr<T>(), targets.ptr<int32_t>(), losses.ptr<float>(), V, dlogits_scale);
    else
      cross_entropy_kernel<1, T><<<static_cast<unsigned>(N), threads, 0, stream>>>(
          logits.ptr<T>(), targets.ptr<int32_t>(), losses.ptr<float>(), V, dlogits_scale);
    LOOM_CUDA_LAUNCH_CHECK("cross_entropy_kernel", "N=", N, " V=", V, " threads=", threads, " scale=", dlogits_scale,
                           " vectorised=", vec);
  });
}

}  // namespace loom::gpu
