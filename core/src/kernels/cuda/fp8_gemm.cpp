// cuBLASLt FP8 GEMMs; the layout mapping and the linear's three GEMMs are in
// fp8_gemm.hpp. Plans are built on the first call of a problem key and never
// rebuilt, except once when cuBLASLt turns down the fused D amax at its first
// run (then the plan drops AMAX_D_POINTER and measures D with fp8_amax).
// Messages are built only when a check fails.
//
// A call with a varying dim (Fp8GemmOptions::varying: an MoE expert's token
// count) is keyed by a bucket of that dim instead (row_bucket in
// cublaslt_plan.hpp, at most varying_max; pointer alignments capped at 16
// bytes): the plan is built for the bucket's value with the heuristic's
// first answer, then each call sets
// its own value (and, for k, the leading dimensions of the transposed
// operands, which k is) in the layouts and asks cublasLtMatmulAlgoCheck
// whether the algorithm runs it; only where it does not is an exact plan
// built. Exact plans for every count, each timed under "fastest", made an
// FP8 Mixtral step 5x slower than bf16's (docs/PERFORMANCE-LOG.md, "FP8 on
// the experts").
#include "kernels/cuda/fp8_gemm.hpp"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <string>

#include "kernels/cuda/cuda_check.hpp"
#include "kernels/cuda/cublaslt_plan.hpp"
#include "kernels/cuda/fp8_kernels.hpp"
#include "loom/error.hpp"

namespace loom::gpu {
namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::e4m3: return CUDA_R_8F_E4M3;
    case DType::e5m2: return CUDA_R_8F_E5M2;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f32: return CUDA_R_32F;
    default: break;
  }
  throw Error(cat("fp8_gemm: dtype ", dtype_name(t), " has no role in an FP8 GEMM"));
}

bool is_fp8(DType t) { return t == DType::e4m3 || t == DType::e5m2; }

// Bytes [first, last) a row matrix touches.
struct Span {
  uintptr_t first, last;
};
Span span_of(const void* p, const RowMatrix& m, size_t elem) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  return {a, a + static_cast<uintptr_t>(((m.rows - 1) * m.ld + m.cols) * static_cast<int64_t>(elem))};
}

// Key layout (every entry an int64).
// clang-format off
enum Key : int {
  kM, kN, kK, kLda, kLdb, kLdc, kLdd, kTypeA, kTypeB, kTypeD, kHasC, kWantAmax, kFast,
  kAlA, kAlB, kAlC, kAlD, kVarying, kKeySize
};
// clang-format on

}  // namespace

struct Fp8Gemm::Plan : gpu::LtMatmulObjects {
  std::array<int64_t, kKeySize> key{};
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_needed = 0;
  bool amax_fused = false;  // AMAX_D_POINTER set on op
  bool ran = false;         // a cublasLtMatmul succeeded with this plan
  // A bucket plan (key[kVarying] 1 or 2): the call dims its layouts hold and
  // its algorithm passed cublasLtMatmulAlgoCheck for (now_m -1: none yet).
  int64_t now_m = -1, now_k = -1, now_lda = -1, now_ldb = -1;
  // The pointers last set on `op` (set again only when a call brings others).
  const void* lt_a_scale = nullptr;
  const void* lt_b_scale = nullptr;
  void* amax = nullptr;
};

Fp8Gemm::Fp8Gemm(void* cublaslt_handle, void* workspace, size_t workspace_bytes, GemmAlgo algo)
    : handle_(cublaslt_handle), workspace_(nullptr), workspace_bytes_(0), algo_(algo) {
  set_workspace(workspace, workspace_bytes);
}

Fp8Gemm::~Fp8Gemm() = default;

