// Global-norm helpers on the GPU: sum and sum of squares of a range
// (gradient clipping, loss sums) and an in-place scale.
//
// The reductions are deterministic two-pass sums: pass 1 runs a grid whose
// size depends on the element count alone; each thread accumulates its
// grid-stride elements in double (squares taken in double, like the CPU),
// the block reduces in a fixed shuffle order and writes one partial; pass 2,
// one block, adds the partials in a fixed order. The same input gives the
// same bits on every run and every GPU model (no atomics, no SM-count
// dependent grids). The partials live in the backend's scratch.
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.hpp"

namespace loom::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1024;
constexpr int64_t kElemsPerThread = 16;  // below this, fewer blocks

template <int K, bool kSquare, typename T>
__global__ void __launch_bounds__(kThreads) reduce_partial_kernel(double* partial, const T* x, int64_t n) {
  __shared__ double red[32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / K;
  double acc = 0.0;
  for (int64_t i = gid; i < nvec; i += stride) {
    float v[K];
    load_vec<K>(x + i * K, v);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const double d = v[k];
      acc += kSquare ? d * d : d;
    }
  }
  for (int64_t i = nvec * K + gid; i < n; i += stride) {
    const double d = to_f32(x[i]);
    acc += kSquare ? d * d : d;
  }
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(kThreads) reduce_final_kernel(double* out, const double* partial, int nblocks) {
  __shared__ double red[32];
  double acc = 0.0;
  for (int i = threadIdx.x; i < nblocks; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) *out = acc;
}

template <typename T>
struct ScaleOp {
  T* x;
  float s;
  template <int K>
  __device__ void apply(int64_t i) const {
    float v[K];
    load_vec<K>(x + i, v);
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] *= s;
    store_vec<K>(x + i, v);
  }
};

}  // namespace

double reduce_sum(const Tensor& x, int64_t begin, int64_t end, bool square, const Scratch& scratch,
                  double* host_result, cudaStream_t stream) {
  check_device(x, square ? "sq_norm" : "sum");
  check_contiguous(x, square ? "sq_norm" : "sum");
  LOOM_CHECK(0 <= begin && begin <= end && end <= x.numel(), square ? "sq_norm" : "sum", " range [", begin, ",",
             end, ") of a tensor of ", x.numel(), " elements");
  const int64_t n = end - begin;
  if (n == 0) return 0.0;
  int64_t blocks = (n + kThreads * kElemsPerThread - 1) / (kThreads * kElemsPerThread);
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  LOOM_CHECK(scratch.bytes >= (kMaxBlocks + 1) * sizeof(double), "reduce_sum: backend scratch of ", scratch.bytes,
             " bytes is too small");
  double* partial = static_cast<double*>(scratch.ptr);
  double* result = partial + kMaxBlocks;
  dispatch_float(x.dtype, square ? "sq_norm" : "sum", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const T* p = x.ptr<T>() + begin;
    const bool vec = aligned_bytes(p, K * sizeof(T));
    const unsigned g = static_cast<unsigned>(blocks);
    if (square) {
      if (vec) reduce_partial_kernel<K, true, T><<<g, kThreads, 0, stream>>>(partial, p, n);
      else reduce_partial_kernel<1, true, T><<<g, kThreads, 0, stream>>>(partial, p, n);
    } else {
      if (vec) reduce_partial_kernel<K, false, T><<<g, kThreads, 0, stream>>>(partial, p, n);
      else reduce_partial_kernel<1, false, T><<<g, kThreads, 0, stream>>>(partial, p, n);
    }
    LOOM_CUDA_LAUNCH_CHECK("reduce_partial_kernel", "n=", n, " begin=", begin, " blocks=", blocks, " square=", square,
                           " vectorised=", vec);
  });
  reduce_final_kernel<<<1, kThreads, 0, stream>>>(result, partial, static_cast<int>(blocks));
  LOOM_CUDA_LAUNCH_CHECK("reduce_final_kernel", "blocks=", blocks);
  LOOM_CUDA_CHECK(cudaMemcpyAsync(host_result, result, sizeof(double), cudaMemcpyDeviceToHost, stream),
                  "reduce_sum result to host");
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream), "reduce_sum over ", n, " elements");
  return *host_result;
}

void scale(Tensor& x, float s, cudaStream_t stream) {
  check_device(x, "scale");
  check_contiguous(x, "scale");
  dispatch_float(x.dtype, "scale", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    launch_elementwise<K>(ScaleOp<T>{x.ptr<T>(), s}, x.numel(), aligned_bytes(x.data, K * sizeof(T)), stream, "scale");
  });
}

}  // namespace loom::gpu
