// Global-norm helpers on the GPU: sum and sum of squares of a range
// (gradient clipping, loss sums), read back to the host (reduce_sum) or added
// into a device f64 accumulator (sum_into, the asynchronous step's norm), the
// clipping decision on the device (clip_scale) and an in-place scale.
//
// The reductions are deterministic two-pass sums: pass 1 runs a grid whose
// size depends on the element count alone; each thread accumulates its
// grid-stride groups of K elements in double (squares taken in double, like
// the CPU), the block reduces in a fixed shuffle order and writes one
// partial; pass 2, one block, adds the partials in a fixed order. The order
// of every addition is a function of n = end - begin alone: the packed and
// the scalar (unaligned) loads visit the same elements in the same order, so
// the same values give the same bits at any offset, on every run and every
// GPU model (no atomics, no SM-count dependent grids). The partials live in
// the backend's scratch.
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.hpp"

namespace loom::gpu {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1024;
constexpr int64_t kElemsPerThread = 16;  // below this, fewer blocks

// acc + x (or x^2) in double. The square of an fp32 value is exact in double
// (24-bit significands), so a fused multiply-add rounds exactly like a
// multiply then an add: the explicit _rn intrinsics leave nvcc no contraction
// choice that could differ between the packed and scalar instances.
template <bool kSquare>
__device__ __forceinline__ double add_term(double acc, float x) {
  const double d = x;
  return kSquare ? __fma_rn(d, d, acc) : __dadd_rn(acc, d);
}

// Thread gid sums the groups [v K, v K + K) for v = gid, gid + stride, ...,
// each group in element order, then the tail (n % K elements) one element
// per thread. kPacked only picks the load width (16-byte loads when x is
// aligned for them, K scalar loads otherwise); the arithmetic is the same.
template <int K, bool kPacked, bool kSquare, typename T>
__global__ void __launch_bounds__(kThreads) reduce_partial_kernel(double* partial, const T* x, int64_t n) {
  __shared__ double red[32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / K;
  double acc = 0.0;
  for (int64_t i = gid; i < nvec; i += stride) {
    float v[K];
    if constexpr (kPacked) {
      load_vec<K>(x + i * K, v);
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] = to_f32(x[i * K + k]);
    }
#pragma unroll
    for (int k = 0; k < K; ++k) acc = add_term<kSquare>(acc, v[k]);
  }
  for (int64_t i = nvec * K + gid; i < n; i += stride) acc = add_term<kSquare>(acc, to_f32(x[i]));
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// kAccumulate: *out += total (sum_into, on the device); else *out = total.
template <bool kAccumulate>
__global__ void __launch_bounds__(kThreads) reduce_final_kernel(double* out, const double* partial, int nblocks) {
  __shared__ double red[32];
  double acc = 0.0;
  for (int i = threadIdx.x; i < nblocks; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) {
    if constexpr (kAccumulate) *out += acc;
    else *out = acc;
  }
}

// The clipping decision of Backend::clip_scale, one thread, in double as the
// CPU computes it (CpuBackend::clip_scale). The _rn intrinsics keep nvcc from
// fusing the multiply into the following add (an FMA rounds once, the CPU
// twice), so the finite cases are bitwise the CPU's: sqrt and the division of
// doubles are correctly rounded on the device as on the host.
__global__ void clip_scale_kernel(double* s, float grad_scale, float clip_norm) {
  const double norm = __dmul_rn(sqrt(s[kNormSq]), static_cast<double>(grad_scale));
  const bool finite = isfinite(norm);
  s[kGradNorm] = norm;
  s[kSkip] = finite ? 0.0 : 1.0;
  double coef = 1.0;
  if (clip_norm > 0 && finite) {
    const double c = __ddiv_rn(static_cast<double>(clip_norm), __dadd_rn(norm, 1e-6));
    if (c < 1.0) coef = c;
  }
  // fp32, as the AdamW kernels apply it (and the CPU stores it).
  s[kUpdateScale] = static_cast<double>(__double2float_rn(__dmul_rn(static_cast<double>(grad_scale), coef)));
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

// Both passes of the reduction of x[begin, begin + n), n > 0, the total
// written to (kAccumulate: added into) *out, a device double. Queued only.
template <bool kAccumulate>
void launch_reduce(double* out, const Tensor& x, int64_t begin, int64_t n, bool square, const Scratch& scratch,
                   cudaStream_t stream, const char* what) {
  int64_t blocks = (n + kThreads * kElemsPerThread - 1) / (kThreads * kElemsPerThread);
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  LOOM_CHECK(scratch.bytes >= (kMaxBlocks + 1) * sizeof(double), what, ": backend scratch of ", scratch.bytes,
             " bytes is too small");
  double* partial = static_cast<double*>(scratch.ptr);
  dispatch_float(x.dtype, what, [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const T* p = x.ptr<T>() + begin;
    const bool vec = aligned_bytes(p, K * sizeof(T));
    const unsigned g = static_cast<unsigned>(blocks);
    if (square) {
      if (vec) reduce_partial_kernel<K, true, true, T><<<g, kThreads, 0, stream>>>(partial, p, n);
      else reduce_partial_kernel<K, false, true, T><<<g, kThreads, 0, stream>>>(partial, p, n);
    } else {
      if (vec) reduce_partial_kernel<K, true, false, T><<<g, kThreads, 0, stream>>>(partial, p, n);
      else reduce_partial_kernel<K, false, false, T><<<g, kThreads, 0, stream>>>(partial, p, n);
    }
    LOOM_CUDA_LAUNCH_CHECK("reduce_partial_kernel", what, " n=", n, " begin=", begin, " blocks=", blocks,
                           " square=", square, " packed loads=", vec);
  });
  reduce_final_kernel<kAccumulate><<<1, kThreads, 0, stream>>>(out, partial, static_cast<int>(blocks));
  LOOM_CUDA_LAUNCH_CHECK("reduce_final_kernel", what, " blocks=", blocks, " accumulate=", kAccumulate);
}

void check_range(const Tensor& x, int64_t begin, int64_t end, const char* what) {
  check_device(x, what);
  check_contiguous(x, what);
  LOOM_CHECK(0 <= begin && begin <= end && end <= x.numel(), what, " range [", begin, ",", end, ") of a tensor of ",
             x.numel(), " elements");
}

}  // namespace

double reduce_sum(const Tensor& x, int64_t begin, int64_t end, bool square, const Scratch& scratch,
                  double* host_result, cudaStream_t stream) {
  const char* what = square ? "sq_norm" : "sum";
  check_range(x, begin, end, what);
  const int64_t n = end - begin;
  if (n == 0) return 0.0;
  // The result slot follows the partials in the scratch.
  double* result = static_cast<double*>(scratch.ptr) + kMaxBlocks;
  launch_reduce<false>(result, x, begin, n, square, scratch, stream, what);
  LOOM_CUDA_CHECK(cudaMemcpyAsync(host_result, result, sizeof(double), cudaMemcpyDeviceToHost, stream),
                  "reduce_sum result to host");
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream), "reduce_sum over ", n, " elements");
  return *host_result;
}

