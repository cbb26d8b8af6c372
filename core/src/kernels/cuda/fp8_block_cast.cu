// Fine-grained FP8 casts on the GPU (fp8_block_kernels.hpp). Codes come from
// loom::fp8::encode_fast (bitwise encode), scales from
// loom::fp8::block::tile_scale, layouts from loom::fp8::block::scale_index:
// the same functions as the host reference.
//
// rows kernel:   one warp per 1x128 tile; a lane holds 4 consecutive values,
//                the warp max gives the tile amax, each lane stores 4 codes
//                (one 32-bit store) and lane 0 the scale inverse.
// cols kernel:   a block of 256 threads per 128 x 32 chunk of x, staged in
//                shared memory (coalesced reads along the row); a warp takes
//                4 columns, one 128-row tile each, lane l holding rows
//                l, l+32, l+64, l+96 (conflict-free with the odd row stride),
//                and stores the codes as row c of q_t.
// blocks kernel: a block of 256 threads per 128x128 block: one pass for the
//                amax (block max), a second that encodes, stores q row by row
//                and the codes in a shared tile, from which q_t's rows are
//                stored. The weight cast runs once per optimizer step.
#include <cfloat>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/fp8_block_kernels.hpp"
#include "loom/fp8.hpp"
#include "loom/fp8_block.hpp"

namespace loom::gpu {
namespace {

namespace blk = fp8::block;
constexpr int kThreads = 256;
constexpr int kColChunk = 32;  // columns of x per block in the cols kernel

__device__ __forceinline__ float abs_or_inf(float v) {
  return fp8::is_nan(v) ? __uint_as_float(0x7F800000u) : fabsf(v);
}

__device__ __forceinline__ uint8_t enc(float v, float s) { return fp8::encode_fast(v * s, fp8::Format::e4m3); }

template <typename T>
__global__ void __launch_bounds__(kThreads)
    rows_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t ldx, uint8_t* __restrict__ q,
                float* __restrict__ scale_inv, uint32_t* nonfinite) {
  const int lane = threadIdx.x % 32;
  const int64_t kb_n = cols / blk::kBlock, tiles = rows * kb_n;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; t < tiles; t += warps) {
    const int64_t r = t / kb_n, kb = t % kb_n;
    const int64_t c = kb * blk::kBlock + lane * 4;
    float v[4];
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[j] = to_f32(x[r * ldx + c + j]);
      m = fmaxf(m, abs_or_inf(v[j]));
    }
    m = warp_max(m);
    const blk::TileScale s = blk::tile_scale(m);
    uint32_t w = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) w |= static_cast<uint32_t>(enc(v[j], s.scale)) << (8 * j);
    *reinterpret_cast<uint32_t*>(q + r * cols + c) = w;
    if (lane == 0) {
      scale_inv[blk::scale_index(blk::ScaleMode::tile_1x128, r, kb, rows, cols)] = s.scale_inv;
      if (s.nonfinite && nonfinite != nullptr) atomicAdd(nonfinite, 1u);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    cols_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t ldx, uint8_t* __restrict__ qt,
                float* __restrict__ scale_inv_t, uint32_t* nonfinite) {
  __shared__ float sm[blk::kBlock][kColChunk + 1];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t cc_n = cols / kColChunk, chunks = (rows / blk::kBlock) * cc_n;
  for (int64_t ch = blockIdx.x; ch < chunks; ch += gridDim.x) {
    const int64_t rb = ch / cc_n, c0 = (ch % cc_n) * kColChunk, r0 = rb * blk::kBlock;
    for (int i = threadIdx.x / kColChunk; i < blk::kBlock; i += kThreads / kColChunk)
      sm[i][threadIdx.x % kColChunk] = to_f32(x[(r0 + i) * ldx + c0 + threadIdx.x % kColChunk]);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kColChunk / 8; ++k) {
      const int cl = warp * (kColChunk / 8) + k;
      const int64_t c = c0 + cl;
      float v[4];
      float m = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[j] = sm[lane + 32 * j][cl];
        m = fmaxf(m, abs_or_inf(v[j]));
      }
      m = warp_max(m);
      const blk::TileScale s = blk::tile_scale(m);
#pragma unroll
      for (int j = 0; j < 4; ++j) qt[c * rows + r0 + lane + 32 * j] = enc(v[j], s.scale);
      if (lane == 0) {
        // The transposed operand [cols, rows]: row c, k block rb.
        scale_inv_t[blk::scale_index(blk::ScaleMode::tile_1x128, c, rb, cols, rows)] = s.scale_inv;
        if (s.nonfinite && nonfinite != nullptr) atomicAdd(nonfinite, 1u);
      }
    }
    __syncthreads();  // the next chunk overwrites sm
  }
}

constexpr int kTileStride = blk::kBlock + 4;  // bytes per shared code row

