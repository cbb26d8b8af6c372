// Block-scaled FP8 GEMMs through cuBLASLt (fp8_block_gemm.hpp). Plans are
// built on the first call of a problem key and never rebuilt. Messages are
// built only when a check fails.
#include "kernels/cuda/fp8_block_gemm.hpp"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <string>

#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/cublaslt_plan.hpp"
#include "loom/error.hpp"

namespace loom::gpu {
namespace {

namespace blk = fp8::block;

cudaDataType_t out_type(DType t) {
  switch (t) {
    case DType::bf16: return CUDA_R_16BF;
    case DType::f32: return CUDA_R_32F;
    default: break;
  }
  throw Error(cat("fp8_block_gemm: D must be bf16 or fp32, got ", dtype_name(t)));
}

int32_t lt_mode(blk::ScaleMode m) {
  return m == blk::ScaleMode::tile_1x128 ? static_cast<int32_t>(CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F)
                                         : static_cast<int32_t>(CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F);
}

RowMatrix operand(const Tensor& t, const char* what) {
  LOOM_CHECK(t.device == Device::cuda && t.data != nullptr, "fp8_block_gemm: ", what, " ", t.shape_str(),
             " must be a cuda tensor with data, got one on ", device_name(t.device));
  const RowMatrix m = fold_rows(t, "fp8_block_gemm: ", what);
  LOOM_CHECK(alignment_of(t.data) >= 16, "fp8_block_gemm: ", what, " at ", t.data, " is not 16-byte aligned");
  LOOM_CHECK((m.ld * static_cast<int64_t>(dtype_size(t.dtype))) % 16 == 0, "fp8_block_gemm: ", what, " ",
             t.shape_str(), " has a row stride of ", m.ld, " elements, not a multiple of 16 bytes");
  return m;
}

enum Key : int { kM, kN, kK, kLda, kLdb, kLdc, kLdd, kTypeD, kHasC, kModeA, kModeB, kAlA, kAlB, kAlC, kAlD, kKeySize };

}  // namespace

struct Fp8BlockGemm::Plan : gpu::LtMatmulObjects {
  std::array<int64_t, kKeySize> key{};
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_needed = 0;
  const void* lt_a_scale = nullptr;  // cuBLASLt's A = our B
  const void* lt_b_scale = nullptr;  // cuBLASLt's B = our A
};

Fp8BlockGemm::Fp8BlockGemm(void* cublaslt_handle, void* workspace, size_t workspace_bytes, GemmAlgo algo)
    : handle_(cublaslt_handle), workspace_(nullptr), workspace_bytes_(0), algo_(algo) {
  set_workspace(workspace, workspace_bytes);
}

Fp8BlockGemm::~Fp8BlockGemm() = default;

void Fp8BlockGemm::set_workspace(void* workspace, size_t bytes) {
  LOOM_CHECK(bytes == 0 || workspace != nullptr, "fp8_block_gemm: a workspace of ", bytes, " bytes at a null pointer");
  LOOM_CHECK(reinterpret_cast<uintptr_t>(workspace) % 256 == 0,
             "fp8_block_gemm: the cuBLASLt workspace must be 256-byte aligned, got address ", workspace);
  workspace_ = workspace;
  workspace_bytes_ = bytes;
}

void Fp8BlockGemm::gemm(const BlockOperand& a, const BlockOperand& b, Tensor& d, const Tensor* c,
                        cudaStream_t stream, bool varying) {
  LOOM_CHECK(a.data != nullptr && b.data != nullptr, "fp8_block_gemm: an operand has no tensor");
  const Tensor& ta = *a.data;
  const Tensor& tb = *b.data;
  LOOM_CHECK(ta.dtype == DType::e4m3 && tb.dtype == DType::e4m3, "fp8_block_gemm: A and B must be fp8_e4m3, got A ",
             dtype_name(ta.dtype), " ", ta.shape_str(), " and B ", dtype_name(tb.dtype), " ", tb.shape_str());
  LOOM_CHECK(!(a.mode == blk::ScaleMode::block_128x128 && b.mode == blk::ScaleMode::block_128x128),
             "fp8_block_gemm: A ", ta.shape_str(), " and B ", tb.shape_str(),
             " both have 128x128 block scales; cuBLASLt (13.1, Hopper) refuses that pair: give one of them 1x128 "
             "tiles");
  const RowMatrix ma = operand(ta, "A"), mb = operand(tb, "B"), md = operand(d, "D");
  const int64_t m = ma.rows, k = ma.cols, n = mb.rows;
  LOOM_CHECK(mb.cols == k, "fp8_block_gemm: A is [", m, ", ", k, "] but B is [", mb.rows, ", ", mb.cols,
             "]: D = A B^T contracts the last dim of both");
  LOOM_CHECK(md.rows == m && md.cols == n, "fp8_block_gemm: D is [", md.rows, ", ", md.cols, "] but A B^T is [", m,
             ", ", n, "]");
  LOOM_CHECK(m > 0 && n > 0 && k > 0 && m % blk::kBlock == 0 && n % blk::kBlock == 0 && k % blk::kBlock == 0,
             "fp8_block_gemm: m=", m, " n=", n, " k=", k, " must be positive multiples of ", blk::kBlock,
             " (the scale tiles)");
  LOOM_CHECK(a.scale_inv != nullptr && b.scale_inv != nullptr && alignment_of(a.scale_inv) >= 16 &&
                 alignment_of(b.scale_inv) >= 16,
             "fp8_block_gemm: the scale tensors must be 16-byte aligned device floats, got A's at ",
             static_cast<const void*>(a.scale_inv), " and B's at ", static_cast<const void*>(b.scale_inv));
  RowMatrix mc = md;
  if (c != nullptr) {
    LOOM_CHECK(c->dtype == d.dtype, "fp8_block_gemm: C is ", dtype_name(c->dtype), " but D is ", dtype_name(d.dtype));
    mc = operand(*c, "C");
    LOOM_CHECK(mc.rows == m && mc.cols == n, "fp8_block_gemm: C is [", mc.rows, ", ", mc.cols, "] but D is [", m,
               ", ", n, "]");
    LOOM_CHECK(c->data != d.data || mc.ld == md.ld, "fp8_block_gemm: C is D's buffer with another row stride (",
               mc.ld, " vs ", md.ld, ")");
  }
  LOOM_CHECK(handle_ != nullptr && workspace_bytes_ > 0, "fp8_block_gemm: no cuBLASLt handle or workspace (handle ",
             handle_, ", ", workspace_bytes_, " workspace bytes)");
  auto handle = static_cast<cublasLtHandle_t>(handle_);
  // A varying call's plan assumes 16 bytes (what every operand is checked
  // for above), so that row views at any offset share it.
  auto al = [&](const void* p) { return varying ? std::min<int64_t>(alignment_of(p), 16) : alignment_of(p); };
  const std::array<int64_t, kKeySize> key{m, n, k, ma.ld, mb.ld, mc.ld, md.ld, static_cast<int64_t>(d.dtype),
                                          c != nullptr, static_cast<int64_t>(a.mode), static_cast<int64_t>(b.mode),
                                          al(ta.data), al(tb.data), al(c != nullptr ? c->data : d.data), al(d.data)};
  auto where = [&] {
    return cat("fp8_block_gemm D[", m, ",", n, "] (", dtype_name(d.dtype), ", ldd ", md.ld, ") = A[", m, ",", k,
               "] (e4m3, ", blk::name(a.mode), ", lda ", ma.ld, ") B[", n, ",", k, "]^T (e4m3, ", blk::name(b.mode),
               ", ldb ", mb.ld, ")", c != nullptr ? cat(" + C (ldc ", mc.ld, ")") : std::string(),
               "; as cuBLASLt TN: M'=", n, " N'=", m, " K'=", k, ", A scale mode ", lt_mode(b.mode),
               ", B scale mode ", lt_mode(a.mode));
  };
  Plan* plan = nullptr;
  for (auto& p : plans_)
    if (p->key == key) {
      plan = p.get();
      break;
    }
  if (plan == nullptr) {
    auto p = std::make_unique<Plan>();
    p->key = key;
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), where());
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)),
                        where());
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)),
                        where());
    // cuBLASLt's A is our B and its B our A: modes and scale tensors swap.
    const int32_t mode_lt_a = lt_mode(b.mode), mode_lt_b = lt_mode(a.mode);
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_lt_a, sizeof(mode_lt_a)),
        where());
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_lt_b, sizeof(mode_lt_b)),
        where());
    p->lt_a_scale = b.scale_inv;
    p->lt_b_scale = a.scale_inv;
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p->lt_a_scale,
                                                       sizeof(p->lt_a_scale)),
                        where());
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p->lt_b_scale,
                                                       sizeof(p->lt_b_scale)),
                        where());
    LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_8F_E4M3, k, n, mb.ld), where());
    LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_8F_E4M3, k, m, ma.ld), where());
    LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->d, out_type(d.dtype), n, m, md.ld), where());
    if (c != nullptr && mc.ld != md.ld)
      LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->c, out_type(d.dtype), n, m, mc.ld), where());
    cublasLtMatmulPreference_t pref = nullptr;
    LOOM_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref), where());
    struct PrefGuard {
      cublasLtMatmulPreference_t p;
      ~PrefGuard() { cublasLtMatmulPreferenceDestroy(p); }
    } guard{pref};
    const uint64_t ws = workspace_bytes_;
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
        where());
    // The pointers' real alignments (cuBLASLt assumes 256 bytes otherwise); its A is our B.
    const uint32_t al_lt_a = static_cast<uint32_t>(key[kAlB]), al_lt_b = static_cast<uint32_t>(key[kAlA]);
    LOOM_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_lt_a,
                                                             sizeof(al_lt_a)),
                        where());
    LOOM_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_lt_b,
                                                             sizeof(al_lt_b)),
                        where());
    const uint32_t al_c = static_cast<uint32_t>(key[kAlC]), al_d = static_cast<uint32_t>(key[kAlD]);
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)),
        where());
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d)),
        where());
    std::array<cublasLtMatmulHeuristicResult_t, kGemmAlgoCandidates> cand{};
    const bool timed = algo_ == GemmAlgo::fastest && !varying;
    const int want = timed ? kGemmAlgoCandidates : 1;
    int found = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(handle, p->op, p->a, p->b, p->c_layout(), p->d, pref, want, cand.data(), &found);
    const cublasLtMatmulHeuristicResult_t& result = cand[0];
    if (st != CUBLAS_STATUS_SUCCESS || found == 0 || result.state != CUBLAS_STATUS_SUCCESS) {
      int dev = -1, major = 0, minor = 0;
      (void)cudaGetDevice(&dev);
      (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
      (void)cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
      throw Error(cat(where(), ": cuBLASLt has no block-scaled FP8 algorithm for this problem (heuristic status ",
                      cublasLtGetStatusName(st), ", ", found, " found, cuBLASLt ", cublasLtGetVersion(),
                      ") on a compute capability ", major, ".", minor,
                      " GPU; block-scaled FP8 (VEC128_32F / BLK128x128_32F) needs Hopper (9.0) and cuBLASLt 12.9 "
                      "or newer"));
    }
    int pick = 0;
    if (timed) {
      // D (and C where it has a layout of its own) in the scratch; cuBLASLt's D is n x m, leading dimension ldd.
      const size_t es = dtype_size(d.dtype);
      pick = fastest_algorithm(handle, *p, cand.data(), found, tb.data, ta.data, c != nullptr ? 1.0f : 0.0f,
                               static_cast<size_t>(md.ld * m) * es, p->c ? static_cast<size_t>(mc.ld * m) * es : 0,
                               workspace_, workspace_bytes_, stream, where());
      ++plans_timed_;
    }
    p->algo = cand[static_cast<size_t>(pick)].algo;
    p->workspace_needed = cand[static_cast<size_t>(pick)].workspaceSize;
    plan = p.get();
    plans_.push_back(std::move(p));
    ++plans_built_;
  }
  LOOM_CHECK(plan->workspace_needed <= workspace_bytes_, where(), ": the plan needs ", plan->workspace_needed,
             " workspace bytes but set_workspace() now gives ", workspace_bytes_);
  if (plan->lt_a_scale != b.scale_inv) {
    plan->lt_a_scale = b.scale_inv;
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                       &plan->lt_a_scale, sizeof(plan->lt_a_scale)),
                        where());
  }
  if (plan->lt_b_scale != a.scale_inv) {
    plan->lt_b_scale = a.scale_inv;
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                       &plan->lt_b_scale, sizeof(plan->lt_b_scale)),
                        where());
  }
  const float alpha = 1.0f, beta = c != nullptr ? 1.0f : 0.0f;
  const void* c_ptr = c != nullptr ? c->data : d.data;
  const cublasStatus_t st = cublasLtMatmul(handle, plan->op, &alpha, tb.data, plan->a, ta.data, plan->b, &beta, c_ptr,
                                           plan->c_layout(), d.data, plan->d, &plan->algo, workspace_,
                                           workspace_bytes_, stream);
  LOOM_CHECK(st == CUBLAS_STATUS_SUCCESS, where(), ": cublasLtMatmul failed: ", cublasLtGetStatusName(st), " (",
             cublasLtGetStatusString(st), ")");
}

}  // namespace loom::gpu
