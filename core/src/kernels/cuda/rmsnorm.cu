// RMSNorm (Llama) on the GPU: out = (x * rstd) * w, rstd = 1/sqrt(mean(x^2) + eps).
//
// Forward: one block per row, packed loads, fp32 sums through a fixed-shape
// block reduction. Given an amax, it also max-accumulates |v| of every value
// it stores (one atomicMax per row's block), the amax a current-scaling
// recipe's cast of the output would measure (Fp8OperandAmax).
// Backward: dw = sum over rows of dout * x * rstd is a column sum over N rows.
// Float atomics would make it order-dependent, so each block of the backward
// takes a chunk of consecutive rows: for each row it forms the row's dot
// product (block reduction), updates dx, and adds the row's dout * x * rstd
// into per-column sums held in registers (a thread owns the same columns in
// every row); at the end of the chunk it writes them to partial[chunk, :] in
// the backend's scratch (allocated once at backend creation, see
// cuda_backend.cpp). A second kernel adds each column's chunks in an order
// fixed by the chunk count and adds the total to dw. dout and x are read once
// for both dx and dw (a separate dw pass read them a second time: 2.2 ms a
// step on llama-1b). The chunk count depends on (N, h) only: bitwise
// reproducible. Rows wider than kMaxVecsPerThread packed vectors per thread,
// rows that cannot be packed, and fewer than 4096 rows take the general
// path: one block per row for dx, then blocks of (column tile, row chunk)
// for the partial sums.
//
// Forward into a linear's FP8 operand (rmsnorm_forward_fp8, loom/precision.hpp's
// Fp8Operand), two passes: the row kernel writes rstd alone (its own sums,
// so the same bits), then fp8_tile.cuh's 128 x 64 tiles read x, rstd and w,
// form each normalised value as the row kernel stores it (bf16) and encode it
// into q and its transposed copy. The bf16 output the cast would read is
// never written: 6 bytes an element move instead of 8. (One kernel doing both
// passes per 16 rows read x back from L2 but ran latency-bound, slower than
// the norm and the cast apart.)
#include <algorithm>
#include <cmath>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/cuda_kernels.hpp"
#include "kernels/cuda/fp8_tile.cuh"

namespace loom::gpu {
namespace {

constexpr int kRowThreads = 256;
constexpr int kDwWarps = 8;          // rows of a chunk are dealt to 8 warps
constexpr int64_t kMaxChunks = 256;  // row chunks of the dw reduction (general path)
constexpr int64_t kMinChunkRows = 16;
// The one-pass backward: its blocks (row chunks), and the fewest rows a chunk
// takes. With fewer than kMinFusedChunkRows * kMaxFusedChunks rows the
// general path's block per row spreads the work better: llama2-7b's 2048
// tokens ran 1.2 ms a step slower in 512 chunks of 4 rows (H100).
constexpr int64_t kMaxFusedChunks = 1024;
constexpr int64_t kMinFusedChunkRows = 4;
constexpr int kMaxVecsPerThread = 4;  // the one-pass backward keeps 3 * 4 * K floats a thread

// kOut = false: rstd only (the FP8 forward's first pass; the same sums, so the same bits).
// kAmax: also max |stored value| into *amax (one atomic per row's block).
template <int K, typename T, bool kOut = true, bool kAmax = false>
__global__ void rmsnorm_forward_kernel(T* out, float* rstd, const T* x, const T* w, int64_t h, float eps,
                                       float* amax) {
  __shared__ float red[32];
  const int64_t n = blockIdx.x;
  const T* xr = x + n * h;
  const int64_t step = static_cast<int64_t>(blockDim.x) * K;
  float ss = 0.f;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * K; j < h; j += step) {
    float v[K];
    load_vec<K>(xr + j, v);
#pragma unroll
    for (int k = 0; k < K; ++k) ss += v[k] * v[k];
  }
  ss = block_sum(ss, red);
  const float r = 1.0f / sqrtf(ss / static_cast<float>(h) + eps);
  if (threadIdx.x == 0) rstd[n] = r;
  if constexpr (!kOut) return;
  T* o = out + n * h;
  uint32_t m = 0;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * K; j < h; j += step) {
    float v[K], wv[K], y[K];
    load_vec<K>(xr + j, v);
    load_vec<K>(w + j, wv);
    // HF order: (x * rstd) rounded to the activation type, then times w.
#pragma unroll
    for (int k = 0; k < K; ++k) y[k] = to_f32(from_f32<T>(v[k] * r)) * wv[k];
    store_vec<K>(o + j, y);
    fp8_tile::amax_add_stored<T, kAmax>(m, y);
  }
  if constexpr (kAmax) fp8_tile::block_amax_to(fp8_tile::amax_value(m), amax);
}

