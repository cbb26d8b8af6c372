// Rotary position embedding on the GPU, HF Llama convention (rotate_half):
//   y_i = x_i c - x_{i+D/2} s,   y_{i+D/2} = x_{i+D/2} c + x_i s.
// cos/sin come from device tables [S, D/2] that the backend builds once per
// (S, D, theta) from cpu::rope_angle, so both backends rotate by exactly the
// same fp32 angles (HF's, see kernels/cpu/rope.cpp). Backward is the inverse
// rotation (sign = -1 negates sin). A row's position is its index s in the
// sequence, or the given positions[row] (restarting at document starts).
//
// One thread per (row, head, group of K pairs): it loads K elements of each
// half, K cosines and K sines, all packed when D/2, the row stride and the
// base pointer allow it. Rows (b, s) are x.stride[1] apart, which may exceed
// nh * D (the q and k heads of a packed qkv buffer, see rope_apply).
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.hpp"

namespace loom::gpu {
namespace {

template <int K, typename T>
__global__ void rope_kernel(T* x, const float* cos_table, const float* sin_table, const int32_t* positions,
                            int64_t rows, int64_t S, int64_t nh, int64_t D, int64_t row_stride, float sign) {
  const int64_t half = D / 2, groups = half / K;
  const int64_t total = rows * nh * groups;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
    const int64_t g = idx % groups, rh = idx / groups;
    const int64_t head = rh % nh, row = rh / nh;
    const int64_t pos = positions ? static_cast<int64_t>(positions[row]) : row % S, i = g * K;
    T* v = x + row * row_stride + head * D;
    float x1[K], x2[K], c[K], s[K], y1[K], y2[K];
    load_vec<K>(v + i, x1);
    load_vec<K>(v + i + half, x2);
    load_vec<K>(cos_table + pos * half + i, c);
    load_vec<K>(sin_table + pos * half + i, s);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const float sk = sign * s[k];
      y1[k] = x1[k] * c[k] - x2[k] * sk;
      y2[k] = x2[k] * c[k] + x1[k] * sk;
    }
    store_vec<K>(v + i, y1);
    store_vec<K>(v + i + half, y2);
  }
}

}  // namespace

void rope_apply(Tensor& x, const float* cos_table, const float* sin_table, int sign, cudaStream_t stream,
                const int32_t* positions) {
  check_device(x, "rope x");
  LOOM_CHECK(x.ndim == 4, "rope expects [B, S, nh, D], got ", x.shape_str());
  const int64_t B = x.shape[0], S = x.shape[1], nh = x.shape[2], D = x.shape[3], row_stride = x.stride[1];
  LOOM_CHECK(D > 0 && D % 2 == 0, "rope: head_dim must be even and positive, got D=", D);
  // The layout the CPU kernel assumes: heads contiguous inside a (b, s) row,
  // rows `row_stride` apart, batches S rows apart. The row stride may exceed
  // nh * D: the fused attention block rotates the q and k heads of a packed
  // [B, S, (H + 2 Hkv) D] qkv buffer as one [B, S, H + Hkv, D] view whose rows
  // are (H + 2 Hkv) D apart, leaving the v heads alone. A batch or head dim
  // of size 1 may carry any stride (it is never stepped over).
  LOOM_CHECK(x.stride[3] == 1 && (nh == 1 || x.stride[2] == D) && row_stride >= nh * D &&
                 (B == 1 || x.stride[0] == S * row_stride),
             "rope: unsupported strides for ", x.shape_str(), ": (", x.stride[0], ",", x.stride[1], ",", x.stride[2],
             ",", x.stride[3], ")");
  LOOM_CHECK(sign == 1 || sign == -1, "rope: sign must be +1 or -1, got ", sign);
  const int64_t rows = B * S;
  if (rows == 0 || nh == 0) return;
  dispatch_float(x.dtype, "rope", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const int64_t half = D / 2;
    // cos/sin tables come from cudaMalloc (256-byte aligned), rows half apart.
    const bool vec = half % K == 0 && row_stride % K == 0 && aligned_bytes(x.data, K * sizeof(T)) &&
                     aligned_bytes(cos_table, K * sizeof(float)) && aligned_bytes(sin_table, K * sizeof(float));
    const int64_t work = rows * nh * (vec ? half / K : half);
    const unsigned grid = grid_for(work, 256);
    if (vec)
      rope_kernel<K, T><<<grid, 256, 0, stream>>>(x.ptr<T>(), cos_table, sin_table, positions, rows, S, nh, D,
                                                  row_stride, static_cast<float>(sign));
    else
      rope_kernel<1, T><<<grid, 256, 0, stream>>>(x.ptr<T>(), cos_table, sin_table, positions, rows, S, nh, D,
                                                  row_stride, static_cast<float>(sign));
    LOOM_CUDA_LAUNCH_CHECK("rope_kernel", "B=", B, " S=", S, " nh=", nh, " D=", D, " row_stride=", row_stride,
                           " sign=", sign, " vectorised=", vec, " positions=", positions ? "given" : "s");
  });
}

}  // namespace loom::gpu
