// GEMMs through cuBLASLt for every recipe: one plan cache (GemmPlans) for
// bf16/fp16/fp32, per-tensor FP8, per-row/column ("outer vector") FP8 and
// block-scaled FP8 products. Installed with the SDK; implemented in libloom
// (kernels/cuda/gemm_plans.cpp) in CUDA builds only.
//
// One form, row-major throughout (HF layout):
//
//   D[m, n] = alpha * sum_k sA(i, k) sB(j, k) A(i, k) B(j, k)  (+ beta * C[m, n])
//
// Each operand is a 2-D device tensor (leading dims fold: fold_rows) stored
// "k-major" ([m, k] for A, [n, k] for B, k contiguous) or not ([k, m], [k, n]).
// A linear (W [out, in], x [tokens, in], y/dy [tokens, out]) maps as:
//   fprop  y  = x W^T  : A = x  [tok, in]        B = W [out, in]         (both k-major)
//   dgrad  dx = dy W   : A = dy [tok, out]       B = W as [k=out, n=in]  (B not k-major)
//   wgrad  dW = dy^T x : A = dy as [k=tok, m=out] B = x as [k=tok, n=in] (neither k-major)
// FP8 kernels on sm_89/sm_90 are "TN" only: FP8 operands must be k-major, so
// an FP8 recipe casts the transposed copies it needs (q_t) itself.
//
// Scales (GemmScale), applied to the products as cuBLASLt applies them:
//   none           non-FP8 operands (f32, bf16, f16; A and B of one dtype)
//   tensor         one inverse scale for the whole operand (device float)
//   outer          one inverse scale per row of the operand's k-major view
//                  (m floats for A, n for B): torchao's "rowwise" recipe,
//                  CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F; both operands
//   tile_1x128     one per row and 128 k (DeepSeek-V3; loom/fp8_block.hpp layout)
//   block_128x128  one per 128 rows and 128 k (not on both operands)
//
// Requirements, each refused with one loom::Error naming the values before
// anything runs: FP8 operands e4m3/e5m2 (not both e5m2), m, n, k positive
// multiples of 16 (128 for block scales), 16-byte aligned, row strides
// multiples of 16 bytes; D (and C) bf16 or fp32 for FP8 products, of A's
// dtype otherwise (fp32 D for fp32); C D itself (same row stride) or sharing
// no byte with it.
//
// Plans (descriptor, layouts, algorithm) are cached per problem key (dims,
// leading dims, dtypes, orders, scale modes, C, amax, fast accumulation,
// pointer alignments): a repeated call issues one cublasLtMatmul and
// allocates nothing; the scale and amax pointers are set on the cached
// descriptor only when they change. Linears of one shape share their plans.
// GemmAlgo::fastest times a problem's candidates once, when its plan is built
// (loom/gemm_algo.hpp). A varying dim (an MoE expert's token count: m in
// fprop/dgrad, k in wgrad) is planned per bucket of counts (row_bucket below):
// the first call of a problem builds every bucket's plan up to varying_max
// with the heuristic's answer, untimed; each call sets its own count in the
// bucket plan's layouts and asks cublasLtMatmulAlgoCheck, building an exact
// plan only where that fails. One thread per object.
//
// D amax (FP8 recipes' current scaling of a GEMM's output): *d_amax is
// overwritten with max |D| of this call, by cuBLASLt's AMAX_D_POINTER where it
// takes it, else by an fp8_amax pass over D (amax_fused() says which).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "loom/gemm_algo.hpp"
#include "loom/tensor.hpp"

namespace loom::ops {

// Bumped when GemmArgs or GemmOperand change layout; GemmPlans::gemm refuses
// a GemmArgs whose struct_size is not its own (a caller built against another SDK).
inline constexpr uint32_t kGemmApiVersion = 1;

enum class GemmScale : uint8_t { none = 0, tensor = 1, outer = 2, tile_1x128 = 3, block_128x128 = 4 };
const char* gemm_scale_name(GemmScale s);

struct GemmOperand {
  const Tensor* t = nullptr;  // device tensor (row views allowed)
  bool k_major = true;        // [m or n, k] (true) or [k, m or n] (false)
  GemmScale scale = GemmScale::none;
  const float* scale_inv = nullptr;  // device floats, as `scale` says (null for none)
};

// Which dim changes from call to call (a variable-row linear: an MoE expert).
enum class GemmVarying : uint8_t { none = 0, m = 1, k = 2 };

struct GemmArgs {
  uint32_t struct_size = sizeof(GemmArgs);
  GemmOperand a, b;
  Tensor* d = nullptr;
  const Tensor* c = nullptr;  // null: C is D (beta = 1 accumulates into D)
  float alpha = 1.0f, beta = 0.0f;
  float* d_amax = nullptr;   // FP8 products only: max |D| of this call (see above)
  bool fast_accum = false;   // CUBLASLT_MATMUL_DESC_FAST_ACCUM (FP8 fprop)
  GemmVarying varying = GemmVarying::none;
  int64_t varying_max = 0;   // the largest value of the varying dim (its buckets end there)
  const char* what = "";     // names the call in messages ("fp8_current: layer.3.q_proj: fprop")
};

// The bucket a varying dim's count is planned with: rows (>= 1) rounded up
// to a multiple of 256 up to 2048, above that to an eighth of the largest
// power of two <= rows (at most 12.5% more), never above `most`.
int64_t row_bucket(int64_t rows, int64_t most);

class GemmPlans {
 public:
  // llm.c and TransformerEngine hand cuBLASLt 32 MiB: Hopper kernels need it.
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;
  // cuBLASLt reads per-tensor scale pointers 16-byte aligned (measured on an
  // H100 with cuBLASLt 13.1: a scale 4 bytes past a 16-byte boundary gives
  // CUBLAS_STATUS_NOT_SUPPORTED at run time). A scale that is not is copied
  // (4 bytes, on the GEMM's stream) into one of two aligned slots carved from
  // the workspace's last kScaleSlotBytes; cuBLASLt gets the rest.
  static constexpr size_t kScaleSlotBytes = 256;