// dx += r w dy - r^3 x / h * sum_j dy_j w_j x_j   (see kernels/cpu/rmsnorm.cpp)
template <int K, typename T>
__global__ void rmsnorm_backward_dx_kernel(T* dx, const T* dout, const T* x, const T* w, const float* rstd,
                                           int64_t h) {
  __shared__ float red[32];
  const int64_t n = blockIdx.x;
  const T* xr = x + n * h;
  const T* dy = dout + n * h;
  const int64_t step = static_cast<int64_t>(blockDim.x) * K;
  float dot = 0.f;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * K; j < h; j += step) {
    float a[K], b[K], c[K];
    load_vec<K>(dy + j, a);
    load_vec<K>(w + j, b);
    load_vec<K>(xr + j, c);
#pragma unroll
    for (int k = 0; k < K; ++k) dot += a[k] * b[k] * c[k];
  }
  dot = block_sum(dot, red);
  const float r = rstd[n];
  const float c = r * r * r * dot / static_cast<float>(h);
  T* d = dx + n * h;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * K; j < h; j += step) {
    float a[K], b[K], xv[K], cur[K];
    load_vec<K>(dy + j, a);
    load_vec<K>(w + j, b);
    load_vec<K>(xr + j, xv);
    load_vec<K>(d + j, cur);
#pragma unroll
    for (int k = 0; k < K; ++k) cur[k] += r * b[k] * a[k] - c * xv[k];
    store_vec<K>(d + j, cur);
  }
}

// R sums of a block at once, each reduced as block_sum reduces one (the
// same shuffles and the same warp order, so the same bits): one round of
// barriers for R rows.
template <int R>
__device__ void block_sum_rows(float (&v)[R], float (*red)[32]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
#pragma unroll
  for (int r = 0; r < R; ++r) v[r] = warp_sum(v[r]);
  __syncthreads();  // earlier users of `red` are done
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) red[r][warp] = v[r];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s = lane < nwarps ? red[r][lane] : 0.f;
      s = warp_sum(s);
      if (lane == 0) red[r][0] = s;
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < R; ++r) v[r] = red[r][0];
}

// The FP8 forward's second pass (see the top of the file): fp8_tile.cuh's
// 128 x 64 tiles of [rows, h], grid-stride; a thread's 4 rows x 8 columns
// lie wholly inside or outside (rows % 16 == 0, h % 16 == 0). Each value is
// the row kernel's stored one: (x * rstd) rounded to bf16, times w, rounded
// to bf16.
template <fp8::Format F>
__global__ void __launch_bounds__(fp8_tile::kThreads)
    rmsnorm_fp8_kernel(uint8_t* __restrict__ q, uint8_t* __restrict__ qt, const float* __restrict__ rstd,
                       const bf16* __restrict__ x, const bf16* __restrict__ w, int64_t rows, int64_t h,
                       int64_t tiles_c, int64_t tiles, const float* __restrict__ scale_ptr, float* amax) {
  __shared__ fp8_tile::Shared sh;
  const float s = *scale_ptr;
  const fp8_tile::Lane ln = fp8_tile::lane();
  uint32_t m = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const fp8_tile::TilePos p = fp8_tile::tile_pos(t, tiles_c, ln, rows, h);
    const int64_t r = p.r, c = p.c;
    uint32_t wc[4][2] = {};
    if (p.live) {
      float wv[8], v[4][8];
#pragma unroll
      for (int i = 0; i < 4; ++i) load_vec<8>(x + (r + i) * h + c, v[i]);
      load_vec<8>(w + c, wv);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float ri = rstd[r + i];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          v[i][k] = __bfloat162float(__float2bfloat16_rn(__bfloat162float(__float2bfloat16_rn(v[i][k] * ri)) * wv[k]));
          fp8_tile::amax_add(m, v[i][k]);
        }
      }
      fp8_tile::encode<F>(v, s, wc);
      if (q != nullptr) fp8_tile::store_rows(q + r * h + c, h, wc);
    }
    fp8_tile::store_transposed<true>(sh, ln, wc, qt + p.c0 * rows + p.r0, rows, rows - p.r0, h - p.c0);
  }
  if (amax != nullptr) fp8_tile::block_amax_to(fp8_tile::amax_value(m), amax);
}

