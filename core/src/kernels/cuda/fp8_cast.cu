// FP8 casts, amaxes and scale updates on the GPU (see loom/ops/fp8_cast.hpp).
//
// Codes come from loom::fp8::encode_fast, bitwise the host's encode (checked
// over every input in test_fp8): with encode itself the cast is bound by
// integer throughput, not by memory.
//
// Fast path (cast_tiles_kernel): fp8_tile.cuh's 128 x 64 tiles of x,
// grid-stride, 256 threads; each thread reads 8 consecutive elements (16 bytes
// of bf16) of 4 consecutive rows. It takes the whole tiles of x when x, q and
// q_t allow the packed accesses; the rest (a right and a bottom strip, or
// everything) goes through cast_kernel.
//
// General path (cast_kernel): 64 x 64 tiles of a region of x, one tile per
// block of 256 threads at a time (grid-stride over tiles). Each thread reads 8
// consecutive elements of two rows (one 16-byte load for bf16, two for fp32),
// and stores 8 bytes of the row-major copy; for the transposed copy the codes
// go through shared memory and each thread stores 16 consecutive bytes of a
// row of q_t (16 rows of x). Where a tile runs past the edge, or a pointer or
// row stride is not aligned for the packed accesses, the same code runs
// element by element.
//
// The amax is a per-thread max, a block max, and one atomicMax per block on
// the float's bits.
#include <algorithm>
#include <cfloat>

#include "kernels/cuda/cuda_common.cuh"
#include "loom/ops/fp8_cast.hpp"
#include "kernels/cuda/fp8_tile.cuh"
#include "loom/fp8.hpp"

namespace loom::gpu {
namespace {

constexpr int kTile = 64;          // rows and columns of x per tile
constexpr int kCastThreads = 256;  // 8 column groups of 8 x 32 rows, twice
constexpr int kTileStride = 68;    // bytes per shared tile row (4-aligned, staggers banks)
using fp8_tile::block_amax_to;
using fp8_tile::kInfBits;

__device__ __forceinline__ float abs_or_inf(float v) {
  // NaN is recorded as +inf (fp8_scaling.hpp); fmaxf alone would drop it.
  return fp8::is_nan(v) ? __uint_as_float(kInfBits) : fabsf(v);
}

template <typename T, fp8::Format F, bool kRow, bool kTrans>
__global__ void __launch_bounds__(kCastThreads)
    cast_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t ldx, int64_t r_lo, int64_t r_hi,
                int64_t c_lo, uint8_t* __restrict__ q, uint8_t* __restrict__ qt, const float* __restrict__ scale_ptr,
                float* amax, bool vec_in, bool vec_q, bool vec_t) {
  // The region is rows [r_lo, r_hi) x columns [c_lo, cols); rows is still q_t's row length.
  __shared__ uint32_t tile_words[kTile * kTileStride / 4];
  uint8_t* tile = reinterpret_cast<uint8_t*>(tile_words);
  const float s = (kRow || kTrans) ? *scale_ptr : 1.0f;
  const int64_t tiles_c = (cols - c_lo + kTile - 1) / kTile, tiles_r = (r_hi - r_lo + kTile - 1) / kTile;
  const int cg_local = (threadIdx.x % 8) * 8;  // this thread's 8 columns in the tile
  const int r_local0 = threadIdx.x / 8;        // its rows: r_local0 and r_local0 + 32
  float m = 0.0f;
  for (int64_t t = blockIdx.x; t < tiles_r * tiles_c; t += gridDim.x) {
    const int64_t r0 = r_lo + (t / tiles_c) * kTile, c0 = c_lo + (t % tiles_c) * kTile;
    const int64_t cg = c0 + cg_local;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int rl = r_local0 + 32 * half;
      const int64_t r = r0 + rl;
      if (r >= r_hi) continue;
      float v[8];
      const bool full = cg + 8 <= cols;
      if (full && vec_in) {
        load_vec<8>(x + r * ldx + cg, v);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = cg + j < cols ? to_f32(x[r * ldx + cg + j]) : 0.0f;
      }
      uint8_t code[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        m = fmaxf(m, abs_or_inf(v[j]));  // out-of-range lanes hold 0
        if constexpr (kRow || kTrans) code[j] = fp8::encode_fast(v[j] * s, F);
      }
      if constexpr (kRow) {
        uint8_t* dst = q + r * cols + cg;
        if (full && vec_q) {
          uint2 w;
          memcpy(&w, code, 8);
          *reinterpret_cast<uint2*>(dst) = w;
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (cg + j < cols) dst[j] = code[j];
        }
      }
      if constexpr (kTrans) {
        uint32_t w0, w1;
        memcpy(&w0, code, 4);
        memcpy(&w1, code + 4, 4);
        tile_words[(rl * kTileStride + cg_local) / 4] = w0;
        tile_words[(rl * kTileStride + cg_local) / 4 + 1] = w1;
      }
    }
    if constexpr (kTrans) {
      __syncthreads();
      // Row c of q_t holds column c of x: this thread writes its bytes for x rows [rs, rs + 16).
      const int cl = threadIdx.x / 4, rl0 = (threadIdx.x % 4) * 16;
      const int64_t c = c0 + cl, rs = r0 + rl0;
      if (c < cols && rs < r_hi) {
        uint8_t* dst = qt + c * rows + rs;
        if (vec_t && rs + 16 <= r_hi) {
          uint8_t b[16];
#pragma unroll
          for (int j = 0; j < 16; ++j) b[j] = tile[(rl0 + j) * kTileStride + cl];
          uint4 w;
          memcpy(&w, b, 16);
          *reinterpret_cast<uint4*>(dst) = w;
        } else {
          for (int j = 0; j < 16 && rs + j < r_hi; ++j) dst[j] = tile[(rl0 + j) * kTileStride + cl];
        }
      }
      __syncthreads();  // the next tile overwrites the shared tile
    }
  }
  if (amax != nullptr) block_amax_to(m, amax);
}

