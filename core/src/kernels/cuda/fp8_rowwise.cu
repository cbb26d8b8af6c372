// Per-row and per-column FP8 casts on the GPU (loom/ops/fp8_rowwise.hpp),
// bitwise the host reference: the same amax (NaN as +inf), scale
// (ops::rowwise_scale) and codes (fp8::encode, round to nearest even,
// saturating).
//   rowwise: one block per row: the row's amax, its scale, then its codes.
//   colwise: column amaxes max-accumulated into `scale` (atomicMax on the
//   float's bits, which order like the values for non-negative floats), the
//   scales in place, then the codes written transposed through a 32 x 32
//   shared tile, so that both the reads of x and the writes of q_t coalesce.
#include "kernels/cuda/cuda_common.cuh"
#include "loom/fp8.hpp"
#include "loom/ops/fp8_rowwise.hpp"

namespace loom::gpu {
namespace {

constexpr int kRowThreads = 256;
constexpr uint32_t kInfBits = 0x7F800000u;

__device__ __forceinline__ float abs_or_inf(float v) { return fp8::is_nan(v) ? __uint_as_float(kInfBits) : fabsf(v); }

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    rowwise_kernel(const T* __restrict__ x, int64_t cols, int64_t ldx, uint8_t* __restrict__ q, float* scale,
                   float* scale_inv, ops::RowwiseOptions o) {
  __shared__ float red[kRowThreads];
  const int64_t r = blockIdx.x;
  const T* row = x + r * ldx;
  float m = 0.0f;
  for (int64_t j = threadIdx.x; j < cols; j += kRowThreads) m = fmaxf(m, abs_or_inf(to_f32(row[j])));
  red[threadIdx.x] = m;
  __syncthreads();
  for (int h = kRowThreads / 2; h > 0; h /= 2) {
    if (threadIdx.x < h) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + h]);
    __syncthreads();
  }
  const float s = ops::rowwise_scale(red[0], o);
  if (threadIdx.x == 0) {
    scale[r] = s;
    scale_inv[r] = 1.0f / s;
  }
  uint8_t* qr = q + r * cols;
  for (int64_t j = threadIdx.x; j < cols; j += kRowThreads) qr[j] = fp8::encode(to_f32(row[j]) * s, o.format);
}

// grid (ceil(cols / 32), ceil(rows / 256)), block (32, 8).
template <typename T>
__global__ void colamax_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t ldx, float* amax) {
  __shared__ float red[8][32];
  const int64_t c = blockIdx.x * 32 + threadIdx.x;
  const int64_t r0 = blockIdx.y * 256;
  float m = 0.0f;
  if (c < cols)
    for (int64_t r = r0 + threadIdx.y; r < rows && r < r0 + 256; r += 8) m = fmaxf(m, abs_or_inf(to_f32(x[r * ldx + c])));
  red[threadIdx.y][threadIdx.x] = m;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    for (int i = 1; i < 8; ++i) m = fmaxf(m, red[i][threadIdx.x]);
    atomicMax(reinterpret_cast<unsigned int*>(amax + c), __float_as_uint(m));
  }
}

__global__ void colscale_kernel(float* scale, float* scale_inv, int64_t cols, ops::RowwiseOptions o) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  const float s = ops::rowwise_scale(scale[c], o);  // scale holds the amax until here
  scale[c] = s;
  scale_inv[c] = 1.0f / s;
}

// grid (ceil(cols / 32), ceil(rows / 32)), block (32, 8): q_t[c, r] = encode(x[r, c] * scale[c]).
template <typename T>
__global__ void coltrans_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t ldx,
                                uint8_t* __restrict__ qt, const float* __restrict__ scale, fp8::Format f) {
  __shared__ uint8_t tile[32][33];
  const int64_t c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
  const int64_t c = c0 + threadIdx.x;
  const float s = c < cols ? scale[c] : 1.0f;
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t r = r0 + i;
    if (r < rows && c < cols) tile[i][threadIdx.x] = fp8::encode(to_f32(x[r * ldx + c]) * s, f);
  }
  __syncthreads();
  const int64_t r = r0 + threadIdx.x;
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t cc = c0 + i;
    if (cc < cols && r < rows) qt[cc * rows + r] = tile[threadIdx.x][i];
  }
}