// The one-pass backward (see the top of the file): block b takes rows
// [b * chunk_rows, (b + 1) * chunk_rows), R at a time (twice the loads in
// flight for narrow rows, one round of barriers for R rows); thread t owns
// the packed vectors at columns (t + v * blockDim.x) * K, v < V. Per row, dx
// as rmsnorm_backward_dx_kernel computes it (same sums in the same order, so
// the same bits), and dw's terms added row after row into acc.
template <int K, int V, int R, typename T>
__global__ void rmsnorm_backward_kernel(T* dx, float* partial, const T* dout, const T* x, const T* w,
                                        const float* rstd, int64_t N, int64_t h, int64_t chunk_rows) {
  __shared__ float red[R][32];
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * chunk_rows;
  const int64_t n1 = n0 + chunk_rows < N ? n0 + chunk_rows : N;
  int64_t col[V];
  bool in[V];
  float wv[V][K], acc[V][K];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    col[v] = (static_cast<int64_t>(threadIdx.x) + static_cast<int64_t>(v) * blockDim.x) * K;
    in[v] = col[v] < h;
#pragma unroll
    for (int k = 0; k < K; ++k) acc[v][k] = wv[v][k] = 0.f;
    if (in[v]) load_vec<K>(w + col[v], wv[v]);
  }
  for (int64_t n = n0; n < n1; n += R) {
    float a[R][V][K], xv[R][V][K], dot[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      dot[r] = 0.f;
      if (n + r >= n1) continue;  // block-uniform: the chunk's last rows
#pragma unroll
      for (int v = 0; v < V; ++v) {
        if (!in[v]) continue;
        load_vec<K>(dout + (n + r) * h + col[v], a[r][v]);
        load_vec<K>(x + (n + r) * h + col[v], xv[r][v]);
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (n + r >= n1) continue;
#pragma unroll
      for (int v = 0; v < V; ++v) {
        if (!in[v]) continue;
#pragma unroll
        for (int k = 0; k < K; ++k) dot[r] += a[r][v][k] * wv[v][k] * xv[r][v][k];
      }
    }
    block_sum_rows<R>(dot, red);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (n + r >= n1) continue;
      const float rs = rstd[n + r];
      const float c = rs * rs * rs * dot[r] / static_cast<float>(h);
      T* d = dx + (n + r) * h;
#pragma unroll
      for (int v = 0; v < V; ++v) {
        if (!in[v]) continue;
        float cur[K];
        load_vec<K>(d + col[v], cur);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          cur[k] += rs * wv[v][k] * a[r][v][k] - c * xv[r][v][k];
          acc[v][k] += a[r][v][k] * xv[r][v][k] * rs;
        }
        store_vec<K>(d + col[v], cur);
      }
    }
  }
  float* out = partial + static_cast<int64_t>(blockIdx.x) * h;
#pragma unroll
  for (int v = 0; v < V; ++v)
    if (in[v]) {
#pragma unroll
      for (int k = 0; k < K; ++k) out[col[v] + k] = acc[v][k];
    }
}

