// The 128 x 64 tile of an FP8 cast on the GPU, shared by the stand-alone cast
// (fp8_cast.cu's cast_tiles_kernel) and the kernels that write a linear's FP8
// operand themselves instead of a bf16 tensor for the cast to read
// (swiglu.cu's *_fp8 kernels, loom/precision.hpp's Fp8Operand).
//
// 256 threads a tile, 8 warps of 16 rows. A thread holds 4 consecutive rows x
// 8 consecutive columns (a warp: 4 rows x 128 bytes of bf16 per load). It
// encodes them into 4 x 2 words of codes, stores 8 bytes per row of q, and
// builds q_t's words (4 rows of one column) with 4 x 4 byte transposes in
// registers (__byte_perm), so the shared tile is written and read in whole
// words: 32-bit writes, then 16-byte reads that store 128 contiguous bytes of
// a q_t row per 8 threads. The shared tile is swizzled (16-byte group g of q_t
// row c at g ^ (c / 8 % 8)) so that neither side has bank conflicts.
//
// The amax of a tile's values is kept as fp32 |v| bits (unsigned order of
// |v| bits is the order of |v|, NaNs above inf) and leaves the block as one
// atomicMax on the float's bits (block_amax_to).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cuda_common.cuh"
#include "loom/fp8.hpp"

namespace loom::gpu::fp8_tile {

constexpr int kRows = 128;     // rows of x per tile: a q_t row segment of 128 bytes
constexpr int kCols = 64;      // columns of x per tile: a bf16 row segment of 128 bytes
constexpr int kThreads = 256;  // 8 warps x 16 rows; a thread: 4 rows x 8 columns
constexpr uint32_t kInfBits = 0x7F800000u;

// This thread's place in the tile.
struct Lane {
  int cg;    // columns 8 cg .. 8 cg + 7
  int rl0;   // rows rl0 .. rl0 + 3
  int slot;  // the word of those 4 rows in each of its 8 q_t rows, swizzled
};

__device__ __forceinline__ Lane lane() {
  const int l = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int cg = l % 8, rq = l / 8;
  return {cg, warp * 16 + rq * 4, (warp ^ cg) * 4 + rq};
}

// Tile t of a [rows, cols] matrix (tiles_c tiles a row of tiles) as this
// thread sees it: the tile's first row and column, the thread's first row
// and column, and whether its 4 x 8 elements lie inside the matrix (the
// producer kernels take rows % 16 == 0 and cols % 8 == 0, so they lie wholly
// inside or outside).
struct TilePos {
  int64_t r0, c0, r, c;
  bool live;
};

__device__ __forceinline__ TilePos tile_pos(int64_t t, int64_t tiles_c, const Lane& ln, int64_t rows, int64_t cols) {
  TilePos p;
  p.r0 = (t / tiles_c) * kRows;
  p.c0 = (t % tiles_c) * kCols;
  p.r = p.r0 + ln.rl0;
  p.c = p.c0 + ln.cg * 8;
  p.live = p.r < rows && p.c < cols;
  return p;
}

// One tile's transposed codes: 64 rows (x's columns) of 128 bytes (x's rows).
struct Shared {
  uint4 t[kCols * kRows / 16];
};

// Four codes in one word, a lowest byte first, by the hardware conversion
// (PTX cvt.rn.satfinite, sm_89 and later: round to nearest even, saturating
// to ±max, ±inf to ±max), which is loom::fp8::encode bitwise except that a
// NaN may keep its sign: every NaN byte becomes kNaNCode (0x7F), as encode
// makes it. Checked over every fp32 input against encode_fast by
// fp8_encode_mismatches (loom/ops/fp8_cast.hpp).
template <fp8::Format F>
__device__ __forceinline__ uint32_t encode4(float a, float b, float c, float d) {
  uint16_t lo, hi;  // cvt puts its first source in the upper byte
  if constexpr (F == fp8::Format::e4m3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  }
  const uint32_t w = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  // NaN magnitudes: E4M3 0x7F alone, E5M2 0x7D..0x7F (0x7C is inf, never made under satfinite).
  const uint32_t mag = w & 0x7F7F7F7Fu;
  const uint32_t nan = F == fp8::Format::e4m3 ? __vcmpeq4(mag, 0x7F7F7F7Fu) : __vcmpgtu4(mag, 0x7C7C7C7Cu);
  return (w & ~nan) | (0x7F7F7F7Fu & nan);
}

// w[i][h]: the codes of row i, columns 4h .. 4h + 3, lowest byte first.
template <fp8::Format F>
__device__ __forceinline__ void encode(const float (&v)[4][8], float s, uint32_t (&w)[4][2]) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      w[i][h] = encode4<F>(v[i][4 * h] * s, v[i][4 * h + 1] * s, v[i][4 * h + 2] * s, v[i][4 * h + 3] * s);
}