void check_args(const char* what, const Tensor& x, const Tensor& q, int64_t q_rows, int64_t q_cols, DType want,
                const float* scale, const float* scale_inv) {
  LOOM_CHECK(x.device == Device::cuda && x.data != nullptr && (x.dtype == DType::f32 || x.dtype == DType::bf16), what,
             ": x ", x.shape_str(), " must be a cuda fp32 or bf16 tensor with data, got ", dtype_name(x.dtype), " on ",
             device_name(x.device));
  LOOM_CHECK(q.device == Device::cuda && q.data != nullptr && q.dtype == want && q.is_contiguous() && q.ndim == 2 &&
                 q.shape[0] == q_rows && q.shape[1] == q_cols,
             what, ": the codes must be a contiguous cuda ", dtype_name(want), " [", q_rows, ", ", q_cols, "], got ",
             dtype_name(q.dtype), " ", q.shape_str(), " on ", device_name(q.device));
  LOOM_CHECK(scale != nullptr && scale_inv != nullptr, what, ": scale and scale_inv must be device floats, got ",
             static_cast<const void*>(scale), " and ", static_cast<const void*>(scale_inv));
}

}  // namespace

void fp8_cast_rowwise(const Tensor& x, Tensor& q, float* scale, float* scale_inv, const ops::RowwiseOptions& o,
                      void* stream_p) {
  const RowMatrix m = fold_rows(x, "fp8_cast_rowwise: x");
  check_args("fp8_cast_rowwise", x, q, m.rows, m.cols, fp8::dtype(o.format), scale, scale_inv);
  if (m.rows == 0 || m.cols == 0) return;
  auto stream = static_cast<cudaStream_t>(stream_p);
  auto* qp = static_cast<uint8_t*>(q.data);
  if (x.dtype == DType::f32)
    rowwise_kernel<float><<<static_cast<unsigned>(m.rows), kRowThreads, 0, stream>>>(
        static_cast<const float*>(x.data), m.cols, m.ld, qp, scale, scale_inv, o);
  else
    rowwise_kernel<bf16><<<static_cast<unsigned>(m.rows), kRowThreads, 0, stream>>>(
        static_cast<const bf16*>(x.data), m.cols, m.ld, qp, scale, scale_inv, o);
  LOOM_CUDA_LAUNCH_CHECK("fp8_cast_rowwise", "x ", x.shape_str(), " ", dtype_name(x.dtype));
}

void fp8_cast_colwise(const Tensor& x, Tensor& q_t, float* scale, float* scale_inv, const ops::RowwiseOptions& o,
                      void* stream_p) {
  const RowMatrix m = fold_rows(x, "fp8_cast_colwise: x");
  check_args("fp8_cast_colwise", x, q_t, m.cols, m.rows, fp8::dtype(o.format), scale, scale_inv);
  if (m.rows == 0 || m.cols == 0) return;
  auto stream = static_cast<cudaStream_t>(stream_p);
  LOOM_CUDA_CHECK(cudaMemsetAsync(scale, 0, static_cast<size_t>(m.cols) * sizeof(float), stream),
                  "fp8_cast_colwise: clear the ", m.cols, " column amaxes");
  const dim3 blk(32, 8);
  const dim3 g_amax(static_cast<unsigned>((m.cols + 31) / 32), static_cast<unsigned>((m.rows + 255) / 256));
  const dim3 g_tr(static_cast<unsigned>((m.cols + 31) / 32), static_cast<unsigned>((m.rows + 31) / 32));
  auto* qp = static_cast<uint8_t*>(q_t.data);
  if (x.dtype == DType::f32) {
    colamax_kernel<float><<<g_amax, blk, 0, stream>>>(static_cast<const float*>(x.data), m.rows, m.cols, m.ld, scale);
  } else {
    colamax_kernel<bf16><<<g_amax, blk, 0, stream>>>(static_cast<const bf16*>(x.data), m.rows, m.cols, m.ld, scale);
  }
  LOOM_CUDA_LAUNCH_CHECK("fp8_cast_colwise amax", "x ", x.shape_str());
  colscale_kernel<<<static_cast<unsigned>((m.cols + 255) / 256), 256, 0, stream>>>(scale, scale_inv, m.cols, o);
  LOOM_CUDA_LAUNCH_CHECK("fp8_cast_colwise scales", "cols ", m.cols);
  if (x.dtype == DType::f32)
    coltrans_kernel<float><<<g_tr, blk, 0, stream>>>(static_cast<const float*>(x.data), m.rows, m.cols, m.ld, qp,
                                                     scale, o.format);
  else
    coltrans_kernel<bf16><<<g_tr, blk, 0, stream>>>(static_cast<const bf16*>(x.data), m.rows, m.cols, m.ld, qp,
                                                    scale, o.format);
  LOOM_CUDA_LAUNCH_CHECK("fp8_cast_colwise codes", "x ", x.shape_str());
}

}  // namespace loom::gpu