// blockIdx.x: a tile of 32 * K columns (lane l owns K adjacent columns, so a
// warp reads 32 * K contiguous elements of a row); blockIdx.y: a chunk of
// rows, dealt round-robin to the 8 warps. Warp sums are combined in warp
// order and written to partial[chunk, column].
template <int K, typename T>
__global__ void __launch_bounds__(kDwWarps * 32) rmsnorm_dw_partial_kernel(float* partial, const T* dout,
                                                                          const T* x, const float* rstd, int64_t N,
                                                                          int64_t h, int64_t chunk_rows) {
  __shared__ float red[kDwWarps][32 * K];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * 32 * K;
  const int64_t j = col0 + static_cast<int64_t>(lane) * K;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * chunk_rows;
  const int64_t n1 = n0 + chunk_rows < N ? n0 + chunk_rows : N;
  float acc[K];
#pragma unroll
  for (int k = 0; k < K; ++k) acc[k] = 0.f;
  if (j < h) {  // h % K == 0 on the packed path, so the whole group is inside
    for (int64_t n = n0 + warp; n < n1; n += kDwWarps) {
      float dy[K], xv[K];
      load_vec<K>(dout + n * h + j, dy);
      load_vec<K>(x + n * h + j, xv);
      const float r = rstd[n];
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] += dy[k] * xv[k] * r;
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) red[warp][lane * K + k] = acc[k];
  __syncthreads();
  for (int c = threadIdx.x; c < 32 * K; c += blockDim.x) {
    float s = 0.f;
#pragma unroll
    for (int wp = 0; wp < kDwWarps; ++wp) s += red[wp][c];
    if (col0 + c < h) partial[static_cast<int64_t>(blockIdx.y) * h + col0 + c] = s;
  }
}

// dw[j] += sum over chunks c of partial[c, j], for 32 columns per block: warp
// w adds the chunks c = w, w + 32, w + 64, ... of its lane's column (four
// loads in flight per thread; 32 warps, because a model of hidden size 768
// has only 24 such blocks and each would otherwise walk hundreds of chunks
// one round trip after another), then the 32 warp sums are added in warp
// order. The order is fixed by `chunks` alone: deterministic.
constexpr int kFinishWarps = 32;
template <typename TG>
__global__ void __launch_bounds__(kFinishWarps * 32) rmsnorm_dw_finish_kernel(TG* dw, const float* partial,
                                                                             int64_t chunks, int64_t h) {
  __shared__ float red[kFinishWarps][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  if (j < h) {
    int64_t c = warp;
    for (; c + 3 * kFinishWarps < chunks; c += 4 * kFinishWarps) {
#pragma unroll
      for (int u = 0; u < 4; ++u) s[u] += partial[(c + u * kFinishWarps) * h + j];
    }
    for (; c < chunks; c += kFinishWarps) s[0] += partial[c * h + j];
  }
  red[warp][lane] = (s[0] + s[1]) + (s[2] + s[3]);
  __syncthreads();
  if (warp == 0 && j < h) {
    float t = 0.f;
#pragma unroll
    for (int wp = 0; wp < kFinishWarps; ++wp) t += red[wp][lane];
    dw[j] = from_f32<TG>(to_f32(dw[j]) + t);
  }
}

}  // namespace

void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& x, const Tensor& w, float eps, cudaStream_t stream,
                     float* amax) {
  check_device(out, "rmsnorm out");
  check_device(rstd, "rstd");
  check_device(x, "rmsnorm x");
  check_device(w, "rmsnorm w");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&out, &rstd, &x, &w}) check_contiguous(*t, "rmsnorm_forward");
  LOOM_CHECK(rstd.dtype == DType::f32, "rstd must be fp32, got ", dtype_name(rstd.dtype));
  LOOM_CHECK(out.dtype == x.dtype && w.dtype == x.dtype, "rmsnorm_forward: out ", dtype_name(out.dtype), ", x ",
             dtype_name(x.dtype), ", w ", dtype_name(w.dtype), " must share one dtype");
  const int64_t h = w.numel();
  LOOM_CHECK(h > 0 && x.numel() % h == 0, "rmsnorm: x ", x.shape_str(), " is not rows of w's ", h, " elements");
  const int64_t N = x.numel() / h;
  LOOM_CHECK(out.numel() == x.numel() && rstd.numel() == N, "rmsnorm_forward: out ", out.shape_str(), " rstd ",
             rstd.shape_str(), " do not match x ", x.shape_str());
  LOOM_CHECK(amax == nullptr || aligned_bytes(amax, 4), "rmsnorm_forward: amax at ", static_cast<const void*>(amax),
             " is not a device float");
  if (N == 0) return;
  LOOM_CHECK(N <= 0x7fffffff, "rmsnorm: ", N, " rows exceed the grid limit");
  dispatch_float(x.dtype, "rmsnorm_forward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int K = vec_width<T>();
    const size_t a = K * sizeof(T);
    const bool vec = h % K == 0 && aligned_bytes(out.data, a) && aligned_bytes(x.data, a) && aligned_bytes(w.data, a);
    const int threads = row_threads(vec ? h / K : h, kRowThreads);
    auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(N), threads, 0, stream>>>(out.ptr<T>(), rstd.ptr<float>(), x.ptr<T>(),
                                                               w.ptr<T>(), h, eps, amax);
    };
    if (amax != nullptr)
      launch(vec ? rmsnorm_forward_kernel<K, T, true, true> : rmsnorm_forward_kernel<1, T, true, true>);
    else
      launch(vec ? rmsnorm_forward_kernel<K, T> : rmsnorm_forward_kernel<1, T>);
    LOOM_CUDA_LAUNCH_CHECK("rmsnorm_forward_kernel", "N=", N, " h=", h, " threads=", threads, " vectorised=", vec,
                           " amax=", amax != nullptr);
  });
}

