// Fine-grained FP8 scaling (DeepSeek-V3): one scale per 1x128 tile of an
// activation or gradient row, one per 128x128 block of a weight, E4M3
// everywhere. The per-tile rule, the scale-tensor layouts cuBLASLt's
// block-scaled GEMMs read, and the host reference casts (core/src/kernels/cpu/
// fp8_block.cpp) that the fp8_block recipe's CPU path runs and the device
// casts (loom/ops/fp8_block_cast.hpp) match bitwise.
//
// Per tile (or block): amax = max |x| over its elements, scale = 448 / amax
// in fp32 (compute_scale of loom/fp8.hpp, margin 0: FLT_MAX when the
// division overflows), code = encode(x * scale) (RNE, saturating to ±448),
// scale_inv = 1 / scale (fp32, correctly rounded), dequantised value =
// decode(code) * scale_inv. A tile whose amax is 0 gets scale 1; one whose
// amax is inf or NaN gets scale 1 too and counts as a non-finite tile.
//
// Operands are row-major [rows, k] with k, the GEMM's contracted dimension,
// contiguous ("K-major", as Fp8Gemm takes them). Dims are multiples of 128.
//
//   1x128 tiles (cuBLASLt VEC128_32F): one scale per row and 128 columns of k.
//   128x128 blocks (cuBLASLt BLK128x128_32F): one per 128 rows x 128 columns.
//
// Scale-tensor layout (scale_index below, the one place to flip if the GPU
// test says otherwise). Sources:
//   - NVIDIA CUDALibrarySamples, cuBLASLt/Common/helpers.h, getScaleTensorSize
//     (inner = the contiguous dim k, outer = rows): "VEC128_32F: return
//     ceildiv(inner, 128) * outer;" and "BLK128x128_32F: return
//     roundoff(ceildiv(inner, 128), 4) * ceildiv(outer, 128);" - the sizes,
//     and that the 128x128 layout pads the k-block count to a multiple of 4,
//     so the k blocks are the contiguous dimension of that layout;
//   - TransformerEngine, transformer_engine/pytorch/csrc/quantizer.cpp,
//     Float8BlockQuantizer::get_scale_shape (the scale_inv it hands to these
//     cuBLASLt modes, m_dim = rows, k_dim = the last dim): block_scaling_dim 2
//     "sinv0 = ceildiv(m_dim, kBlockLen); sinv1 = roundup(ceildiv(k_dim,
//     kBlockLen), 4);", block_scaling_dim 1 "default rowwise scaling factor
//     shape already transpose the scaling factor so it's GEMM_READY ... sinv0 =
//     ceildiv(k_dim, kBlockLen); sinv1 = roundup(m_dim, 4);" - row-major
//     [sinv0, sinv1] tensors: 1x128 scales with the rows contiguous, 128x128
//     scales with the k blocks contiguous.
// So: VEC128    scale of (row r, k block kb) at kb * roundup(rows, 4) + r
//     BLK128x128 scale of (row block rb, k block kb) at rb * roundup(k/128, 4) + kb
// The same layout holds for cuBLASLt's A and B (both K-major in the TN form).
//
// C++17, no exceptions in the __host__ __device__ part.
#pragma once
#include <cstdint>

#include "loom/fp8.hpp"

namespace loom::fp8::block {

constexpr int64_t kBlock = 128;

enum class ScaleMode : uint8_t {
  tile_1x128 = 0,     // cuBLASLt CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
  block_128x128 = 1,  // cuBLASLt CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
};
const char* name(ScaleMode m);

LOOM_FP8_HD constexpr int64_t round_up4(int64_t v) { return (v + 3) / 4 * 4; }

// Where the scale of a tile goes, for an operand [rows, k]: r is the row
// (tile_1x128) or the row block (block_128x128), kb the k block.
LOOM_FP8_HD inline int64_t scale_index(ScaleMode m, int64_t r, int64_t kb, int64_t rows, int64_t k) {
  if (m == ScaleMode::tile_1x128) return kb * round_up4(rows) + r;
  return r * round_up4(k / kBlock) + kb;
}
// Floats of an operand's scale tensor (padding included).
LOOM_FP8_HD inline int64_t scale_floats(ScaleMode m, int64_t rows, int64_t k) {
  if (m == ScaleMode::tile_1x128) return (k / kBlock) * round_up4(rows);
  return ((rows + kBlock - 1) / kBlock) * round_up4(k / kBlock);
}

struct TileScale {
  float scale;
  float scale_inv;
  bool nonfinite;  // amax was inf or NaN (scale 1)
};
// The scale of a tile from its amax (see the file comment).
LOOM_FP8_HD inline TileScale tile_scale(float amax) {
  const ScaleUpdate u = compute_scale(amax, kE4M3Max, 0, 1.0f);
  TileScale t;
  t.scale = u.scale;
  t.scale_inv = 1.0f / u.scale;
  t.nonfinite = !is_finite(amax);
  return t;
}

// ---- Host reference casts (core/src/kernels/cpu/fp8_block.cpp) ----
// x is [rows, cols] fp32 with row stride ld >= cols; rows and cols multiples
// of 128 (a loom::Error names them otherwise). Each returns the number of
// tiles (or blocks) whose amax was not finite. Codes are E4M3.

// 1x128 tiles along cols. q [rows, cols] (may be null); scale_inv in the
// tile_1x128 layout of the operand [rows, cols] (k = cols).
int64_t cast_row_tiles(const float* x, int64_t rows, int64_t cols, int64_t ld, uint8_t* q, float* scale_inv);
// 128x1 tiles along rows (each column of x cut in runs of 128 rows), written
// as the transposed operand: q_t [cols, rows] (may be null) and scale_inv_t in
// the tile_1x128 layout of [cols, rows] (k = rows).
int64_t cast_col_tiles(const float* x, int64_t rows, int64_t cols, int64_t ld, uint8_t* q_t, float* scale_inv_t);
// 128x128 blocks: q [rows, cols] and q_t [cols, rows] (either may be null),
// scale_inv in the block_128x128 layout of [rows, cols] and scale_inv_t in
// that of [cols, rows] (either may be null; the same values, transposed grid).
int64_t cast_blocks(const float* x, int64_t rows, int64_t cols, int64_t ld, uint8_t* q, uint8_t* q_t,
                    float* scale_inv, float* scale_inv_t);
// y [rows, k] = decode(q) * scale_inv of each element's tile, for an operand
// [rows, k] cast with mode m.
void dequantize(const uint8_t* q, int64_t rows, int64_t k, ScaleMode m, const float* scale_inv, float* y);

// Quantise-dequantise into fp32, the values the block-scaled GEMMs see (the
// CPU recipe's emulation): out has x's shape [rows, cols], contiguous.
//   qdq_row_tiles: 1x128 tiles along cols (fprop x, dgrad dy)
//   qdq_col_tiles: 128x1 tiles along rows (wgrad x and dy)
//   qdq_blocks:    128x128 blocks (weights)
int64_t qdq_row_tiles(const float* x, int64_t rows, int64_t cols, int64_t ld, float* out);
int64_t qdq_col_tiles(const float* x, int64_t rows, int64_t cols, int64_t ld, float* out);
int64_t qdq_blocks(const float* x, int64_t rows, int64_t cols, int64_t ld, float* out);

}  // namespace loom::fp8::block
