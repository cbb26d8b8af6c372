// Fine-grained FP8 casts on the GPU (loom/ops/fp8_block_cast.hpp). Codes come from
// loom::fp8::encode_fast (bitwise encode), scales from
// loom::fp8::block::tile_scale, layouts from loom::fp8::block::scale_index:
// the same functions as the host reference.
//
// One kernel (tile_kernel) for every cast: a block of 256 threads takes a
// 128 x 128 tile of x at a time (grid-stride, the grid at most the blocks
// resident at once). Each thread loads 8 consecutive elements (one 16-byte
// load for bf16) of 8 rows: column group cg = thread % 16 (columns 8 cg ..
// 8 cg + 7), rows 4 rg + i + 64 h (rg = thread / 16, i < 4, h < 2), so a
// warp's loads cover 2 rows x 256 bytes, and x is read once for every copy
// and scale it gives.
//   - the amaxes are maxima of |x|'s bits (unsigned order is |x|'s order;
//     NaNs lie above inf and are taken as inf: the max of abs_or_inf below);
//     for bf16 two elements per unsigned 16x2 max;
//   - 1x128 row tiles (q, scale_inv): a row's 16 threads share a half warp,
//     the row amax is 4 shuffles; each thread stores its 8 codes of the row
//     (8 bytes; 128 contiguous bytes per half warp);
//   - 128x1 column tiles (q_t, scale_inv_t): per-thread maxima over its 8
//     rows, one shuffle, then the 8 warps' partials through shared memory;
//     a thread's 4 consecutive rows of one column make one 32-bit word of q_t,
//     stored in a shared 128 x 128-byte tile (16-byte group g of q_t row c at
//     g ^ (c / 8 % 8)), from which 8 threads store each 128-byte q_t row;
//   - 128x128 blocks (q and q_t with one scale): a block max, the codes once,
//     into q and the shared tile.
// The x and dy casts of the recipe (rows and columns of one tensor) are one
// launch (fp8_block_cast_rows_cols); each copy alone is the same kernel with
// the other side compiled out.
#include <cfloat>
#include <cstring>

#include "kernels/cuda/cuda_common.cuh"
#include "loom/ops/fp8_block_cast.hpp"
#include "loom/fp8.hpp"
#include "loom/fp8_block.hpp"

namespace loom::gpu {
namespace {

namespace blk = fp8::block;
constexpr int kThreads = 256;
constexpr uint32_t kInfBits = 0x7F800000u;

enum class Cast { rows, cols, rows_cols, blocks };

__device__ __forceinline__ uint8_t enc(float v, float s) { return fp8::encode_fast(v * s, fp8::Format::e4m3); }

// |x| max bits (fp32 bit pattern of |x|, NaN above inf) as the amax the rule
// takes: NaN counts as inf (abs_or_inf), everything else is exact.
__device__ __forceinline__ float amax_of_bits(uint32_t b) { return __uint_as_float(b > kInfBits ? kInfBits : b); }

__device__ __forceinline__ uint32_t umax(uint32_t a, uint32_t b) { return a > b ? a : b; }

// 8 consecutive elements of x held as raw words, and the amax bookkeeping of
// one element type. Column accumulators: bf16 packs two columns per word
// (column 2k in the low half of word k), fp32 one column per word; their
// combine is an unsigned max of the halves or of the words.
template <typename T>
struct Elem;

template <>
struct Elem<bf16> {
  static constexpr int kWords = 4;      // uint32 words per 8 elements
  static constexpr int kColWords = 4;   // column accumulators per thread
  __device__ static float value(const uint32_t (&w)[kWords], int j) {
    return __uint_as_float(j % 2 == 0 ? w[j / 2] << 16 : w[j / 2] & 0xFFFF0000u);  // exact, as __bfloat162float
  }
  // Row max bits (fp32 pattern) of the 8 elements; column maxima into c.
  __device__ static uint32_t accumulate(const uint32_t (&w)[kWords], uint32_t (&c)[kColWords]) {
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < kWords; ++k) {
      const uint32_t a = w[k] & 0x7FFF7FFFu;
      m = __vmaxu2(m, a);
      c[k] = __vmaxu2(c[k], a);
    }
    return umax(m & 0xFFFFu, m >> 16) << 16;
  }
  __device__ static uint32_t combine(uint32_t a, uint32_t b) { return __vmaxu2(a, b); }
  // Column j's max bits (fp32 pattern) from a row of column words.
  __device__ static uint32_t col_bits(const uint32_t* words, int j) {
    return j % 2 == 0 ? words[j / 2] << 16 : words[j / 2] & 0xFFFF0000u;
  }
};

template <>
struct Elem<float> {
  static constexpr int kWords = 8;
  static constexpr int kColWords = 8;
  __device__ static float value(const uint32_t (&w)[kWords], int j) { return __uint_as_float(w[j]); }
  __device__ static uint32_t accumulate(const uint32_t (&w)[kWords], uint32_t (&c)[kColWords]) {
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < kWords; ++k) {
      const uint32_t a = w[k] & 0x7FFFFFFFu;
      m = umax(m, a);
      c[k] = umax(c[k], a);
    }
    return m;
  }
  __device__ static uint32_t combine(uint32_t a, uint32_t b) { return umax(a, b); }
  __device__ static uint32_t col_bits(const uint32_t* words, int j) { return words[j]; }
};