void Fp8Gemm::set_workspace(void* workspace, size_t bytes) {
  LOOM_CHECK(bytes == 0 || workspace != nullptr, "fp8_gemm: a workspace of ", bytes, " bytes at a null pointer");
  LOOM_CHECK(reinterpret_cast<uintptr_t>(workspace) % 256 == 0, "fp8_gemm: the cuBLASLt workspace must be 256-byte ",
             "aligned, got address ", workspace);
  workspace_ = workspace;
  // The last kScaleSlotBytes hold the aligned scale copies (fp8_gemm.hpp);
  // cuBLASLt gets the rest.
  if (bytes > kScaleSlotBytes) {
    scale_slots_ = reinterpret_cast<float*>(static_cast<char*>(workspace) + bytes - kScaleSlotBytes);
    workspace_bytes_ = bytes - kScaleSlotBytes;
  } else {
    scale_slots_ = nullptr;
    workspace_bytes_ = 0;
  }
}

namespace {

RowMatrix operand(const Tensor& t, const char* what, const char* role) {
  LOOM_CHECK(t.device == Device::cuda, "fp8_gemm: ", what, " ", t.shape_str(), " is on ", device_name(t.device),
             "; FP8 GEMMs run on cuda tensors");
  LOOM_CHECK(t.data != nullptr, "fp8_gemm: ", what, " ", t.shape_str(), " has no data");
  const RowMatrix m = fold_rows(t, "fp8_gemm: ", what);
  LOOM_CHECK(alignment_of(t.data) >= 16, "fp8_gemm: ", what, " at ", t.data,
             " is not 16-byte aligned; cuBLASLt FP8 kernels need 16-byte aligned ", role,
             " (allocate it at a 16-byte boundary or copy it)");
  LOOM_CHECK((m.ld * static_cast<int64_t>(dtype_size(t.dtype))) % 16 == 0, "fp8_gemm: ", what, " ", t.shape_str(), " (",
             dtype_name(t.dtype), ") has a row stride of ", m.ld,
             " elements, not a multiple of 16 bytes, which cuBLASLt FP8 kernels need");
  return m;
}

void check_dim(int64_t v, const char* name, const char* hint) {
  LOOM_CHECK(v > 0 && v % 16 == 0, "fp8_gemm: ", name, " = ", v,
             " is not a positive multiple of 16, which cuBLASLt FP8 GEMMs need (", hint, ")");
}

}  // namespace