constexpr int kFastRows = fp8_tile::kRows;
constexpr int kFastCols = fp8_tile::kCols;
constexpr int kFastThreads = fp8_tile::kThreads;

// 8 elements of x at p (16-byte aligned) as floats, their |x| bits
// max-accumulated into m. bf16: the floats are the bits moved up (exact, as
// __bfloat162float), and m holds two 16-bit maxima, one per half-word, two
// elements per unsigned 16x2 max; fp32: one 32-bit max per element. Unsigned
// order of |x| bits is the order of |x|, with NaNs above inf.
__device__ __forceinline__ void load8_amax(const bf16* p, float (&v)[8], uint32_t& m) {
  const uint4 r = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = __uint_as_float(w[k] << 16);
    v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
    m = __vmaxu2(m, w[k] & 0x7FFF7FFFu);
  }
}
__device__ __forceinline__ void load8_amax(const float* p, float (&v)[8], uint32_t& m) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint4 r = reinterpret_cast<const uint4*>(p)[h];
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[4 * h + k] = __uint_as_float(w[k]);
      const uint32_t a = w[k] & 0x7FFFFFFFu;
      m = a > m ? a : m;
    }
  }
}
// load8_amax's accumulator as fp32 |x| bits.
__device__ __forceinline__ uint32_t amax_bits(const bf16*, uint32_t m) {
  const uint32_t lo = m & 0xFFFFu, hi = m >> 16;
  return (lo > hi ? lo : hi) << 16;
}
__device__ __forceinline__ uint32_t amax_bits(const float*, uint32_t m) { return m; }

// Whole 128 x 64 tiles of x; the caller guarantees x rows 16-byte aligned at
// every 8th column, q rows 8-byte aligned (cols % 8 == 0), q_t rows 16-byte
// aligned at every 16th x row (rows % 16 == 0).
template <typename T, fp8::Format F, bool kRow, bool kTrans>
__global__ void __launch_bounds__(kFastThreads)
    cast_tiles_kernel(const T* __restrict__ x, int64_t rows, int64_t cols, int64_t ldx, int64_t tiles_r,
                      int64_t tiles_c, uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                      const float* __restrict__ scale_ptr, float* amax) {
  __shared__ fp8_tile::Shared sh;
  const float s = (kRow || kTrans) ? *scale_ptr : 1.0f;
  const fp8_tile::Lane ln = fp8_tile::lane();
  uint32_t m = 0;  // see load8_amax
  for (int64_t t = blockIdx.x; t < tiles_r * tiles_c; t += gridDim.x) {
    const int64_t r0 = (t / tiles_c) * kFastRows, c0 = (t % tiles_c) * kFastCols;
    float v[4][8];
#pragma unroll
    for (int i = 0; i < 4; ++i) load8_amax(x + (r0 + ln.rl0 + i) * ldx + c0 + ln.cg * 8, v[i], m);
    uint32_t w[4][2] = {};
    if constexpr (kRow || kTrans) fp8_tile::encode<F>(v, s, w);
    if constexpr (kRow) fp8_tile::store_rows(q + (r0 + ln.rl0) * cols + c0 + ln.cg * 8, cols, w);
    if constexpr (kTrans) fp8_tile::store_transposed<false>(sh, ln, w, qt + c0 * rows + r0, rows, kFastRows, kFastCols);
  }
  m = amax_bits(x, m);
  if (amax != nullptr) block_amax_to(fp8_tile::amax_value(m), amax);  // NaN counts as +inf
}