// 8 elements at p into w: 16-byte loads when vec (p 16-byte aligned), else one by one.
template <typename T>
__device__ __forceinline__ void load8(const T* p, bool vec, uint32_t (&w)[Elem<T>::kWords]) {
  if (vec) {
#pragma unroll
    for (int k = 0; k < Elem<T>::kWords / 4; ++k) {
      const uint4 r = reinterpret_cast<const uint4*>(p)[k];
      w[4 * k] = r.x;
      w[4 * k + 1] = r.y;
      w[4 * k + 2] = r.z;
      w[4 * k + 3] = r.w;
    }
  } else {
    T e[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) e[j] = p[j];
    memcpy(w, e, sizeof(e));
  }
}

template <typename T, Cast kCast>
__global__ void __launch_bounds__(kThreads)
    tile_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t ldx, bool vec_in,
                uint8_t* __restrict__ q, uint8_t* __restrict__ qt, float* __restrict__ scale_inv,
                float* __restrict__ scale_inv_t, uint32_t* nonfinite) {
  using E = Elem<T>;
  constexpr bool kBlocks = kCast == Cast::blocks;
  constexpr bool kRowTiles = kCast == Cast::rows || kCast == Cast::rows_cols;
  constexpr bool kColTiles = kCast == Cast::cols || kCast == Cast::rows_cols;
  constexpr int kCW = E::kColWords * 16;  // column words per warp partial
  // q_t's bytes of the tile: 128 rows (x's columns) of 128 bytes (x's rows),
  // 16-byte group g of row c at group g ^ (c / 8 % 8).
  __shared__ uint4 tile_t[blk::kBlock * blk::kBlock / 16];
  __shared__ __align__(16) uint32_t col_part[kThreads / 32][kCW];  // stored as uint4
  __shared__ float col_scale[blk::kBlock];
  __shared__ float row_sinv[blk::kBlock];
  __shared__ uint32_t part[kThreads / 32];
  uint32_t* tile_w = reinterpret_cast<uint32_t*>(tile_t);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int cg = threadIdx.x % 16, cl = cg * 8, rg = threadIdx.x / 16;
  const int swz = cg % 8;  // = c / 8 % 8 for this thread's columns c = cl + j
  const int64_t cb_n = cols / blk::kBlock, tiles = (rows / blk::kBlock) * cb_n;
  // raw[4 h + i]: row 4 rg + i + 64 h of the tile, columns cl .. cl + 7.
  uint32_t raw[8][E::kWords];
  auto load_tile = [&](int64_t t) {
    const int64_t r0 = (t / cb_n) * blk::kBlock, c0 = (t % cb_n) * blk::kBlock;
#pragma unroll
    for (int k = 0; k < 8; ++k)
      load8<T>(x + (r0 + 4 * rg + k % 4 + 64 * (k / 4)) * ldx + c0 + cl, vec_in, raw[k]);
  };
  if (static_cast<int64_t>(blockIdx.x) < tiles) load_tile(blockIdx.x);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t rb = t / cb_n, cb = t % cb_n, r0 = rb * blk::kBlock, c0 = cb * blk::kBlock;
    // Amaxes: per row of this thread, per column (over its 8 rows).
    uint32_t rmax[8];
    uint32_t cmax[E::kColWords];
#pragma unroll
    for (int k = 0; k < E::kColWords; ++k) cmax[k] = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) rmax[k] = E::accumulate(raw[k], cmax);
    if constexpr (kColTiles) {
#pragma unroll
      for (int k = 0; k < E::kColWords; ++k) cmax[k] = E::combine(cmax[k], __shfl_xor_sync(0xffffffffu, cmax[k], 16));
      if (lane < 16) {
#pragma unroll
        for (int k = 0; k < E::kColWords / 4; ++k)
          reinterpret_cast<uint4*>(&col_part[warp][lane * E::kColWords])[k] =
              make_uint4(cmax[4 * k], cmax[4 * k + 1], cmax[4 * k + 2], cmax[4 * k + 3]);
      }
    }
    if constexpr (kBlocks) {
      uint32_t m = rmax[0];
#pragma unroll
      for (int k = 1; k < 8; ++k) m = umax(m, rmax[k]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = umax(m, __shfl_xor_sync(0xffffffffu, m, o));
      if (lane == 0) part[warp] = m;
    }
    if constexpr (kRowTiles) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        uint32_t m = rmax[k];
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) m = umax(m, __shfl_xor_sync(0xffffffffu, m, o));
        const blk::TileScale s = blk::tile_scale(amax_of_bits(m));
        const int r = 4 * rg + k % 4 + 64 * (k / 4);
        uint32_t w[2] = {0, 0};
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j / 4] |= static_cast<uint32_t>(enc(E::value(raw[k], j), s.scale)) << (8 * (j % 4));
        *reinterpret_cast<uint2*>(q + (r0 + r) * cols + c0 + cl) = make_uint2(w[0], w[1]);
        if (cg == 0) {
          row_sinv[r] = s.scale_inv;
          if (s.nonfinite && nonfinite != nullptr) atomicAdd(nonfinite, 1u);
        }
      }
    }
    __syncthreads();
    float bscale = 1.0f;
    if constexpr (kBlocks) {
      uint32_t m = part[0];
#pragma unroll
      for (int w = 1; w < kThreads / 32; ++w) m = umax(m, part[w]);
      const blk::TileScale s = blk::tile_scale(amax_of_bits(m));
      bscale = s.scale;
      if (threadIdx.x == 0) {
        if (scale_inv != nullptr)
          scale_inv[blk::scale_index(blk::ScaleMode::block_128x128, rb, cb, rows, cols)] = s.scale_inv;
        if (scale_inv_t != nullptr)
          scale_inv_t[blk::scale_index(blk::ScaleMode::block_128x128, cb, rb, cols, rows)] = s.scale_inv;
        if (s.nonfinite && nonfinite != nullptr) atomicAdd(nonfinite, 1u);
      }
    }
    if constexpr (kColTiles) {
      if (threadIdx.x < blk::kBlock) {
        const int c = threadIdx.x;
        uint32_t m = 0;
#pragma unroll
        for (int w = 0; w < kThreads / 32; ++w) m = umax(m, E::col_bits(&col_part[w][(c / 8) * E::kColWords], c % 8));
        const blk::TileScale s = blk::tile_scale(amax_of_bits(m));
        col_scale[c] = s.scale;
        // The transposed operand [cols, rows]: row c0 + c, k block rb.
        scale_inv_t[blk::scale_index(blk::ScaleMode::tile_1x128, c0 + c, rb, cols, rows)] = s.scale_inv;
        if (s.nonfinite && nonfinite != nullptr) atomicAdd(nonfinite, 1u);
      }
    }
    if constexpr (kRowTiles) {
      if (threadIdx.x >= kThreads - blk::kBlock) {
        const int r = threadIdx.x - (kThreads - blk::kBlock);
        scale_inv[blk::scale_index(blk::ScaleMode::tile_1x128, r0 + r, cb, rows, cols)] = row_sinv[r];
      }
    }
    if constexpr (kColTiles) __syncthreads();  // col_scale
    const bool trans = kColTiles || (kBlocks && qt != nullptr);
    if (kColTiles || kBlocks) {
      float cs[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) cs[j] = kColTiles ? col_scale[cl + j] : bscale;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t tw[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) tw[j] = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int k = 4 * h + i;
          uint8_t code[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            code[j] = enc(E::value(raw[k], j), cs[j]);
            tw[j] |= static_cast<uint32_t>(code[j]) << (8 * i);
          }
          if (kBlocks && q != nullptr) {
            uint2 w;
            memcpy(&w, code, 8);
            *reinterpret_cast<uint2*>(q + (r0 + 4 * rg + i + 64 * h) * cols + c0 + cl) = w;
          }
        }
        if (trans) {
          const int rw = rg + 16 * h;  // word of q_t's row: x rows 4 rw .. 4 rw + 3
#pragma unroll
          for (int j = 0; j < 8; ++j) tile_w[(cl + j) * 32 + (((rw / 4) ^ swz) * 4) + rw % 4] = tw[j];
        }
      }
    }
    // x is not read again for this tile: start the next one's loads.
    if (t + gridDim.x < tiles) load_tile(t + gridDim.x);
    if (trans) {
      __syncthreads();
      // 8 threads per q_t row: 16 bytes each, 128 contiguous bytes in all.
#pragma unroll
      for (int k = 0; k < blk::kBlock * blk::kBlock / 16 / kThreads; ++k) {
        const int idx = threadIdx.x + k * kThreads, c = idx / 8, g = idx % 8;
        const uint4 val = tile_t[c * 8 + (g ^ (c / 8 % 8))];
        *reinterpret_cast<uint4*>(qt + (c0 + c) * rows + r0 + g * 16) = val;
      }
    }
    __syncthreads();  // the shared tile, partials and scales are reused by the next tile
  }
}