void rmsnorm_backward(Tensor& dx, Tensor& dw, const Tensor& dout, const Tensor& x, const Tensor& w,
                      const Tensor& rstd, const Scratch& scratch, cudaStream_t stream) {
  check_device(dx, "rmsnorm dx");
  check_device(dw, "rmsnorm dw");
  check_device(dout, "rmsnorm dout");
  check_device(x, "rmsnorm x");
  check_device(w, "rmsnorm w");
  check_device(rstd, "rstd");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dx, &dw, &dout, &x, &w, &rstd}) check_contiguous(*t, "rmsnorm_backward");
  LOOM_CHECK(rstd.dtype == DType::f32, "rstd must be fp32, got ", dtype_name(rstd.dtype));
  LOOM_CHECK(dx.dtype == x.dtype && dout.dtype == x.dtype && w.dtype == x.dtype, "rmsnorm_backward: dx ",
             dtype_name(dx.dtype), ", dout ", dtype_name(dout.dtype), ", x ", dtype_name(x.dtype), ", w ",
             dtype_name(w.dtype), " must share one dtype");
  const int64_t h = w.numel();
  LOOM_CHECK(h > 0 && x.numel() % h == 0, "rmsnorm: x ", x.shape_str(), " is not rows of w's ", h, " elements");
  const int64_t N = x.numel() / h;
  LOOM_CHECK(dx.numel() == x.numel() && dout.numel() == x.numel() && rstd.numel() == N && dw.numel() == h,
             "rmsnorm_backward shapes: dx ", dx.shape_str(), " dout ", dout.shape_str(), " x ", x.shape_str(),
             " rstd ", rstd.shape_str(), " dw ", dw.shape_str());
  if (N == 0) return;
  LOOM_CHECK(N <= 0x7fffffff, "rmsnorm: ", N, " rows exceed the grid limit");

  // Row chunks for dw, whose partials [chunks, h] must fit in the scratch.
  const int64_t scratch_floats = static_cast<int64_t>(scratch.bytes / sizeof(float));
  LOOM_CHECK(h <= scratch_floats, "rmsnorm_backward: hidden size ", h, " needs more than the backend's ",
             scratch.bytes, "-byte scratch");
  int64_t chunks = 0, chunk_rows = 0;
  auto set_chunks = [&](int64_t min_rows, int64_t max_chunks) {
    chunks = (N + min_rows - 1) / min_rows;
    if (chunks > max_chunks) chunks = max_chunks;
    if (chunks > scratch_floats / h) chunks = scratch_floats / h;
    chunk_rows = (N + chunks - 1) / chunks;
    chunks = (N + chunk_rows - 1) / chunk_rows;
  };
  float* partial = static_cast<float*>(scratch.ptr);

  dispatch_act_grad(x.dtype, dw.dtype, "rmsnorm_backward", [&](auto ta, auto tg) {
    using T = decltype(ta);
    using TG = decltype(tg);
    constexpr int K = vec_width<T>();
    const size_t a = K * sizeof(T);
    const bool vec = h % K == 0 && aligned_bytes(dx.data, a) && aligned_bytes(dout.data, a) &&
                     aligned_bytes(x.data, a) && aligned_bytes(w.data, a);
    const int threads = row_threads(vec ? h / K : h, kRowThreads);
    const int64_t vecs_per_thread = vec ? (h / K + threads - 1) / threads : kMaxVecsPerThread + 1;
    if (vecs_per_thread <= kMaxVecsPerThread && N >= kMinFusedChunkRows * kMaxFusedChunks) {
      // One pass: a block per row chunk, dx and the chunk's dw partials
      // together, in kMaxFusedChunks blocks of at least kMinFusedChunkRows rows
      // (the partials' write and read then cost at most 1/8 of the rows'
      // traffic; 1/32 at 16 rows, llama-1b's 16384 tokens).
      set_chunks((N + kMaxFusedChunks - 1) / kMaxFusedChunks, kMaxFusedChunks);
      auto launch = [&](auto kernel) {
        kernel<<<static_cast<unsigned>(chunks), threads, 0, stream>>>(dx.ptr<T>(), partial, dout.ptr<T>(), x.ptr<T>(),
                                                                   w.ptr<T>(), rstd.ptr<float>(), N, h, chunk_rows);
      };
      switch (vecs_per_thread) {
        case 1: launch(rmsnorm_backward_kernel<K, 1, 2, T>); break;  // two rows at a time
        case 2: launch(rmsnorm_backward_kernel<K, 2, 1, T>); break;  // one: the registers of 2 rows x 2+ vectors
        case 3: launch(rmsnorm_backward_kernel<K, 3, 1, T>); break;
        default: launch(rmsnorm_backward_kernel<K, 4, 1, T>); break;
      }
      LOOM_CUDA_LAUNCH_CHECK("rmsnorm_backward_kernel", "N=", N, " h=", h, " threads=", threads, " chunks=", chunks,
                             " chunk_rows=", chunk_rows, " vectors per thread=", vecs_per_thread);
    } else {
      set_chunks(kMinChunkRows, kMaxChunks);
      if (vec)
        rmsnorm_backward_dx_kernel<K, T><<<static_cast<unsigned>(N), threads, 0, stream>>>(
            dx.ptr<T>(), dout.ptr<T>(), x.ptr<T>(), w.ptr<T>(), rstd.ptr<float>(), h);
      else
        rmsnorm_backward_dx_kernel<1, T><<<static_cast<unsigned>(N), threads, 0, stream>>>(
            dx.ptr<T>(), dout.ptr<T>(), x.ptr<T>(), w.ptr<T>(), rstd.ptr<float>(), h);
      LOOM_CUDA_LAUNCH_CHECK("rmsnorm_backward_dx_kernel", "N=", N, " h=", h, " threads=", threads,
                             " vectorised=", vec);

      const int64_t tile = (vec ? K : 1) * 32;
      const dim3 grid(static_cast<unsigned>((h + tile - 1) / tile), static_cast<unsigned>(chunks));
      if (vec)
        rmsnorm_dw_partial_kernel<K, T><<<grid, kDwWarps * 32, 0, stream>>>(partial, dout.ptr<T>(), x.ptr<T>(),
                                                                            rstd.ptr<float>(), N, h, chunk_rows);
      else
        rmsnorm_dw_partial_kernel<1, T><<<grid, kDwWarps * 32, 0, stream>>>(partial, dout.ptr<T>(), x.ptr<T>(),
                                                                            rstd.ptr<float>(), N, h, chunk_rows);
      LOOM_CUDA_LAUNCH_CHECK("rmsnorm_dw_partial_kernel", "N=", N, " h=", h, " grid=(", grid.x, ",", grid.y,
                             ") chunk_rows=", chunk_rows, " vectorised=", vec);
    }
    const unsigned fin_blocks = static_cast<unsigned>((h + 31) / 32);
    rmsnorm_dw_finish_kernel<TG><<<fin_blocks, kFinishWarps * 32, 0, stream>>>(dw.ptr<TG>(), partial, chunks, h);
    LOOM_CUDA_LAUNCH_CHECK("rmsnorm_dw_finish_kernel", "h=", h, " chunks=", chunks, " blocks=", fin_blocks);
  });
}