template <typename T, fp8::Format F, bool kRow, bool kTrans>
void launch_general(const T* x, int64_t rows, int64_t cols, int64_t ldx, int64_t r_lo, int64_t r_hi, int64_t c_lo,
                    uint8_t* q, uint8_t* qt, const float* scale, float* amax, bool vec_in, cudaStream_t stream,
                    const char* name) {
  const int64_t tiles = ((r_hi - r_lo + kTile - 1) / kTile) * ((cols - c_lo + kTile - 1) / kTile);
  const unsigned grid = static_cast<unsigned>(tiles < kMaxGridBlocks ? tiles : kMaxGridBlocks);
  // Packed paths: 8 elements of x (16 or 32 bytes) at 16-byte aligned
  // addresses; 8 bytes of q at 8-byte aligned ones; 16 bytes of q_t at
  // 16-byte aligned ones (r_lo is 0 or a multiple of kFastRows).
  const bool vec_q = q != nullptr && aligned_bytes(q, 8) && cols % 8 == 0;
  const bool vec_t = qt != nullptr && aligned_bytes(qt, 16) && rows % 16 == 0;
  cast_kernel<T, F, kRow, kTrans><<<grid, kCastThreads, 0, stream>>>(x, rows, cols, ldx, r_lo, r_hi, c_lo, q, qt, scale,
                                                                     amax, vec_in, vec_q, vec_t);
  LOOM_CUDA_LAUNCH_CHECK(name, " (general) rows=", rows, " cols=", cols, " ld=", ldx, " region rows [", r_lo, ", ",
                         r_hi, ") cols [", c_lo, ", ", cols, ") grid=", grid, " vec in/q/qt=", vec_in, "/", vec_q, "/",
                         vec_t);
}

template <typename T, fp8::Format F, bool kRow, bool kTrans>
void launch_cast(const T* x, int64_t rows, int64_t cols, int64_t ldx, uint8_t* q, uint8_t* qt, const float* scale,
                 float* amax, cudaStream_t stream, const char* name) {
  const bool vec_in = aligned_bytes(x, 16) && (ldx * static_cast<int64_t>(sizeof(T))) % 16 == 0;
  const int64_t rows_f = rows / kFastRows * kFastRows, cols_f = cols / kFastCols * kFastCols;
  const bool fast = rows_f > 0 && cols_f > 0 && vec_in &&
                    (q == nullptr || (aligned_bytes(q, 8) && cols % 8 == 0)) &&
                    (qt == nullptr || (aligned_bytes(qt, 16) && rows % 16 == 0));
  if (!fast) {
    launch_general<T, F, kRow, kTrans>(x, rows, cols, ldx, 0, rows, 0, q, qt, scale, amax, vec_in, stream, name);
    return;
  }
  const int64_t tiles_r = rows_f / kFastRows, tiles_c = cols_f / kFastCols, tiles = tiles_r * tiles_c;
  int64_t slots = 0;
  const int per_sm = fp8_tile::blocks_per_sm<cast_tiles_kernel<T, F, kRow, kTrans>>(name);
  const unsigned grid = fp8_tile::grid_for_tiles(tiles, per_sm, name, &slots);
  cast_tiles_kernel<T, F, kRow, kTrans>
      <<<grid, kFastThreads, 0, stream>>>(x, rows, cols, ldx, tiles_r, tiles_c, q, qt, scale, amax);
  LOOM_CUDA_LAUNCH_CHECK(name, " (tiles) rows=", rows, " cols=", cols, " ld=", ldx, " whole tiles ", tiles_r, " x ",
                         tiles_c, " grid=", grid, " resident blocks=", slots);
  // The edges the whole tiles leave: columns [cols_f, cols) of rows [0, rows_f), then rows [rows_f, rows).
  if (cols_f < cols)
    launch_general<T, F, kRow, kTrans>(x, rows, cols, ldx, 0, rows_f, cols_f, q, qt, scale, amax, vec_in, stream,
                                       name);
  if (rows_f < rows)
    launch_general<T, F, kRow, kTrans>(x, rows, cols, ldx, rows_f, rows, 0, q, qt, scale, amax, vec_in, stream, name);
}

bool is_fp8(DType t) { return t == DType::e4m3 || t == DType::e5m2; }
fp8::Format format_of(DType t) { return t == DType::e4m3 ? fp8::Format::e4m3 : fp8::Format::e5m2; }

