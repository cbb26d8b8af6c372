// Shared device helpers for the CUDA kernels (one .cu per layer, like
// kernels/cpu): element conversions, packed 16-byte loads and stores,
// deterministic block reductions, dtype dispatch and launch sizing.
//
// Every kernel computes in fp32 whatever the storage type (fp32 or bf16), and
// rounds once when it stores (round to nearest even for bf16).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "loom/ops/cuda_check.hpp"
#include "loom/error.hpp"
#include "loom/tensor.hpp"

namespace loom::gpu {

using bf16 = __nv_bfloat16;

// ---- element conversions ---------------------------------------------------

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ bf16 from_f32<bf16>(float x) { return __float2bfloat16_rn(x); }

// ---- packed loads and stores -------------------------------------------------
// K consecutive elements at p, moved in the widest accesses K * sizeof(T)
// allows (16-byte ld/st.global.v4 when it is a multiple of 16). The caller
// guarantees the alignment (see aligned_for below); K = 1 is the scalar path.

template <int K, typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[K]) {
  constexpr int kBytes = K * static_cast<int>(sizeof(T));
  T tmp[K];
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int c = 0; c < kBytes / 16; ++c) {
      const int4 r = reinterpret_cast<const int4*>(p)[c];
      memcpy(reinterpret_cast<char*>(tmp) + 16 * c, &r, 16);
    }
  } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
    for (int c = 0; c < kBytes / 8; ++c) {
      const int2 r = reinterpret_cast<const int2*>(p)[c];
      memcpy(reinterpret_cast<char*>(tmp) + 8 * c, &r, 8);
    }
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) tmp[k] = p[k];
  }
#pragma unroll
  for (int k = 0; k < K; ++k) out[k] = to_f32(tmp[k]);
}

template <int K, typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[K]) {
  constexpr int kBytes = K * static_cast<int>(sizeof(T));
  T tmp[K];
#pragma unroll
  for (int k = 0; k < K; ++k) tmp[k] = from_f32<T>(in[k]);
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int c = 0; c < kBytes / 16; ++c) {
      int4 r;
      memcpy(&r, reinterpret_cast<const char*>(tmp) + 16 * c, 16);
      reinterpret_cast<int4*>(p)[c] = r;
    }
  } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
    for (int c = 0; c < kBytes / 8; ++c) {
      int2 r;
      memcpy(&r, reinterpret_cast<const char*>(tmp) + 8 * c, 8);
      reinterpret_cast<int2*>(p)[c] = r;
    }
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) p[k] = tmp[k];
  }
}

// Elements per 16-byte access for the widest type of an operation.
template <typename... Ts>
constexpr int vec_width() {
  size_t w = 1;
  ((w = sizeof(Ts) > w ? sizeof(Ts) : w), ...);
  return static_cast<int>(16 / w);
}

// True when p is a multiple of `bytes` (the packed access size).
inline bool aligned_bytes(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// ---- reductions ------------------------------------------------------------------
// Butterfly sums inside a warp, then warp partials combined by warp 0 in warp
// order: the order depends on blockDim alone, so results are bitwise
// reproducible run to run (no atomics).

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum, returned to every thread. `shared` holds 32 values of T;
// blockDim.x must be a multiple of 32. Ends with a barrier, so the shared
// slots may be reused right after.
template <typename T>
__device__ T block_sum(T v, T* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // earlier users of `shared` are done
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T s = lane < nwarps ? shared[lane] : T(0);
    s = warp_sum(s);
    if (lane == 0) shared[0] = s;
  }
  __syncthreads();
  const T total = shared[0];
  __syncthreads();
  return total;
}

// ---- host-side dispatch and sizing ------------------------------------------------

inline void check_device(const Tensor& t, const char* what) {
  LOOM_CHECK(t.device == Device::cuda, what, ": tensor ", t.shape_str(), " is on ", device_name(t.device),
             ", the CUDA backend needs device memory");
  LOOM_CHECK(t.data != nullptr || t.numel() == 0, what, ": tensor ", t.shape_str(), " has no data");
}