template <typename T>
__global__ void __launch_bounds__(kThreads)
    blocks_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t ldx, uint8_t* __restrict__ q,
                  uint8_t* __restrict__ qt, float* __restrict__ scale_inv, float* __restrict__ scale_inv_t,
                  uint32_t* nonfinite) {
  __shared__ uint32_t tile_words[blk::kBlock * kTileStride / 4];
  __shared__ float part[kThreads / 32];
  uint8_t* tile = reinterpret_cast<uint8_t*>(tile_words);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t cb_n = cols / blk::kBlock, blocks = (rows / blk::kBlock) * cb_n;
  const int cl = lane * 4;  // this thread's 4 columns; its rows: warp + 8 i
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t rb = b / cb_n, cb = b % cb_n, r0 = rb * blk::kBlock, c0 = cb * blk::kBlock;
    float m = 0.0f;
    for (int i = warp; i < blk::kBlock; i += kThreads / 32)
#pragma unroll
      for (int j = 0; j < 4; ++j) m = fmaxf(m, abs_or_inf(to_f32(x[(r0 + i) * ldx + c0 + cl + j])));
    m = warp_max(m);
    if (lane == 0) part[warp] = m;
    __syncthreads();
    m = part[0];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, part[w]);
    const blk::TileScale s = blk::tile_scale(m);
    for (int i = warp; i < blk::kBlock; i += kThreads / 32) {
      uint32_t word = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        word |= static_cast<uint32_t>(enc(to_f32(x[(r0 + i) * ldx + c0 + cl + j]), s.scale)) << (8 * j);
      if (q != nullptr) *reinterpret_cast<uint32_t*>(q + (r0 + i) * cols + c0 + cl) = word;
      tile_words[(i * kTileStride + cl) / 4] = word;
    }
    __syncthreads();
    if (qt != nullptr) {
      // Row c0 + c of q_t, x rows [r0 + h * 64, + 64): 16 words of 4 rows each.
      const int c = threadIdx.x / 2, h = threadIdx.x % 2;
      uint32_t* dst = reinterpret_cast<uint32_t*>(qt + (c0 + c) * rows + r0 + h * 64);
#pragma unroll
      for (int k = 0; k < 16; ++k) {
        const int r = h * 64 + 4 * k;
        dst[k] = static_cast<uint32_t>(tile[r * kTileStride + c]) |
                 (static_cast<uint32_t>(tile[(r + 1) * kTileStride + c]) << 8) |
                 (static_cast<uint32_t>(tile[(r + 2) * kTileStride + c]) << 16) |
                 (static_cast<uint32_t>(tile[(r + 3) * kTileStride + c]) << 24);
      }
    }
    if (threadIdx.x == 0) {
      if (scale_inv != nullptr)
        scale_inv[blk::scale_index(blk::ScaleMode::block_128x128, rb, cb, rows, cols)] = s.scale_inv;
      if (scale_inv_t != nullptr)
        scale_inv_t[blk::scale_index(blk::ScaleMode::block_128x128, cb, rb, cols, rows)] = s.scale_inv;
      if (s.nonfinite && nonfinite != nullptr) atomicAdd(nonfinite, 1u);
    }
    __syncthreads();  // part[] and the tile are reused by the next block
  }
}

RowMatrix input(const Tensor& x, const char* fn) {
  check_device(x, fn);
  LOOM_CHECK(x.dtype == DType::f32 || x.dtype == DType::bf16, fn, ": x must be fp32 or bf16, got ",
             dtype_name(x.dtype), " ", x.shape_str());
  const RowMatrix m = fold_rows(x, fn, ": x");
  LOOM_CHECK(m.rows % blk::kBlock == 0 && m.cols % blk::kBlock == 0, fn, ": x ", x.shape_str(), " is [", m.rows,
             ", ", m.cols, "] as a matrix; fine-grained FP8 scaling needs both dims to be multiples of ",
             blk::kBlock);
  return m;
}

void output(const Tensor& q, int64_t rows, int64_t cols, const char* fn, const char* what) {
  check_device(q, fn);
  LOOM_CHECK(q.dtype == DType::e4m3, fn, ": ", what, " must be fp8_e4m3 (fine-grained scaling is E4M3), got ",
             dtype_name(q.dtype));
  LOOM_CHECK(q.ndim == 2 && q.shape[0] == rows && q.shape[1] == cols && q.is_contiguous(), fn, ": ", what,
             " must be a contiguous [", rows, ", ", cols, "] tensor, got ", q.shape_str());
  LOOM_CHECK(aligned_bytes(q.data, 16), fn, ": ", what, " at ", q.data, " is not 16-byte aligned");
}