// Blocks of tile_kernel<T, kCast> resident at once on the current device (as
// fp8_cast.cu's fast_slots): the per-SM count once per instantiation, the SM
// count per call.
template <typename T, Cast kCast>
int64_t resident_blocks(const char* fn) {
  static const int per_sm = [&] {
    int n = 0;
    LOOM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, tile_kernel<T, kCast>, kThreads, 0), fn,
                    ": occupancy of the fp8_block tile kernel, ", kThreads, " threads");
    return n < 1 ? 1 : n;
  }();
  int dev = 0, sms = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&dev), fn);
  LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), fn, ": device ", dev);
  return static_cast<int64_t>(per_sm) * (sms < 1 ? 1 : sms);
}

// Launches tile_kernel<T, kCast> over x's 128 x 128 tiles: at most the blocks
// resident at once, the tiles spread evenly over the waves of them.
template <typename T, Cast kCast>
void launch_tiles(const RowMatrix& m, const T* x, uint8_t* q, uint8_t* qt, float* scale_inv, float* scale_inv_t,
                  uint32_t* nonfinite, cudaStream_t stream, const char* fn, const char* what) {
  const bool vec_in = aligned_bytes(x, 16) && (m.ld * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  const int64_t tiles = (m.rows / blk::kBlock) * (m.cols / blk::kBlock);
  const int64_t slots = resident_blocks<T, kCast>(fn);
  const int64_t waves = (tiles + slots - 1) / slots;
  const unsigned grid = static_cast<unsigned>((tiles + waves - 1) / waves);
  tile_kernel<T, kCast><<<grid, kThreads, 0, stream>>>(x, m.rows, m.cols, m.ld, vec_in, q, qt, scale_inv,
                                                        scale_inv_t, nonfinite);
  LOOM_CUDA_LAUNCH_CHECK(what, "x [", m.rows, ", ", m.cols, "] ld ", m.ld, " ", sizeof(T) == 2 ? "bf16" : "fp32",
                         ", q ", q != nullptr ? "yes" : "no", ", q_t ", qt != nullptr ? "yes" : "no",
                         ", packed loads ", vec_in ? "yes" : "no", ", tiles ", tiles, ", grid ", grid, " x ",
                         kThreads);
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
  if (m.rows == 0 || m.cols == 0) return;
  dispatch_float(x.dtype, fn, [&](auto tx) {
    using T = decltype(tx);
    launch_tiles<T, Cast::rows>(m, x.ptr<const T>(), q.ptr<uint8_t>(), nullptr, scale_inv, nullptr, nonfinite,
                                stream, fn, "fp8_block tile_kernel (rows)");
  });
}

void fp8_block_cast_cols(const Tensor& x, Tensor& q_t, float* scale_inv_t, uint32_t* nonfinite,
                         cudaStream_t stream) {
  const char* fn = "fp8_block_cast_cols";
  const RowMatrix m = input(x, fn);
  output(q_t, m.cols, m.rows, fn, "q_t");
  scales(scale_inv_t, fn, "scale_inv_t");
  counter(nonfinite, fn);
  if (m.rows == 0 || m.cols == 0) return;
  dispatch_float(x.dtype, fn, [&](auto tx) {
    using T = decltype(tx);
    launch_tiles<T, Cast::cols>(m, x.ptr<const T>(), nullptr, q_t.ptr<uint8_t>(), nullptr, scale_inv_t, nonfinite,
                                stream, fn, "fp8_block tile_kernel (cols)");
  });
}

void fp8_block_cast_rows_cols(const Tensor& x, Tensor& q, float* scale_inv, Tensor& q_t, float* scale_inv_t,
                              uint32_t* nonfinite, cudaStream_t stream) {
  const char* fn = "fp8_block_cast_rows_cols";
  const RowMatrix m = input(x, fn);
  output(q, m.rows, m.cols, fn, "q");
  scales(scale_inv, fn, "scale_inv");
  output(q_t, m.cols, m.rows, fn, "q_t");
  scales(scale_inv_t, fn, "scale_inv_t");
  counter(nonfinite, fn);
  if (m.rows == 0 || m.cols == 0) return;
  dispatch_float(x.dtype, fn, [&](auto tx) {
    using T = decltype(tx);
    launch_tiles<T, Cast::rows_cols>(m, x.ptr<const T>(), q.ptr<uint8_t>(), q_t.ptr<uint8_t>(), scale_inv,
                                     scale_inv_t, nonfinite, stream, fn, "fp8_block tile_kernel (rows + cols)");
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
  if (m.rows == 0 || m.cols == 0) return;
  dispatch_float(x.dtype, fn, [&](auto tx) {
    using T = decltype(tx);
    launch_tiles<T, Cast::blocks>(m, x.ptr<const T>(), q != nullptr ? q->ptr<uint8_t>() : nullptr,
                                  q_t != nullptr ? q_t->ptr<uint8_t>() : nullptr, q != nullptr ? scale_inv : nullptr,
                                  q_t != nullptr ? scale_inv_t : nullptr, nonfinite, stream, fn,
                                  "fp8_block tile_kernel (blocks)");
  });
}

}  // namespace loom::gpu