// The 4 rows' codes into q (q at the thread's first row and column; ldq bytes a row).
__device__ __forceinline__ void store_rows(uint8_t* q, int64_t ldq, const uint32_t (&w)[4][2]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) *reinterpret_cast<uint2*>(q + i * ldq) = make_uint2(w[i][0], w[i][1]);
}

// 4 rows x 8 columns of codes (w as encode lays them out) turned into 8
// column words: col[c] holds rows 0..3 of column c, row 0 in the lowest
// byte, by 4 x 4 byte transposes in registers.
__device__ __forceinline__ void transpose4x8(const uint32_t (&w)[4][2], uint32_t (&col)[8]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t lo01 = __byte_perm(w[0][h], w[1][h], 0x5140), hi01 = __byte_perm(w[0][h], w[1][h], 0x7362);
    const uint32_t lo23 = __byte_perm(w[2][h], w[3][h], 0x5140), hi23 = __byte_perm(w[2][h], w[3][h], 0x7362);
    col[4 * h + 0] = __byte_perm(lo01, lo23, 0x5410);
    col[4 * h + 1] = __byte_perm(lo01, lo23, 0x7632);
    col[4 * h + 2] = __byte_perm(hi01, hi23, 0x5410);
    col[4 * h + 3] = __byte_perm(hi01, hi23, 0x7632);
  }
}

// The tile's codes into q_t (qt at q_t row c0, column r0; ldt = x's rows),
// through the shared tile. Every thread of the block calls it (it
// synchronises the block twice). When kBounded, only the first rows_left x
// rows (a multiple of 16) and cols_left x columns of the tile are stored; the
// other threads' words are ignored.
template <bool kBounded>
__device__ __forceinline__ void store_transposed(Shared& sh, const Lane& ln, const uint32_t (&w)[4][2], uint8_t* qt,
                                                 int64_t ldt, int64_t rows_left, int64_t cols_left) {
  uint32_t* words = reinterpret_cast<uint32_t*>(sh.t);
  uint32_t col[8];
  transpose4x8(w, col);
#pragma unroll
  for (int c = 0; c < 8; ++c) words[(ln.cg * 8 + c) * 32 + ln.slot] = col[c];
  __syncthreads();
  // 8 threads per q_t row: 16 bytes each, 128 contiguous bytes in all.
#pragma unroll
  for (int k = 0; k < kCols * kRows / 16 / kThreads; ++k) {
    const int idx = threadIdx.x + k * kThreads, c = idx / 8, g = idx % 8;
    if (kBounded && (c >= cols_left || g * 16 >= rows_left)) continue;
    *reinterpret_cast<uint4*>(qt + c * ldt + g * 16) = sh.t[c * 8 + (g ^ (c / 8 % 8))];
  }
  __syncthreads();  // the next use overwrites the shared tile
}

// |v| bits of fp32 v max-accumulated into m (see above).
__device__ __forceinline__ void amax_add(uint32_t& m, float v) {
  const uint32_t a = __float_as_uint(v) & 0x7FFFFFFFu;
  m = a > m ? a : m;
}

// The |values| of v as a kernel stores them in T (rounded to T first; the
// amax a recipe's cast of that output would measure) into m, when kAmax.
template <typename T, bool kAmax, int K>
__device__ __forceinline__ void amax_add_stored(uint32_t& m, const float (&v)[K]) {
  if constexpr (kAmax) {
#pragma unroll
    for (int k = 0; k < K; ++k) amax_add(m, to_f32(from_f32<T>(v[k])));
  }
}