inline void check_contiguous(const Tensor& t, const char* what) {
  LOOM_CHECK(t.is_contiguous(), what, ": tensor ", t.shape_str(), " must be contiguous");
}

// f(float{}) or f(bf16{}) by the tensor's dtype; any other dtype is refused.
template <typename F>
void dispatch_float(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::f32: f(float{}); return;
    case DType::bf16: f(bf16{}); return;
    default:
      throw Error(cat(what, ": dtype ", dtype_name(t), " is not supported by the CUDA backend (fp32 or bf16)"));
  }
}

// The recipe combinations of backend.hpp: (activation/param, grad) =
// (f32, f32), (bf16, f32), (bf16, bf16). f(TA{}, TG{}).
template <typename F>
void dispatch_act_grad(DType act, DType grad, const char* what, F&& f) {
  if (act == DType::f32 && grad == DType::f32) return f(float{}, float{});
  if (act == DType::bf16 && grad == DType::f32) return f(bf16{}, float{});
  if (act == DType::bf16 && grad == DType::bf16) return f(bf16{}, bf16{});
  throw Error(cat(what, ": (activation, gradient) dtypes (", dtype_name(act), ", ", dtype_name(grad),
                  ") are not a supported recipe; the CUDA backend supports (fp32, fp32), (bf16, fp32), (bf16, bf16)"));
}

template <typename T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else return DType::bf16;
}

// Blocks that fill an H100 (132 SMs) several times over: the most a
// grid-stride launch asks for.
constexpr int64_t kMaxGridBlocks = 132 * 32;

// Grid for a grid-stride loop over `work` items with `threads` per block:
// enough blocks to fill an H100 several times over, never more than needed.
inline unsigned grid_for(int64_t work, int threads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxGridBlocks ? kMaxGridBlocks : blocks));
}

}  // namespace loom::gpu

namespace loom::gpu {

// ---- element-wise launcher -----------------------------------------------------------
// Op::apply<K>(i) handles elements [i, i + K). The kernel runs the packed
// path over the first n / K * K elements and the scalar path over the tail,
// so n need not be a multiple of the width; `vectorise` is false when some
// pointer is not aligned for packed access, and then everything is scalar.

constexpr int kElementwiseThreads = 256;

template <int K, typename Op>
__global__ void elementwise_kernel(Op op, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / K;
  for (int64_t v = gid; v < nvec; v += stride) op.template apply<K>(v * K);
  for (int64_t i = nvec * K + gid; i < n; i += stride) op.template apply<1>(i);
}

template <int K, typename Op>
void launch_elementwise(const Op& op, int64_t n, bool vectorise, cudaStream_t stream, const char* name) {
  if (n == 0) return;
  if (vectorise) {
    const unsigned grid = grid_for((n + K - 1) / K, kElementwiseThreads);
    elementwise_kernel<K><<<grid, kElementwiseThreads, 0, stream>>>(op, n);
    LOOM_CUDA_LAUNCH_CHECK(name, "n=", n, " K=", K, " grid=", grid);
  } else {
    const unsigned grid = grid_for(n, kElementwiseThreads);
    elementwise_kernel<1><<<grid, kElementwiseThreads, 0, stream>>>(op, n);
    LOOM_CUDA_LAUNCH_CHECK(name, "n=", n, " K=1 (unaligned) grid=", grid);
  }
}

// Threads for a one-block-per-row kernel: enough warps to give every thread
// at least one packed vector of the row, at most `max_threads`.
inline int row_threads(int64_t row_vecs, int max_threads) {
  int64_t t = (row_vecs + 31) / 32 * 32;
  if (t < 32) t = 32;
  return static_cast<int>(t > max_threads ? max_threads : t);
}

}  // namespace loom::gpu