void Fp8Gemm::gemm(const Tensor& a, const float* a_inv_scale, const Tensor& b, const float* b_inv_scale, Tensor& d,
                   const Fp8GemmOptions& opt, cudaStream_t stream) {
  // ---- arguments, all checked before anything runs ----
  LOOM_CHECK(is_fp8(a.dtype) && is_fp8(b.dtype), "fp8_gemm: A and B must be fp8_e4m3 or fp8_e5m2, got A ",
             dtype_name(a.dtype), " ", a.shape_str(), " and B ", dtype_name(b.dtype), " ", b.shape_str(),
             " (cast them with fp8_cast)");
  LOOM_CHECK(!(a.dtype == DType::e5m2 && b.dtype == DType::e5m2), "fp8_gemm: A ", a.shape_str(), " and B ",
             b.shape_str(), " are both fp8_e5m2; cuBLASLt has no E5M2 x E5M2 kernel. Cast one of them (the weight ",
             "or the activation) to E4M3, as the hybrid recipe does: only gradients are E5M2");
  LOOM_CHECK(d.dtype == DType::bf16 || d.dtype == DType::f32, "fp8_gemm: D must be bf16 or fp32, got ",
             dtype_name(d.dtype), " ", d.shape_str());
  const RowMatrix ma = operand(a, "A", "operands");
  const RowMatrix mb = operand(b, "B", "operands");
  const RowMatrix md = operand(d, "D", "outputs");
  const int64_t m = ma.rows, k = ma.cols, n = mb.rows;
  LOOM_CHECK(mb.cols == k, "fp8_gemm: A is [", m, ", ", k, "] but B is [", mb.rows, ", ", mb.cols,
             "]: D = A B^T contracts the last dim of both (k = ", k, ")");
  LOOM_CHECK(md.rows == m && md.cols == n, "fp8_gemm: D is [", md.rows, ", ", md.cols, "] but A B^T is [", m, ", ", n,
             "] (A ", a.shape_str(), ", B ", b.shape_str(), ")");
  check_dim(m, "m (rows of A and D)", "pad the token count, or the output features, to a multiple of 16");
  check_dim(n, "n (rows of B, columns of D)", "the linear's output or input features");
  check_dim(k, "k (columns of A and B)", "the contracted features or tokens");
  LOOM_CHECK(a_inv_scale != nullptr && b_inv_scale != nullptr, "fp8_gemm: the inverse scales must be device floats, ",
             "got a_inv_scale ", static_cast<const void*>(a_inv_scale), " and b_inv_scale ",
             static_cast<const void*>(b_inv_scale));
  LOOM_CHECK(alignment_of(a_inv_scale) >= 4 && alignment_of(b_inv_scale) >= 4 && alignment_of(opt.d_amax) >= 4,
             "fp8_gemm: scale and amax pointers must be 4-byte aligned device floats, got a_inv_scale ",
             static_cast<const void*>(a_inv_scale), " b_inv_scale ", static_cast<const void*>(b_inv_scale), " d_amax ",
             static_cast<const void*>(opt.d_amax));
  RowMatrix mc = md;
  if (opt.c != nullptr) {
    const Tensor& c = *opt.c;
    LOOM_CHECK(c.dtype == d.dtype, "fp8_gemm: C is ", dtype_name(c.dtype), " but D is ", dtype_name(d.dtype),
               "; cuBLASLt takes C in D's dtype when D is not FP8");
    mc = operand(c, "C", "outputs");
    LOOM_CHECK(mc.rows == m && mc.cols == n, "fp8_gemm: C is [", mc.rows, ", ", mc.cols, "] but D is [", m, ", ", n,
               "]; C must have D's shape");
    const size_t es = dtype_size(d.dtype);
    if (c.data == d.data) {
      LOOM_CHECK(mc.ld == md.ld, "fp8_gemm: C is D's buffer with another row stride (", mc.ld, " vs ", md.ld,
                 "); an in-place GEMM needs one layout");
    } else {
      const Span sc = span_of(c.data, mc, es), sd = span_of(d.data, md, es);
      LOOM_CHECK(sc.last <= sd.first || sd.last <= sc.first, "fp8_gemm: C at ", c.data, " (row stride ", mc.ld,
                 ") overlaps D at ", d.data, " (row stride ", md.ld,
                 ") without being D; it must be D itself or share no byte with it");
    }
  }
  LOOM_CHECK(handle_ != nullptr, "fp8_gemm: no cuBLASLt handle (the Fp8Gemm was made with a null handle)");
  LOOM_CHECK(workspace_bytes_ > 0, "fp8_gemm: no workspace; call set_workspace() with ", kWorkspaceBytes,
             " bytes of device memory (Hopper's FP8 kernels need one)");

  // cuBLASLt reads the scales 16-byte aligned: copy a scale that is not into
  // its slot, in stream order before the GEMM (one object per stream).
  if (alignment_of(a_inv_scale) < 16) {
    LOOM_CUDA_CHECK(cudaMemcpyAsync(scale_slots_, a_inv_scale, sizeof(float), cudaMemcpyDeviceToDevice, stream),
                    "fp8_gemm: copy of the A inverse scale at ", static_cast<const void*>(a_inv_scale),
                    " to its 16-byte aligned slot");
    a_inv_scale = scale_slots_;
  }
  if (alignment_of(b_inv_scale) < 16) {
    LOOM_CUDA_CHECK(cudaMemcpyAsync(scale_slots_ + 4, b_inv_scale, sizeof(float), cudaMemcpyDeviceToDevice, stream),
                    "fp8_gemm: copy of the B inverse scale at ", static_cast<const void*>(b_inv_scale),
                    " to its 16-byte aligned slot");
    b_inv_scale = scale_slots_ + 4;
  }
  auto handle = static_cast<cublasLtHandle_t>(handle_);
  const bool want_amax = opt.d_amax != nullptr;
  // clang-format off
  std::array<int64_t, kKeySize> key{
      m, n, k, ma.ld, mb.ld, mc.ld, md.ld,
      static_cast<int64_t>(a.dtype), static_cast<int64_t>(b.dtype), static_cast<int64_t>(d.dtype),
      opt.c != nullptr, want_amax, opt.fast_accum,
      alignment_of(a.data), alignment_of(b.data), alignment_of(opt.c != nullptr ? opt.c->data : d.data),
      alignment_of(d.data), 0};
  // clang-format on
  // A varying dim within its bound: the bucket's plan (file comment). For k,
  // the transposed operands' leading dimensions are k too.
  std::array<int64_t, kKeySize> exact = key;  // a varying call's fallback (below)
  exact[kVarying] = 3;
  const bool vary_m = opt.varying == Fp8Varying::m && m <= opt.varying_max;
  const bool vary_k = opt.varying == Fp8Varying::k && k <= opt.varying_max;
  const int64_t bucket = vary_m ? row_bucket(m, opt.varying_max) : vary_k ? row_bucket(k, opt.varying_max) : 0;
  if (vary_m || vary_k) {
    key[vary_m ? kM : kK] = bucket;
    if (vary_k) {  // the plan's layouts hold k = bucket rows: a leading dimension below it would be invalid
      key[kLda] = ma.ld == k ? bucket : std::max(ma.ld, bucket);
      key[kLdb] = mb.ld == k ? bucket : std::max(mb.ld, bucket);
    }
    for (int i : {kAlA, kAlB, kAlC, kAlD}) key[i] = key[i] < 16 ? key[i] : 16;
    key[kVarying] = vary_m ? 1 : 2;
  }
  auto where = [&] {
    return cat("fp8_gemm D[", m, ",", n, "] (", dtype_name(d.dtype), ", ldd ", md.ld, ") = A[", m, ",", k, "] (",
               dtype_name(a.dtype), ", lda ", ma.ld, ") B[", n, ",", k, "]^T (", dtype_name(b.dtype), ", ldb ", mb.ld,
               ")", opt.c != nullptr ? cat(" + C (ldc ", mc.ld, ")") : std::string(), want_amax ? ", D amax" : "",
               opt.fast_accum ? ", fast accumulation" : "", "; as cuBLASLt TN: M'=", n, " N'=", m, " K'=", k);
  };

  auto find = [&](const std::array<int64_t, kKeySize>& k_) -> Plan* {
    for (auto& p : plans_)
      if (p->key == k_) return p.get();
    return nullptr;
  };
  Plan* plan = find(key);

  // (Re)creates the matmul descriptor and picks the algorithm; with_amax asks
  // cuBLASLt for D's amax. Returns false when with_amax finds no algorithm.
  auto configure = [&](Plan& p, bool with_amax) -> bool {
    p.destroy_op();
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), where());
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)),
                        where());
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)),
                        where());
    const int8_t fast = opt.fast_accum ? 1 : 0;
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)),
                        where());
    // cuBLASLt's A is our B and its B our A (fp8_gemm.hpp): the scales swap too.
    p.lt_a_scale = b_inv_scale;
    p.lt_b_scale = a_inv_scale;
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p.lt_a_scale, sizeof(p.lt_a_scale)),
        where());
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p.lt_b_scale, sizeof(p.lt_b_scale)),
        where());
    p.amax = with_amax ? opt.d_amax : nullptr;
    p.amax_fused = with_amax;
    if (with_amax)
      LOOM_CUBLASLT_CHECK(
          cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &p.amax, sizeof(p.amax)), where());

    cublasLtMatmulPreference_t pref = nullptr;
    LOOM_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref), where());
    struct PrefGuard {
      cublasLtMatmulPreference_t p;
      ~PrefGuard() { cublasLtMatmulPreferenceDestroy(p); }
    } guard{pref};
    const uint64_t ws = workspace_bytes_;
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)), where());
    const uint32_t al_lt_a = static_cast<uint32_t>(p.key[kAlB]), al_lt_b = static_cast<uint32_t>(p.key[kAlA]),
                   al_c = static_cast<uint32_t>(p.key[kAlC]), al_d = static_cast<uint32_t>(p.key[kAlD]);
    LOOM_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_lt_a,
                                                             sizeof(al_lt_a)),
                        where());
    LOOM_CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_lt_b,
                                                             sizeof(al_lt_b)),
                        where());
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)),
        where());
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d)),
        where());
    std::array<cublasLtMatmulHeuristicResult_t, kGemmAlgoCandidates> cand{};
    const int want = algo_ == GemmAlgo::fastest && p.key[kVarying] == 0 ? kGemmAlgoCandidates : 1;
    int found = 0;
    const cublasStatus_t st =
        cublasLtMatmulAlgoGetHeuristic(handle, p.op, p.a, p.b, p.c_layout(), p.d, pref, want, cand.data(), &found);
    const cublasLtMatmulHeuristicResult_t& result = cand[0];
    if (with_amax && (st != CUBLAS_STATUS_SUCCESS || found == 0 || result.state != CUBLAS_STATUS_SUCCESS)) return false;
    if (st != CUBLAS_STATUS_SUCCESS || found == 0 || result.state != CUBLAS_STATUS_SUCCESS) {
      int dev = -1, major = 0, minor = 0;
      // For the message only: a failure here leaves the -1/0 placeholders in it.
      (void)cudaGetDevice(&dev);
      (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
      (void)cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
      throw Error(cat(where(), ": cuBLASLt has no FP8 algorithm for this problem (heuristic status ",
                      cublasLtGetStatusName(st), ", ", found, " found) with a ", workspace_bytes_,
                      "-byte workspace on a compute capability ", major, ".", minor,
                      " GPU; FP8 GEMMs need 8.9 or newer"));
    }
    int pick = 0;
    if (algo_ == GemmAlgo::fastest && p.key[kVarying] == 0) {
      // D (and C where it has a layout of its own) in the scratch; cuBLASLt's D is n x m, leading dimension ldd.
      const size_t es = dtype_size(d.dtype);
      pick = fastest_algorithm(handle, p, cand.data(), found, b.data, a.data, opt.c != nullptr ? 1.0f : 0.0f,
                               static_cast<size_t>(md.ld * m) * es, p.c ? static_cast<size_t>(mc.ld * m) * es : 0,
                               workspace_, workspace_bytes_, stream, where());
    }
    p.algo = cand[static_cast<size_t>(pick)].algo;
    p.workspace_needed = cand[static_cast<size_t>(pick)].workspaceSize;
    return true;
  };

  // Builds the plan of `pkey`, whose m, k and leading dimensions of A and B
  // it takes from the key (a bucket's plan: the bucket's values).
  auto build = [&](const std::array<int64_t, kKeySize>& pkey) {
    auto p = std::make_unique<Plan>();
    p->key = pkey;
    const int64_t pm = pkey[kM], pk = pkey[kK];
    // Column-major layouts of the buffers (fp8_gemm.hpp): cuBLASLt A = our B
    // stored k x n, B = our A stored k x m, D (and C) n x m.
    LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->a, cuda_type(b.dtype), pk, n, pkey[kLdb]), where());
    LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->b, cuda_type(a.dtype), pk, pm, pkey[kLda]), where());
    LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->d, cuda_type(d.dtype), n, pm, md.ld), where());
    if (opt.c != nullptr && mc.ld != md.ld)
      LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->c, cuda_type(d.dtype), n, pm, mc.ld), where());
    if (!configure(*p, want_amax)) configure(*p, false);
    Plan* raw = p.get();
    plans_.push_back(std::move(p));
    ++plans_built_;
    return raw;
  };
  if (plan == nullptr) plan = build(key);
  if (key[kVarying] != 0 && (plan->now_m != m || plan->now_k != k || plan->now_lda != ma.ld || plan->now_ldb != mb.ld)) {
    // This call's m or k (and leading dimensions) in the bucket plan's layouts.
    auto set = [&](cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr, int64_t v) {
      if (l == nullptr) return;
      const uint64_t u = static_cast<uint64_t>(v);
      LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(l, attr, &u, sizeof(u)), where());
    };
    plan->now_m = -1;
    set(plan->a, CUBLASLT_MATRIX_LAYOUT_ROWS, k);
    set(plan->a, CUBLASLT_MATRIX_LAYOUT_LD, mb.ld);
    set(plan->b, CUBLASLT_MATRIX_LAYOUT_ROWS, k);
    set(plan->b, CUBLASLT_MATRIX_LAYOUT_COLS, m);
    set(plan->b, CUBLASLT_MATRIX_LAYOUT_LD, ma.ld);
    set(plan->d, CUBLASLT_MATRIX_LAYOUT_COLS, m);
    set(plan->c, CUBLASLT_MATRIX_LAYOUT_COLS, m);
    cublasLtMatmulHeuristicResult_t chk{};
    const cublasStatus_t st =
        cublasLtMatmulAlgoCheck(handle, plan->op, plan->a, plan->b, plan->c_layout(), plan->d, &plan->algo, &chk);
    if (st == CUBLAS_STATUS_SUCCESS && chk.state == CUBLAS_STATUS_SUCCESS && chk.workspaceSize <= workspace_bytes_) {
      plan->now_m = m;
      plan->now_k = k;
      plan->now_lda = ma.ld;
      plan->now_ldb = mb.ld;
      plan->workspace_needed = chk.workspaceSize;
    } else {
      // The bucket's algorithm does not run this count: an exact plan for it
      // (the heuristic's answer; kVarying 3 keeps it apart from other calls' keys).
      plan = find(exact);
      if (plan == nullptr) plan = build(exact);
    }
  }
  LOOM_CHECK(plan->workspace_needed <= workspace_bytes_, where(), ": the plan needs ", plan->workspace_needed,
             " workspace bytes but set_workspace() now gives ", workspace_bytes_);

  // Per-call pointers on the cached descriptor, set only when they change.
  if (plan->lt_a_scale != b_inv_scale) {
    plan->lt_a_scale = b_inv_scale;
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                       &plan->lt_a_scale, sizeof(plan->lt_a_scale)),
                        where());
  }
  if (plan->lt_b_scale != a_inv_scale) {
    plan->lt_b_scale = a_inv_scale;
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                       &plan->lt_b_scale, sizeof(plan->lt_b_scale)),
                        where());
  }
  if (plan->amax_fused && plan->amax != opt.d_amax) {
    plan->amax = opt.d_amax;
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &plan->amax, sizeof(plan->amax)),
        where());
  }

  // Host scalars (default pointer mode); beta = 1 adds C.
  const float alpha = 1.0f, beta = opt.c != nullptr ? 1.0f : 0.0f;
  const void* c_ptr = opt.c != nullptr ? opt.c->data : d.data;
  auto run = [&] {
    return cublasLtMatmul(handle, plan->op, &alpha, b.data, plan->a, a.data, plan->b, &beta, c_ptr, plan->c_layout(),
                          d.data, plan->d, &plan->algo, workspace_, workspace_bytes_, stream);
  };
  // The amax slot starts at 0 either way: cuBLASLt's documentation says it
  // sets the value, but a max-accumulating implementation must not keep an
  // older, larger one, and the fp8_amax fallback max-accumulates.
  if (want_amax)
    LOOM_CUDA_CHECK(cudaMemsetAsync(opt.d_amax, 0, sizeof(float), stream), "fp8_gemm: zero the D amax slot at ",
                    static_cast<const void*>(opt.d_amax));
  cublasStatus_t st = run();
  if (st != CUBLAS_STATUS_SUCCESS && plan->amax_fused && !plan->ran &&
      (st == CUBLAS_STATUS_INVALID_VALUE || st == CUBLAS_STATUS_NOT_SUPPORTED)) {
    // cuBLASLt turned the fused amax down at run time (the heuristic does not
    // always check it): measure D after the GEMM instead.
    configure(*plan, false);
    LOOM_CHECK(plan->workspace_needed <= workspace_bytes_, where(), ": the plan needs ", plan->workspace_needed,
               " workspace bytes but set_workspace() now gives ", workspace_bytes_);
    st = run();
  }
  LOOM_CHECK(st == CUBLAS_STATUS_SUCCESS, where(), ": cublasLtMatmul failed: ", cublasLtGetStatusName(st), " (",
             cublasLtGetStatusString(st), ")");
  plan->ran = true;
  if (want_amax && !plan->amax_fused) fp8_amax(d, opt.d_amax, stream);
  last_amax_fused_ = want_amax && plan->amax_fused;
  last_workspace_needed_ = plan->workspace_needed;
}

}  // namespace loom::gpu