void sum_into(Tensor& acc, const Tensor& x, int64_t begin, int64_t end, bool square, const Scratch& scratch,
              cudaStream_t stream) {
  const char* what = square ? "sum_into (squares)" : "sum_into";
  check_device(acc, "sum_into accumulator");
  LOOM_CHECK(acc.dtype == DType::f64 && acc.numel() >= 1, "sum_into: the accumulator must be a device f64 scalar, got ",
             dtype_name(acc.dtype), acc.shape_str());
  check_range(x, begin, end, what);
  const int64_t n = end - begin;
  if (n == 0) return;  // adds 0
  launch_reduce<true>(acc.ptr<double>(), x, begin, n, square, scratch, stream, what);
}

void clip_scale(Tensor& scalars, float grad_scale, float clip_norm, cudaStream_t stream) {
  check_device(scalars, "clip_scale scalars");
  LOOM_CHECK(scalars.dtype == DType::f64 && scalars.numel() >= kStepScalars, "clip_scale: scalars must be f64[",
             static_cast<int>(kStepScalars), "], got ", dtype_name(scalars.dtype), scalars.shape_str());
  clip_scale_kernel<<<1, 1, 0, stream>>>(scalars.ptr<double>(), grad_scale, clip_norm);
  LOOM_CUDA_LAUNCH_CHECK("clip_scale_kernel", "grad_scale=", grad_scale, " clip_norm=", clip_norm);
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