void check_float_ptr(const void* p, const char* what, const char* fn, bool required) {
  LOOM_CHECK(p != nullptr || !required, fn, ": ", what, " is null; it must point to a device float");
  LOOM_CHECK(aligned_bytes(p, 4), fn, ": ", what, " at ", p, " is not 4-byte aligned (a device float)");
}

// x as a row matrix, checked: device, dtype fp32/bf16.
RowMatrix input_matrix(const Tensor& x, const char* fn) {
  check_device(x, fn);
  LOOM_CHECK(x.dtype == DType::f32 || x.dtype == DType::bf16, fn, ": x must be fp32 or bf16, got ", dtype_name(x.dtype),
             " (shape ", x.shape_str(), ")");
  return fold_rows(x, fn, ": x");
}

// ---- scale updates --------------------------------------------------------------

__device__ __forceinline__ float fp8_max_of_slot(int64_t t, fp8::Formats formats) {
  return fp8::max_value(fp8::role_format(formats, static_cast<fp8::Role>(t % fp8::kRolesPerLinear)));
}

__device__ __forceinline__ void set_scale(float* scale, float* scale_inv, int64_t t, float s) {
  scale[t] = s;
  // Correctly rounded 1 / s, like the host's 1.0f / s (s in (0, FLT_MAX]:
  // finite, at worst subnormal); __frcp_rn stays IEEE under any math flags.
  scale_inv[t] = __frcp_rn(s);
}

__global__ void update_scales_kernel(const float* amax, float* scale, float* scale_inv, int64_t first, int64_t count,
                                     fp8::Formats formats, int margin, uint32_t* skipped) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    const int64_t t = first + i;
    const fp8::ScaleUpdate u = fp8::compute_scale(amax[t], fp8_max_of_slot(t, formats), margin, scale[t]);
    set_scale(scale, scale_inv, t, u.scale);
    if (u.skipped && skipped != nullptr) atomicAdd(skipped, 1u);
  }
}

__global__ void delayed_update_kernel(float* step_amax, float* history, int history_len, int head, int64_t tensors,
                                      fp8::AmaxAlgo algo, fp8::Formats formats, int margin, float* scale,
                                      float* scale_inv, uint32_t* kept, uint32_t* nonfinite) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < tensors; t += stride) {
    const float a = step_amax[t];
    step_amax[t] = 0.0f;
    const bool bad = !fp8::is_finite(a);
    history[static_cast<int64_t>(head) * tensors + t] = bad || a < 0.0f ? 0.0f : a;
    if (bad) {
      if (nonfinite != nullptr) atomicAdd(nonfinite, 1u);
      if (kept != nullptr) atomicAdd(kept, 1u);
      continue;
    }
    float w;
    if (algo == fp8::AmaxAlgo::most_recent) {
      w = history[static_cast<int64_t>(head) * tensors + t];
    } else {
      w = 0.0f;  // entries are finite and >= 0
      for (int row = 0; row < history_len; ++row) {
        const float h = history[static_cast<int64_t>(row) * tensors + t];
        if (h > w) w = h;
      }
    }
    const fp8::ScaleUpdate u = fp8::compute_scale(w, fp8_max_of_slot(t, formats), margin, scale[t]);
    if (u.skipped && kept != nullptr) atomicAdd(kept, 1u);
    set_scale(scale, scale_inv, t, u.scale);
  }
}

// ---- dequantize ---------------------------------------------------------------------
// y = decode(q) / scale over every element. A code has 256 values, so each
// block first writes the 256 results into shared memory (the same expression
// per code as an element-by-element kernel would evaluate: the same bits),
// then every element is a table read. Each thread takes 8 codes with one
// 8-byte load and stores 8 results with packed stores (16 bytes of bf16, 32
// of fp32) where q and y allow it; a misaligned head and the tail go one
// element at a time. The FP8 weight gathers decode a decoder layer's weights
// (hundreds of MB) at every gather: an element-wise decode with a division per
// element ran at a fifth of the memory bandwidth there.

constexpr int kDequantThreads = 256;
constexpr int kDequantVec = 8;