// Block-wide max of non-negative, non-NaN values, then one atomicMax on the bits.
__device__ __forceinline__ void block_amax_to(float m, float* amax) {
  __shared__ float part[32];
  m = warp_max(m);
  const int l = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (l == 0) part[warp] = m;
  __syncthreads();
  if (warp == 0) {
    float v = l < static_cast<int>(blockDim.x / 32) ? part[l] : 0.0f;
    v = warp_max(v);
    if (l == 0 && v > 0.0f) atomicMax(reinterpret_cast<unsigned int*>(amax), __float_as_uint(v));
  }
}

// The amax bits of a thread as a float for block_amax_to: a NaN counts as +inf.
__device__ __forceinline__ float amax_value(uint32_t bits) {
  return __uint_as_float(bits > kInfBits ? kInfBits : bits);
}

// Blocks for `tiles` tiles of a kernel with `per_sm` resident blocks per SM
// (its occupancy): at most the blocks resident at once on the current
// device, so no block of a second wave runs its whole share of tiles alone at
// the end; and the tiles spread evenly over waves of them (4096 tiles on 792
// slots: 683 blocks of 6, not 792 blocks of which 136 cast a sixth tile while
// the rest wait). `slots` (may be null) gets the resident count, for messages.
inline unsigned grid_for_tiles(int64_t tiles, int per_sm, const char* name, int64_t* slots = nullptr) {
  int dev = 0, sms = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&dev), name);
  LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), name, ": device ", dev);
  const int64_t resident = static_cast<int64_t>(per_sm < 1 ? 1 : per_sm) * (sms < 1 ? 1 : sms);
  if (slots != nullptr) *slots = resident;
  if (tiles < 1) return 1;
  const int64_t waves = (tiles + resident - 1) / resident;
  return static_cast<unsigned>((tiles + waves - 1) / waves);
}

// The checks every producer of an FP8 operand makes on where it writes: q
// [rows, cols] and q_t [cols, rows] contiguous on the device, one FP8 format,
// 16-byte aligned; scale a device float, amax one or null. `fn` names the
// entry point in the message.
inline void check_fp8_dest(const char* fn, const Tensor& q, const Tensor& q_t, int64_t rows, int64_t cols,
                           const float* scale, const float* amax) {
  // q may be empty (no data): only q_t is written (a backward's recomputed x,
  // whose wgrad reads xᵀ alone).
  const bool has_q = q.data != nullptr;
  if (has_q) check_device(q, fn);
  check_device(q_t, fn);
  LOOM_CHECK((q_t.dtype == DType::e4m3 || q_t.dtype == DType::e5m2) && (!has_q || q_t.dtype == q.dtype), fn,
             ": q and q_t must be one FP8 format (fp8_e4m3 or fp8_e5m2), got ",
             has_q ? dtype_name(q.dtype) : "no q", " and ", dtype_name(q_t.dtype));
  LOOM_CHECK(!has_q || (q.ndim == 2 && q.shape[0] == rows && q.shape[1] == cols && q.is_contiguous()), fn,
             ": q must be a contiguous [", rows, ", ", cols, "] tensor, got ", q.shape_str());
  LOOM_CHECK(q_t.ndim == 2 && q_t.shape[0] == cols && q_t.shape[1] == rows && q_t.is_contiguous(), fn,
             ": q_t must be a contiguous [", cols, ", ", rows, "] tensor, got ", q_t.shape_str());
  LOOM_CHECK((!has_q || aligned_bytes(q.data, 16)) && aligned_bytes(q_t.data, 16), fn, ": q at ", q.data, " and q_t at ",
             q_t.data, " must be 16-byte aligned");
  LOOM_CHECK(scale != nullptr && aligned_bytes(scale, 4) && aligned_bytes(amax, 4), fn, ": scale at ",
             static_cast<const void*>(scale), " must be a device float, amax at ", static_cast<const void*>(amax),
             " a device float or null");
}

// Blocks of kThreads threads of `Kernel` resident per SM (at least 1): it
// depends on the kernel alone (its registers and shared memory), so each
// instantiation asks once.
template <auto Kernel>
int blocks_per_sm(const char* name) {
  static const int per_sm = [name] {
    int n = 0;
    LOOM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, kThreads, 0), name,
                    ": occupancy of the tile kernel, ", kThreads, " threads");
    return n < 1 ? 1 : n;
  }();
  return per_sm;
}

}  // namespace loom::gpu::fp8_tile