void scales(const float* p, const char* fn, const char* what) {
  LOOM_CHECK(p != nullptr && aligned_bytes(p, 16), fn, ": ", what, " at ", static_cast<const void*>(p),
             " must be a 16-byte aligned device float array (cuBLASLt reads it as a block-scale tensor)");
}

void counter(const uint32_t* p, const char* fn) {
  LOOM_CHECK(aligned_bytes(p, 4), fn, ": the non-finite counter at ", static_cast<const void*>(p),
             " is not 4-byte aligned");
}

}  // namespace

void fp8_block_cast_rows(const Tensor& x, Tensor& q, float* scale_inv, uint32_t* nonfinite, cudaStream_t stream) {
  const char* fn = "fp8_block_cast_rows";
  const RowMatrix m = input(x, fn);
  output(q, m.rows, m.cols, fn, "q");
  scales(scale_inv, fn, "scale_inv");
  counter(nonfinite, fn);
  if (m.rows == 0) return;
  const int64_t tiles = m.rows * (m.cols / blk::kBlock);
  const unsigned grid = grid_for(tiles * 32, kThreads);
  dispatch_float(x.dtype, fn, [&](auto tx) {
    using T = decltype(tx);
    rows_kernel<T><<<grid, kThreads, 0, stream>>>(x.ptr<const T>(), m.rows, m.cols, m.ld, q.ptr<uint8_t>(),
                                                  scale_inv, nonfinite);
    LOOM_CUDA_LAUNCH_CHECK("fp8_block rows_kernel", "x [", m.rows, ", ", m.cols, "] ld ", m.ld, " ",
                           dtype_name(x.dtype), ", grid ", grid, " x ", kThreads);
  });
}

void fp8_block_cast_cols(const Tensor& x, Tensor& q_t, float* scale_inv_t, uint32_t* nonfinite,
                         cudaStream_t stream) {
  const char* fn = "fp8_block_cast_cols";
  const RowMatrix m = input(x, fn);
  output(q_t, m.cols, m.rows, fn, "q_t");
  scales(scale_inv_t, fn, "scale_inv_t");
  counter(nonfinite, fn);
  if (m.rows == 0) return;
  const int64_t chunks = (m.rows / blk::kBlock) * (m.cols / kColChunk);
  const unsigned grid = grid_for(chunks * kThreads, kThreads);
  dispatch_float(x.dtype, fn, [&](auto tx) {
    using T = decltype(tx);
    cols_kernel<T><<<grid, kThreads, 0, stream>>>(x.ptr<const T>(), m.rows, m.cols, m.ld, q_t.ptr<uint8_t>(),
                                                  scale_inv_t, nonfinite);
    LOOM_CUDA_LAUNCH_CHECK("fp8_block cols_kernel", "x [", m.rows, ", ", m.cols, "] ld ", m.ld, " ",
                           dtype_name(x.dtype), ", grid ", grid, " x ", kThreads);
  });
}

void fp8_block_cast_blocks(const Tensor& x, Tensor* q, Tensor* q_t, float* scale_inv, float* scale_inv_t,
                           uint32_t* nonfinite, cudaStream_t stream) {
  const char* fn = "fp8_block_cast_blocks";
  const RowMatrix m = input(x, fn);
  LOOM_CHECK(q != nullptr || q_t != nullptr, fn, ": neither q nor q_t is given (x ", x.shape_str(), ")");
  if (q != nullptr) {
    output(*q, m.rows, m.cols, fn, "q");
    scales(scale_inv, fn, "scale_inv");
  }
  if (q_t != nullptr) {
    output(*q_t, m.cols, m.rows, fn, "q_t");
    scales(scale_inv_t, fn, "scale_inv_t");
  }
  counter(nonfinite, fn);
  if (m.rows == 0) return;
  const int64_t blocks = (m.rows / blk::kBlock) * (m.cols / blk::kBlock);
  const unsigned grid = grid_for(blocks * kThreads, kThreads);
  dispatch_float(x.dtype, fn, [&](auto tx) {
    using T = decltype(tx);
    blocks_kernel<T><<<grid, kThreads, 0, stream>>>(
        x.ptr<const T>(), m.rows, m.cols, m.ld, q != nullptr ? q->ptr<uint8_t>() : nullptr,
        q_t != nullptr ? q_t->ptr<uint8_t>() : nullptr, q != nullptr ? scale_inv : nullptr,
        q_t != nullptr ? scale_inv_t : nullptr, nonfinite);
    LOOM_CUDA_LAUNCH_CHECK("fp8_block blocks_kernel", "x [", m.rows, ", ", m.cols, "] ld ", m.ld, " ",
                           dtype_name(x.dtype), ", q ", q != nullptr ? "yes" : "no", ", q_t ",
                           q_t != nullptr ? "yes" : "no", ", grid ", grid, " x ", kThreads);
  });
}

}  // namespace loom::gpu