template <typename TY, fp8::Format F>
__global__ void __launch_bounds__(kDequantThreads)
    dequant_lut_kernel(TY* __restrict__ y, const uint8_t* __restrict__ q, int64_t n, int64_t head,
                       const float* __restrict__ scale) {
  __shared__ TY lut[256];
  const float s = *scale;
  for (int c = threadIdx.x; c < 256; c += blockDim.x) lut[c] = from_f32<TY>(fp8::decode(static_cast<uint8_t>(c), F) / s);
  __syncthreads();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // [0, head): element by element, up to where q and y are both aligned.
  for (int64_t i = gid; i < head; i += stride) y[i] = lut[q[i]];
  const int64_t nvec = (n - head) / kDequantVec;
  const uint8_t* qv = q + head;
  TY* yv = y + head;
  for (int64_t v = gid; v < nvec; v += stride) {
    const uint2 codes = *reinterpret_cast<const uint2*>(qv + v * kDequantVec);
    alignas(16) TY out[kDequantVec];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out[k] = lut[(codes.x >> (8 * k)) & 0xFFu];
      out[4 + k] = lut[(codes.y >> (8 * k)) & 0xFFu];
    }
    const uint4* src = reinterpret_cast<const uint4*>(out);
    uint4* dst = reinterpret_cast<uint4*>(yv + v * kDequantVec);
#pragma unroll
    for (int k = 0; k < static_cast<int>(kDequantVec * sizeof(TY) / 16); ++k) dst[k] = src[k];
  }
  for (int64_t i = head + nvec * kDequantVec + gid; i < n; i += stride) y[i] = lut[q[i]];
}

// Elements to take one by one before q is 8-byte and y 16-byte aligned; n (all
// of them) when no such point exists within reach.
template <typename TY>
int64_t dequant_head(const TY* y, const uint8_t* q, int64_t n) {
  for (int64_t h = 0; h < 16 && h < n; ++h) {
    if (aligned_bytes(q + h, 8) && aligned_bytes(y + h, 16)) return h;
  }
  return n;
}

// ---- transpose of codes ------------------------------------------------------------
// qt = qᵀ for 1-byte codes: 64 x 64 tiles through shared memory, 256
// threads a tile (grid-stride over tiles). Where the tile is whole and q, qt
// allow 16-byte accesses, each thread loads 16 codes of a row of q and stores
// 16 codes of a row of qt; elsewhere (edge tiles, misaligned pointers or
// strides) the same tile moves byte by byte. The FP8 weight gathers hand the
// gathered codes to the GEMMs directly, and dgrad reads Wᵀ: this replaces a
// cast of the bf16 weight (3 bytes an element) with 2 bytes an element.

constexpr int kTransTile = 64;
constexpr int kTransPad = 4;  // a row of the tile in shared memory: 68 bytes

__global__ void __launch_bounds__(256)
    transpose_codes_kernel(uint8_t* __restrict__ qt, const uint8_t* __restrict__ q, int64_t rows, int64_t cols,
                           int64_t tiles_r, int64_t tiles_c, bool vec) {
  __shared__ alignas(16) uint8_t tile[kTransTile][kTransTile + kTransPad];
  const int t = threadIdx.x;
  for (int64_t tix = blockIdx.x; tix < tiles_r * tiles_c; tix += gridDim.x) {
    const int64_t r0 = (tix / tiles_c) * kTransTile, c0 = (tix % tiles_c) * kTransTile;
    const bool whole = vec && r0 + kTransTile <= rows && c0 + kTransTile <= cols;
    if (whole) {
      const int r = t / 4, seg = t % 4;
      const uint4 v = *reinterpret_cast<const uint4*>(q + (r0 + r) * cols + c0 + seg * 16);
      const uint8_t* b = reinterpret_cast<const uint8_t*>(&v);
#pragma unroll
      for (int k = 0; k < 16; ++k) tile[r][seg * 16 + k] = b[k];
    } else {
      for (int i = t; i < kTransTile * kTransTile; i += blockDim.x) {
        const int r = i / kTransTile, c = i % kTransTile;
        if (r0 + r < rows && c0 + c < cols) tile[r][c] = q[(r0 + r) * cols + c0 + c];
      }
    }
    __syncthreads();
    if (whole) {
      const int j = t / 4, seg = t % 4;  // row c0 + j of qt, its codes from rows r0 + 16 seg .. + 16
      alignas(16) uint8_t out[16];
#pragma unroll
      for (int k = 0; k < 16; ++k) out[k] = tile[seg * 16 + k][j];
      *reinterpret_cast<uint4*>(qt + (c0 + j) * rows + r0 + seg * 16) = *reinterpret_cast<const uint4*>(out);
    } else {
      for (int i = t; i < kTransTile * kTransTile; i += blockDim.x) {
        const int j = i / kTransTile, r = i % kTransTile;
        if (c0 + j < cols && r0 + r < rows) qt[(c0 + j) * rows + r0 + r] = tile[r][j];
      }
    }
    __syncthreads();
  }
}

// ---- the hardware encode against encode_fast ------------------------------------------

