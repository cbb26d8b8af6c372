// FP8 GEMMs of a linear layer emulated on the CPU: each operand is cast to FP8
// with its scale and back (quantize_dequantize in loom/fp8.hpp), then the
// product runs in fp32 through the CPU GEMMs of loom/cpu_gemm.hpp (fp32
// accumulation). This is the
// reference for the device FP8 GEMMs and the CPU path of the FP8 recipes.
//
// Layout as loom/cpu_gemm.hpp's (the fp32 recipe's): W is
// [n_out, k_in] row-major, y = x W^T; row strides ld* >= the row length so
// views need no copy. m = rows (tokens), k = in features, n = out features.
//
//   forward   y[m, n]  = q(x)[m, k]  q(w)[n, k]^T   (+ y when accumulate)
//   dgrad     dx[m, k] = q(dy)[m, n] q(w)[n, k]
//   wgrad     dw[n, k] = q(dy)[m, n]^T q(x)[m, k]   (+ dw when accumulate)
//
// q(a) = decode(encode(a * scale)) / scale in the operand's format (under the
// "hybrid" formats dy is E5M2, x and w E4M3). Each call returns the amaxes of
// its two unscaled inputs, which the scaling state records (0 for an operand
// passed already cast).
//
// The quantised copies go to a caller's workspace of
// emulated_workspace_floats(m, k, n) floats, so a step allocates nothing.
// Host-only; throws loom::Error on bad shapes.
#pragma once
#include <cstdint>

#include "loom/fp8.hpp"

namespace loom::fp8 {

struct Operand {
  const float* data;
  int64_t ld;   // row stride in elements
  float scale;  // the FP8 value is data * scale
  Format format;
  // data already holds q(a) (a cast made earlier with this scale and format,
  // e.g. a weight cast once per optimizer step, or x saved by the forward):
  // the GEMM reads it as it is, and the amax returned for it is 0.
  bool cast = false;
};

struct OperandAmax {
  float first;   // amax of the first operand (x, or dy for the backward GEMMs)
  float second;  // amax of the second (w, or x for wgrad)
};

int64_t emulated_workspace_floats(int64_t m, int64_t k, int64_t n);

OperandAmax emulated_linear_forward(float* y, int64_t ldy, const Operand& x, const Operand& w, int64_t m, int64_t k,
                                    int64_t n, bool accumulate, float* workspace);
OperandAmax emulated_linear_backward_input(float* dx, int64_t lddx, const Operand& dy, const Operand& w, int64_t m,
                                           int64_t k, int64_t n, float* workspace);
OperandAmax emulated_linear_backward_weight(float* dw, const Operand& dy, const Operand& x, int64_t m, int64_t k,
                                            int64_t n, bool accumulate, float* workspace);

}  // namespace loom::fp8
