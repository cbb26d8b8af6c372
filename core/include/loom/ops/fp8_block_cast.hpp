// Fine-grained FP8 casts on the GPU (fp8_block_cast.cu): DeepSeek-V3's 1x128
// tiles and 128x128 blocks, E4M3, each tile with its own scale, bitwise the
// host reference casts of loom/fp8_block.hpp (the same amax, scale, codes and
// scale-tensor layout, scale_index there). Plain C++: tests, the benchmark and
// the recipe include it without nvcc.
//
// Inputs x [rows, cols] fp32 or bf16 (a row view is fine: fold_rows), rows and
// cols multiples of 128. Outputs contiguous fp8_e4m3 tensors; scale-inverse
// tensors are device floats, 16-byte aligned (cuBLASLt reads them as its
// A/B scale tensors), scale_floats(mode, rows, k) of them for the operand they
// go with. nonfinite (may be null): a device counter, incremented once per
// tile whose amax is inf or NaN (that tile is cast with scale 1).
//
// Every entry point checks its arguments and throws one loom::Error naming
// the values before anything is launched; every launch is checked.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "loom/tensor.hpp"

namespace loom::gpu {

// 1x128 tiles along cols (fprop x, dgrad dy): q [rows, cols]; scale_inv in the
// tile_1x128 layout of the operand [rows, cols].
void fp8_block_cast_rows(const Tensor& x, Tensor& q, float* scale_inv, uint32_t* nonfinite, cudaStream_t stream);

// 128x1 tiles along rows (wgrad xᵀ and dyᵀ), written transposed: q_t [cols,
// rows]; scale_inv_t in the tile_1x128 layout of the operand [cols, rows].
void fp8_block_cast_cols(const Tensor& x, Tensor& q_t, float* scale_inv_t, uint32_t* nonfinite,
                         cudaStream_t stream);

// Both of the above in one pass over x (the recipe's x and dy casts): q and
// scale_inv as fp8_block_cast_rows, q_t and scale_inv_t as fp8_block_cast_cols,
// bitwise; nonfinite counts the non-finite tiles of both.
void fp8_block_cast_rows_cols(const Tensor& x, Tensor& q, float* scale_inv, Tensor& q_t, float* scale_inv_t,
                              uint32_t* nonfinite, cudaStream_t stream);

// 128x128 blocks (weights): q [rows, cols] and q_t [cols, rows] (either may be
// null, not both); scale_inv in the block_128x128 layout of [rows, cols],
// scale_inv_t in that of [cols, rows] (each given with its tensor).
void fp8_block_cast_blocks(const Tensor& x, Tensor* q, Tensor* q_t, float* scale_inv, float* scale_inv_t,
                           uint32_t* nonfinite, cudaStream_t stream);

}  // namespace loom::gpu