// Every bit pattern u = 4 i .. 4 i + 3 for i in [0, 2^30), grid-stride.
template <fp8::Format F>
__global__ void encode_check_kernel(unsigned long long* bad, unsigned int* first_bad) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  unsigned long long mine = 0;
  unsigned int first = 0xFFFFFFFFu;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (uint64_t{1} << 30);
       i += stride) {
    const uint32_t u0 = static_cast<uint32_t>(4 * i);
    const float v[4] = {__uint_as_float(u0), __uint_as_float(u0 + 1), __uint_as_float(u0 + 2),
                        __uint_as_float(u0 + 3)};
    const uint32_t hw = fp8_tile::encode4<F>(v[0], v[1], v[2], v[3]);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (((hw >> (8 * k)) & 0xFFu) == fp8::encode_fast(v[k], F)) continue;
      ++mine;
      if (u0 + k < first) first = u0 + k;
    }
  }
  if (mine != 0) {
    atomicAdd(bad, mine);
    atomicMin(first_bad, first);
  }
}

}  // namespace

uint64_t fp8_encode_mismatches(fp8::Format f, uint32_t* first_bad, cudaStream_t stream) {
  const char* fn = "fp8_encode_mismatches";
  void* mem = nullptr;
  LOOM_CUDA_CHECK(cudaMalloc(&mem, 16), fn, ": 16 bytes of counters");
  auto* bad = static_cast<unsigned long long*>(mem);
  auto* first = reinterpret_cast<unsigned int*>(static_cast<char*>(mem) + 8);
  uint64_t host_bad = 0;
  uint32_t host_first = 0xFFFFFFFFu;
  try {
    LOOM_CUDA_CHECK(cudaMemsetAsync(bad, 0, 8, stream), fn, ": clearing the count");
    LOOM_CUDA_CHECK(cudaMemsetAsync(first, 0xFF, 4, stream), fn, ": setting the first bad input");
    const unsigned grid = static_cast<unsigned>(kMaxGridBlocks);
    if (f == fp8::Format::e4m3) encode_check_kernel<fp8::Format::e4m3><<<grid, 256, 0, stream>>>(bad, first);
    else encode_check_kernel<fp8::Format::e5m2><<<grid, 256, 0, stream>>>(bad, first);
    LOOM_CUDA_LAUNCH_CHECK(fn, "format=", f == fp8::Format::e4m3 ? "e4m3" : "e5m2", " grid=", grid);
    LOOM_CUDA_CHECK(cudaMemcpyAsync(&host_bad, bad, 8, cudaMemcpyDeviceToHost, stream), fn, ": reading the count");
    LOOM_CUDA_CHECK(cudaMemcpyAsync(&host_first, first, 4, cudaMemcpyDeviceToHost, stream), fn,
                    ": reading the first bad input");
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream), fn, ": waiting for the check");
  } catch (...) {
    cudaFree(mem);
    throw;
  }
  LOOM_CUDA_CHECK(cudaFree(mem), fn, ": freeing the counters");
  if (first_bad != nullptr) *first_bad = host_first;
  return host_bad;
}

