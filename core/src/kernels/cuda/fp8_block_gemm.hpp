// Block-scaled FP8 GEMMs through cuBLASLt (fp8_block_gemm.cpp), the GEMMs of
// the fp8_block recipe (DeepSeek-V3's fine-grained scaling):
//
//   D[m, n] = sum over k blocks kb of  sA(row, kb) * sB(col, kb) * (A[m, kb] B[n, kb]^T)   (+ C, beta = 1)
//
// A [m, k] and B [n, k] row-major E4M3, k contiguous (the TN form of
// fp8_gemm.hpp: cuBLASLt's A is our B, its B our A, so the scale modes and
// pointers swap too); D (and C) bf16 or fp32. Each operand has a scale mode:
//   tile_1x128     one scale inverse per row and 128 k   (CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F)
//   block_128x128  one per 128 rows and 128 k            (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F)
// and a device tensor of scale inverses in loom/fp8_block.hpp's layout
// (scale_index; the casts of fp8_block_kernels.hpp write it), 16-byte aligned.
//
// A linear maps onto it as (fp8_block.hpp):
//   fprop  y  = x W^T  : A = x    (1x128)   B = W  (128x128)   k = in
//   dgrad  dx = dy W   : A = dy   (1x128)   B = W^T (128x128)  k = out
//   wgrad  dW = dy^T x : A = dy^T (1x128)   B = x^T (1x128)    k = tokens
// Measured with cuBLASLt 13.1 on an H100: VEC128 x VEC128 and VEC128 x
// BLK128x128 (either order) are accepted, BLK128x128 on both refused; no
// fast accumulation (block scales are applied at every promotion).
//
// Requirements (each refused with a loom::Error naming the values): m, n, k
// positive multiples of 128; A and B E4M3; not both block_128x128; pointers
// and leading dimensions as Fp8Gemm's. Plans (descriptor, layouts,
// algorithm) are cached per problem key; the scale pointers are set on the
// cached descriptor when they change. One thread per object.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "loom/fp8_block.hpp"
#include "loom/gemm_algo.hpp"
#include "loom/tensor.hpp"

namespace loom::gpu {

struct BlockOperand {
  const Tensor* data = nullptr;      // [rows, k] E4M3
  const float* scale_inv = nullptr;  // scale_floats(mode, rows, k) device floats
  fp8::block::ScaleMode mode = fp8::block::ScaleMode::tile_1x128;
};

class Fp8BlockGemm {
 public:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

  // algo as Fp8Gemm's (loom/gemm_algo.hpp).
  Fp8BlockGemm(void* cublaslt_handle, void* workspace, size_t workspace_bytes, GemmAlgo algo = GemmAlgo::heuristic);
  ~Fp8BlockGemm();
  Fp8BlockGemm(const Fp8BlockGemm&) = delete;
  Fp8BlockGemm& operator=(const Fp8BlockGemm&) = delete;

  void set_workspace(void* workspace, size_t bytes);

  // D = A B^T (+ C when c is given: D itself or a disjoint buffer of D's shape and dtype).
  // varying: a call of a variable-row linear (an MoE expert), whose row count
  // and row-view offsets change from call to call: its plan assumes 16-byte
  // pointer alignment (whatever the pointers' own), so views at other offsets
  // share it, and is never timed (a timing would run mid-training at every
  // new count); one plan per problem shape.
  void gemm(const BlockOperand& a, const BlockOperand& b, Tensor& d, const Tensor* c, cudaStream_t stream,
            bool varying = false);

  int64_t plans_built() const { return plans_built_; }
  int64_t plans_timed() const { return plans_timed_; }  // of those, picked by timing (GemmAlgo::fastest)

  struct Plan;

 private:
  void* handle_;
  void* workspace_;
  size_t workspace_bytes_;
  GemmAlgo algo_ = GemmAlgo::heuristic;
  std::vector<std::unique_ptr<Plan>> plans_;
  int64_t plans_built_ = 0;
  int64_t plans_timed_ = 0;
};

}  // namespace loom::gpu
