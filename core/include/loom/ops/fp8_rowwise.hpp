// Per-row and per-column FP8 casts: torchao's "rowwise" (axiswise) scaling,
// where every row of an operand's k-major view has its own scale taken from
// its own amax over k. The GEMM then applies the inverse scales as outer
// vectors (loom/ops/gemm.hpp, GemmScale::outer). Installed with the SDK; the
// host reference is in libloom (kernels/cpu/fp8_rowwise.cpp), the device
// casts in CUDA builds (kernels/cuda/fp8_rowwise.cu), bitwise equal to it.
//
// For each row r of x [rows, cols] (or column c, for the per-column cast):
//   amax_r  = max_j |x[r, j]| (a NaN counts as +inf)
//   scale_r = rowwise_scale(amax_r): compute_scale(amax_r, max of the format,
//             margin 0) of loom/fp8.hpp, 1 when amax_r is 0 or not finite;
//             with pow2_scales rounded down to a power of two (torchao's
//             round_scales_to_power_of_2), so that 1 / scale is exact
//   q[r, j] = encode(x[r, j] * scale_r) (round to nearest even, saturating)
//   scale_inv[r] = 1 / scale_r
// The per-column cast writes its codes transposed (q_t [cols, rows]): the
// k-major copy an FP8 GEMM contracting over the rows needs (wgrad's x^T and
// dy^T; dgrad's W^T).
#pragma once
#include <cstdint>

#include "loom/fp8.hpp"
#include "loom/tensor.hpp"

namespace loom::ops {

struct RowwiseOptions {
  fp8::Format format = fp8::Format::e4m3;
  bool pow2_scales = true;
};

// The scale of one row from its amax (see above). Host and device.
LOOM_FP8_HD inline float rowwise_scale(float amax, const RowwiseOptions& o) {
  float s = fp8::compute_scale(amax, fp8::max_value(o.format), 0, 1.0f).scale;
  if (o.pow2_scales) {
    // Round down to a power of two: clear the mantissa (s is finite, > 0).
    const uint32_t b = fp8::float_bits(s) & 0xFF800000u;
    s = fp8::bits_float(b == 0 ? 0x00800000u : b);  // never a subnormal scale: FLT_MIN at least
  }
  return s;
}

// Host reference casts over fp32 x [rows, cols] with row stride ld (>= cols).
// q (may be null): [rows, cols] codes; scale_inv: [rows] floats.
void fp8_cast_rowwise_host(const float* x, int64_t rows, int64_t cols, int64_t ld, const RowwiseOptions& o,
                           uint8_t* q, float* scale_inv);
// Per column: q_t (may be null) [cols, rows] codes; scale_inv: [cols] floats.
void fp8_cast_colwise_host(const float* x, int64_t rows, int64_t cols, int64_t ld, const RowwiseOptions& o,
                           uint8_t* q_t, float* scale_inv);

}  // namespace loom::ops

namespace loom::gpu {

// Device casts (CUDA builds; `stream` a cudaStream_t), x [rows, cols] fp32 or
// bf16 (a row view is fine: fold_rows), q / q_t contiguous in the format's
// dtype, scale and scale_inv device floats of rows (per row) or cols (per
// column) each: scale holds the scales afterwards (the per-column cast uses
// it for the amaxes first). Arguments are checked before anything runs.
void fp8_cast_rowwise(const Tensor& x, Tensor& q, float* scale, float* scale_inv, const ops::RowwiseOptions& o,
                      void* stream);
void fp8_cast_colwise(const Tensor& x, Tensor& q_t, float* scale, float* scale_inv, const ops::RowwiseOptions& o,
                      void* stream);

}  // namespace loom::gpu