void fp8_cast(const Tensor& x, Tensor* q, Tensor* q_t, const float* scale, float* amax, cudaStream_t stream) {
  const char* fn = "fp8_cast";
  const RowMatrix mx = input_matrix(x, fn);
  LOOM_CHECK(q != nullptr || q_t != nullptr, fn, ": neither q nor q_t is given (x ", x.shape_str(),
             "); to measure the amax alone call fp8_amax");
  DType qt = DType::e4m3;
  if (q != nullptr) {
    check_device(*q, "fp8_cast q");
    LOOM_CHECK(is_fp8(q->dtype), fn, ": q must be fp8_e4m3 or fp8_e5m2, got ", dtype_name(q->dtype));
    const RowMatrix m = fold_rows(*q, fn, ": q");
    LOOM_CHECK(m.rows == mx.rows && m.cols == mx.cols && q->is_contiguous(), fn, ": q must be a contiguous [", mx.rows,
               ", ", mx.cols, "] tensor like x ", x.shape_str(), ", got ", q->shape_str(),
               q->is_contiguous() ? "" : " (not contiguous)");
    qt = q->dtype;
  }
  if (q_t != nullptr) {
    check_device(*q_t, "fp8_cast q_t");
    LOOM_CHECK(is_fp8(q_t->dtype), fn, ": q_t must be fp8_e4m3 or fp8_e5m2, got ", dtype_name(q_t->dtype));
    LOOM_CHECK(q == nullptr || q_t->dtype == q->dtype, fn, ": q is ", dtype_name(q->dtype), " but q_t is ",
               dtype_name(q_t->dtype), "; both copies of one cast have one format");
    LOOM_CHECK(q_t->ndim == 2 && q_t->shape[0] == mx.cols && q_t->shape[1] == mx.rows && q_t->is_contiguous(), fn,
               ": q_t must be a contiguous [cols, rows] = [", mx.cols, ", ", mx.rows, "] tensor (x is ", x.shape_str(),
               "), got ", q_t->shape_str());
    qt = q_t->dtype;
  }
  check_float_ptr(scale, "scale", fn, true);
  check_float_ptr(amax, "amax", fn, false);
  if (mx.rows == 0 || mx.cols == 0) return;
  uint8_t* qp = q != nullptr ? q->ptr<uint8_t>() : nullptr;
  uint8_t* qtp = q_t != nullptr ? q_t->ptr<uint8_t>() : nullptr;
  dispatch_float(x.dtype, fn, [&](auto tx) {
    using T = decltype(tx);
    const T* xp = x.ptr<const T>();
    auto go = [&](auto fmt) {
      constexpr fp8::Format F = decltype(fmt)::value;
      if (qp != nullptr && qtp != nullptr)
        launch_cast<T, F, true, true>(xp, mx.rows, mx.cols, mx.ld, qp, qtp, scale, amax, stream, "fp8_cast (q, q_t)");
      else if (qp != nullptr)
        launch_cast<T, F, true, false>(xp, mx.rows, mx.cols, mx.ld, qp, nullptr, scale, amax, stream, "fp8_cast (q)");
      else
        launch_cast<T, F, false, true>(xp, mx.rows, mx.cols, mx.ld, nullptr, qtp, scale, amax, stream,
                                       "fp8_cast (q_t)");
    };
    if (format_of(qt) == fp8::Format::e4m3)
      go(std::integral_constant<fp8::Format, fp8::Format::e4m3>{});
    else
      go(std::integral_constant<fp8::Format, fp8::Format::e5m2>{});
  });
}

void fp8_amax(const Tensor& x, float* amax, cudaStream_t stream) {
  const char* fn = "fp8_amax";
  const RowMatrix mx = input_matrix(x, fn);
  check_float_ptr(amax, "amax", fn, true);
  if (mx.rows == 0 || mx.cols == 0) return;
  dispatch_float(x.dtype, fn, [&](auto tx) {
    using T = decltype(tx);
    launch_cast<T, fp8::Format::e4m3, false, false>(x.ptr<const T>(), mx.rows, mx.cols, mx.ld, nullptr, nullptr,
                                                    nullptr, amax, stream, "fp8_amax");
  });
}

void fp8_update_scales(const float* amax, float* scale, float* scale_inv, int64_t first, int64_t count,
                       fp8::Formats formats, int margin, uint32_t* skipped, cudaStream_t stream) {
  const char* fn = "fp8_update_scales";
  check_float_ptr(amax, "amax", fn, true);
  check_float_ptr(scale, "scale", fn, true);
  check_float_ptr(scale_inv, "scale_inv", fn, true);
  LOOM_CHECK(first >= 0 && count >= 0, fn, ": slots [", first, ", ", first + count, ") are not a valid range");
  LOOM_CHECK(margin >= 0 && margin <= 126, fn, ": margin ", margin, " is outside [0, 126]");
  LOOM_CHECK(aligned_bytes(skipped, 4), fn, ": skipped counter at ", static_cast<const void*>(skipped),
             " is not 4-byte aligned");
  if (count == 0) return;
  const unsigned grid = grid_for(count, 256);
  update_scales_kernel<<<grid, 256, 0, stream>>>(amax, scale, scale_inv, first, count, formats, margin, skipped);
  LOOM_CUDA_LAUNCH_CHECK(fn, "first=", first, " count=", count, " margin=", margin, " grid=", grid);
}

void fp8_delayed_update(float* step_amax, float* history, int history_len, int head, int64_t tensors,
                        fp8::AmaxAlgo algo, fp8::Formats formats, int margin, float* scale, float* scale_inv,
                        uint32_t* kept, uint32_t* nonfinite, cudaStream_t stream) {
  const char* fn = "fp8_delayed_update";
  check_float_ptr(step_amax, "step_amax", fn, true);
  check_float_ptr(history, "history", fn, true);
  check_float_ptr(scale, "scale", fn, true);
  check_float_ptr(scale_inv, "scale_inv", fn, true);
  LOOM_CHECK(history_len >= 1 && head >= 0 && head < history_len, fn, ": head ", head, " is not a row of a history of ",
             history_len, " rows");
  LOOM_CHECK(tensors >= 0, fn, ": tensors = ", tensors);
  LOOM_CHECK(margin >= 0 && margin <= 126, fn, ": margin ", margin, " is outside [0, 126]");
  LOOM_CHECK(aligned_bytes(kept, 4) && aligned_bytes(nonfinite, 4), fn, ": counters at ",
             static_cast<const void*>(kept), " / ", static_cast<const void*>(nonfinite), " are not 4-byte aligned");
  if (tensors == 0) return;
  const unsigned grid = grid_for(tensors, 256);
  delayed_update_kernel<<<grid, 256, 0, stream>>>(step_amax, history, history_len, head, tensors, algo, formats, margin,
                                                  scale, scale_inv, kept, nonfinite);
  LOOM_CUDA_LAUNCH_CHECK(fn, "tensors=", tensors, " history_len=", history_len, " head=", head, " grid=", grid);
}