void rmsnorm_forward_fp8(const Tensor& q, const Tensor& q_t, Tensor& rstd, const Tensor& x, const Tensor& w, float eps,
                         const float* scale, float* amax, cudaStream_t stream) {
  const char* fn = "rmsnorm_forward_fp8";
  check_device(rstd, "rmsnorm_forward_fp8 rstd");
  check_device(x, "rmsnorm_forward_fp8 x");
  check_device(w, "rmsnorm_forward_fp8 w");
  for (const Tensor* t : std::initializer_list<const Tensor*>{&rstd, &x, &w}) check_contiguous(*t, fn);
  LOOM_CHECK(x.dtype == DType::bf16 && w.dtype == DType::bf16, fn, ": x and w must be bf16 (the FP8 recipes' "
             "activations and parameters), got ", dtype_name(x.dtype), " and ", dtype_name(w.dtype));
  LOOM_CHECK(rstd.dtype == DType::f32, fn, ": rstd must be fp32, got ", dtype_name(rstd.dtype));
  const int64_t h = w.numel();
  LOOM_CHECK(h > 0 && x.numel() % h == 0, fn, ": x ", x.shape_str(), " is not rows of w's ", h, " elements");
  const int64_t N = x.numel() / h;
  LOOM_CHECK(N % 16 == 0 && h % 16 == 0, fn, ": [", N, ", ", h,
             "]: rows and h must be multiples of 16 (the FP8 GEMMs' own multiple)");
  LOOM_CHECK(aligned_bytes(x.data, 16) && aligned_bytes(w.data, 16), fn, ": x at ", x.data, " and w at ", w.data,
             " must be 16-byte aligned");
  LOOM_CHECK(rstd.numel() == N, fn, ": rstd ", rstd.shape_str(), " must hold one value per row (", N, ")");
  fp8_tile::check_fp8_dest(fn, q, q_t, N, h, scale, amax);
  if (N == 0) return;
  LOOM_CHECK(N <= 0x7fffffff, fn, ": ", N, " rows exceed the grid limit");
  // Pass 1: rstd from the row kernel's own sums (its packed path, as
  // rmsnorm_forward takes it for these aligned rows).
  const int threads = row_threads(h / 8, kRowThreads);
  rmsnorm_forward_kernel<8, bf16, false><<<static_cast<unsigned>(N), threads, 0, stream>>>(
      nullptr, rstd.ptr<float>(), x.ptr<const bf16>(), w.ptr<const bf16>(), h, eps, nullptr);
  LOOM_CUDA_LAUNCH_CHECK(fn, " (rstd) N=", N, " h=", h, " threads=", threads);
  // Pass 2: the normalised values into q and q_t.
  const int64_t tiles_c = (h + fp8_tile::kCols - 1) / fp8_tile::kCols;
  const int64_t tiles = (N + fp8_tile::kRows - 1) / fp8_tile::kRows * tiles_c;
  const bool e4 = q_t.dtype == DType::e4m3;
  const unsigned grid = fp8_tile::grid_for_tiles(
      tiles,
      e4 ? fp8_tile::blocks_per_sm<rmsnorm_fp8_kernel<fp8::Format::e4m3>>(fn)
         : fp8_tile::blocks_per_sm<rmsnorm_fp8_kernel<fp8::Format::e5m2>>(fn),
      fn);
  if (e4)
    rmsnorm_fp8_kernel<fp8::Format::e4m3><<<grid, fp8_tile::kThreads, 0, stream>>>(
        static_cast<uint8_t*>(q.data), q_t.ptr<uint8_t>(), rstd.ptr<const float>(), x.ptr<const bf16>(),
        w.ptr<const bf16>(), N, h, tiles_c, tiles, scale, amax);
  else
    rmsnorm_fp8_kernel<fp8::Format::e5m2><<<grid, fp8_tile::kThreads, 0, stream>>>(
        static_cast<uint8_t*>(q.data), q_t.ptr<uint8_t>(), rstd.ptr<const float>(), x.ptr<const bf16>(),
        w.ptr<const bf16>(), N, h, tiles_c, tiles, scale, amax);
  LOOM_CUDA_LAUNCH_CHECK(fn, " (codes) N=", N, " h=", h, " tiles=", tiles, " grid=", grid);
}

}  // namespace loom::gpu
