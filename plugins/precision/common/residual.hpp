// The residual C input of Precision::linear_forward (y = x W^T + residual),
// shared by the CPU fp32 path and the cuBLASLt path. Header-only and free of
// CUDA, so the fp32 plugin includes it in CPU-only builds too.
#pragma once
#include <cstddef>
#include <cstdint>

namespace loom::precision_common {

// The residual may be y itself (same start, same row stride: an in-place GEMM,
// cuBLASLt's C == D with one layout) or share no element with y. Anything in
// between is refused: an out-of-place GEMM (and the CPU's row copy into y)
// would read residual elements it has already overwritten. Views of other
// columns of one wide buffer (same row stride, column ranges apart) share no
// element and are fine. rows/cols are y's, ld* row strides in elements, elem
// the element size in bytes. Integer arithmetic only: called on every GEMM.
inline bool residual_layout_ok(const void* residual, int64_t ldr, const void* y, int64_t ldy, int64_t rows,
                               int64_t cols, size_t elem) {
  if (rows <= 0 || cols <= 0) return true;
  if (residual == y) return rows == 1 || ldr == ldy;
  const auto r0 = reinterpret_cast<uintptr_t>(residual), y0 = reinterpret_cast<uintptr_t>(y);
  const auto es = static_cast<uintptr_t>(elem);
  const uintptr_t r1 = r0 + static_cast<uintptr_t>((rows - 1) * ldr + cols) * es;
  const uintptr_t y1 = y0 + static_cast<uintptr_t>((rows - 1) * ldy + cols) * es;
  if (r1 <= y0 || y1 <= r0) return true;  // disjoint byte ranges
  // Overlapping ranges: only interleaved rows of one buffer (same stride, column ranges apart) share nothing.
  if (ldr != ldy || rows == 1) return false;
  const uintptr_t delta = r0 > y0 ? r0 - y0 : y0 - r0;
  if (delta % es != 0) return false;
  const auto off = static_cast<int64_t>((delta / es) % static_cast<uintptr_t>(ldy));
  return off >= cols && ldy - off >= cols;
}

}  // namespace loom::precision_common