void fp8_dequantize(Tensor& y, const Tensor& q, const float* scale, cudaStream_t stream) {
  const char* fn = "fp8_dequantize";
  check_device(y, "fp8_dequantize y");
  check_device(q, "fp8_dequantize q");
  check_contiguous(y, "fp8_dequantize y");
  check_contiguous(q, "fp8_dequantize q");
  LOOM_CHECK(is_fp8(q.dtype), fn, ": q must be fp8_e4m3 or fp8_e5m2, got ", dtype_name(q.dtype));
  LOOM_CHECK(y.numel() == q.numel(), fn, ": y ", y.shape_str(), " and q ", q.shape_str(),
             " have different element counts");
  check_float_ptr(scale, "scale", fn, true);
  const int64_t n = y.numel();
  if (n == 0) return;
  dispatch_float(y.dtype, "fp8_dequantize y", [&](auto ty) {
    using TY = decltype(ty);
    TY* yp = y.ptr<TY>();
    const uint8_t* qp = q.ptr<const uint8_t>();
    const int64_t head = dequant_head(yp, qp, n);
    const int64_t work = std::max<int64_t>(head, (n - head) / kDequantVec + 1);
    const unsigned grid = grid_for(work, kDequantThreads);
    if (q.dtype == DType::e4m3)
      dequant_lut_kernel<TY, fp8::Format::e4m3><<<grid, kDequantThreads, 0, stream>>>(yp, qp, n, head, scale);
    else
      dequant_lut_kernel<TY, fp8::Format::e5m2><<<grid, kDequantThreads, 0, stream>>>(yp, qp, n, head, scale);
    LOOM_CUDA_LAUNCH_CHECK(fn, "n=", n, " head=", head, " grid=", grid, " y ", dtype_name(y.dtype), " at ",
                           static_cast<const void*>(yp), ", q at ", static_cast<const void*>(qp));
  });
}

void fp8_transpose(Tensor& qt, const Tensor& q, cudaStream_t stream) {
  const char* fn = "fp8_transpose";
  check_device(q, "fp8_transpose q");
  check_device(qt, "fp8_transpose qt");
  check_contiguous(q, "fp8_transpose q");
  check_contiguous(qt, "fp8_transpose qt");
  LOOM_CHECK(is_fp8(q.dtype) && qt.dtype == q.dtype, fn, ": q and qt must both be fp8_e4m3 or both fp8_e5m2, got ",
             dtype_name(q.dtype), " and ", dtype_name(qt.dtype));
  LOOM_CHECK(q.ndim == 2 && qt.ndim == 2 && qt.shape[0] == q.shape[1] && qt.shape[1] == q.shape[0],
             fn, ": q ", q.shape_str(), " and qt ", qt.shape_str(), " are not [rows, cols] and [cols, rows]");
  const int64_t rows = q.shape[0], cols = q.shape[1];
  if (rows == 0 || cols == 0) return;
  const uint8_t* qp = q.ptr<const uint8_t>();
  uint8_t* tp = qt.ptr<uint8_t>();
  const bool vec = rows % 16 == 0 && cols % 16 == 0 && aligned_bytes(qp, 16) && aligned_bytes(tp, 16);
  const int64_t tiles_r = (rows + kTransTile - 1) / kTransTile, tiles_c = (cols + kTransTile - 1) / kTransTile;
  const unsigned grid = grid_for(tiles_r * tiles_c, 1);
  transpose_codes_kernel<<<grid, 256, 0, stream>>>(tp, qp, rows, cols, tiles_r, tiles_c, vec);
  LOOM_CUDA_LAUNCH_CHECK(fn, "rows=", rows, " cols=", cols, " vec=", vec, " grid=", grid, " q at ",
                         static_cast<const void*>(qp), ", qt at ", static_cast<const void*>(tp));
}

}  // namespace loom::gpu