  // handle: a cublasLtHandle_t (may be null until set_handle); workspace:
  // device memory, 256-byte aligned (may be null until set_workspace).
  explicit GemmPlans(void* cublaslt_handle = nullptr, void* workspace = nullptr, size_t workspace_bytes = 0,
                     GemmAlgo algo = GemmAlgo::heuristic);
  ~GemmPlans();
  GemmPlans(const GemmPlans&) = delete;
  GemmPlans& operator=(const GemmPlans&) = delete;

  void set_workspace(void* workspace, size_t bytes);
  void set_handle(void* cublaslt_handle) { handle_ = cublaslt_handle; }
  void set_algo(GemmAlgo algo) { algo_ = algo; }
  GemmAlgo algo() const { return algo_; }

  // Runs the product on `stream` (a cudaStream_t). See the file comment.
  void gemm(const GemmArgs& args, void* stream);

  // Plans built (= heuristic queries made) by this object so far.
  int64_t plans_built() const { return plans_built_; }
  // Of those, picked by timing (GemmAlgo::fastest), and how many of the
  // timed ones took another answer than the heuristic's first.
  int64_t plans_timed() const { return plans_timed_; }
  int64_t plans_switched() const { return plans_switched_; }
  // Whether the last call's D amax came from cuBLASLt (false: the fp8_amax
  // pass, or no amax asked for), and its algorithm's workspace need.
  bool amax_fused() const { return last_amax_fused_; }
  size_t last_workspace_needed() const { return last_workspace_needed_; }

  struct Plan;  // gemm_plans.cpp (holds cuBLASLt handles)

 private:
  void* handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;   // cuBLASLt's part
  float* scale_slots_ = nullptr;
  GemmAlgo algo_ = GemmAlgo::heuristic;
  std::vector<std::unique_ptr<Plan>> plans_;
  int64_t plans_built_ = 0, plans_timed_ = 0, plans_switched_ = 0;
  bool last_amax_fused_ = false;
  size_t last_workspace_needed_ = 0;
};

// The per-tensor FP8 product of the fp8_delayed / fp8_current recipes:
// D = a_inv * b_inv * A B^T (+ C, beta 1), A and B k-major.
struct Fp8GemmOptions {
  const Tensor* c = nullptr;  // added with beta = 1; D itself or a disjoint buffer
  float* d_amax = nullptr;
  bool fast_accum = false;
  GemmVarying varying = GemmVarying::none;
  int64_t varying_max = 0;
  const char* what = "";
};
inline void fp8_gemm(GemmPlans& plans, const Tensor& a, const float* a_inv_scale, const Tensor& b,
                     const float* b_inv_scale, Tensor& d, const Fp8GemmOptions& o, void* stream) {
  GemmArgs g;
  g.a = {&a, true, GemmScale::tensor, a_inv_scale};
  g.b = {&b, true, GemmScale::tensor, b_inv_scale};
  g.d = &d;
  g.c = o.c;
  g.beta = o.c != nullptr ? 1.0f : 0.0f;
  g.d_amax = o.d_amax;
  g.fast_accum = o.fast_accum;
  g.varying = o.varying;
  g.varying_max = o.varying_max;
  g.what = o.what;
  plans.gemm(g, stream);
}

// A k-major FP8 operand with its scales (outer, tile_1x128, block_128x128).
struct ScaledOperand {
  const Tensor* data = nullptr;
  const float* scale_inv = nullptr;
  GemmScale mode = GemmScale::tile_1x128;
};
// D = A B^T with per-row/column or block scales (+ C, beta 1). Block-scaled
// products of a varying dim take an exact plan per count (untimed, alignment
// assumed 16 bytes), since the scale tensors' layout follows the dims.
inline void scaled_gemm(GemmPlans& plans, const ScaledOperand& a, const ScaledOperand& b, Tensor& d, const Tensor* c,
                        void* stream, GemmVarying varying = GemmVarying::none, int64_t varying_max = 0,
                        const char* what = "") {
  GemmArgs g;
  g.a = {a.data, true, a.mode, a.scale_inv};
  g.b = {b.data, true, b.mode, b.scale_inv};
  g.d = &d;
  g.c = c;
  g.beta = c != nullptr ? 1.0f : 0.0f;
  g.varying = varying;
  g.varying_max = varying_max;
  g.what = what;
  plans.gemm(g, stream);
}

// Plans built by every GemmPlans in this process (tests prove with it that
// repeated calls reuse their plans).
int64_t gemm_plans_built_total();

}  // namespace loom::ops
