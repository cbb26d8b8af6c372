// cuBLASLt is column-major; the interface is row-major. A row-major matrix
// M[r, c] with row stride ld is, byte for byte, the column-major matrix M^T
// (c rows, r columns, leading dimension ld). So each row-major product is
// computed as its transpose, with every operand read through that identity:
//
//   fprop  y = x W^T      ->  y^T[n, m]  = W^T^T x^T   : A = W buffer  (k x n, ld k)   op T
//                                                        B = x buffer  (k x m, ld ldx) op N   "TN"
//   dgrad  dx = dy W      ->  dx^T[k, m] = W^T dy^T    : A = W buffer  (k x n, ld k)   op N
//                                                        B = dy buffer (n x m, ld lddy) op N  "NN"
//   wgrad  dW = dy^T x    ->  dW^T[k, n] = x^T dy      : A = x buffer  (k x m, ld ldx) op N
//                                                        B = dy buffer (n x m, ld lddy) op T  "NT"
//
// and D is the column-major view of the row-major output. In cuBLASLt's terms
// D[M', N'] = op(A)[M', K'] op(B)[K', N'] with
//   fprop M'=n N'=m K'=k,  dgrad M'=k N'=m K'=n,  wgrad M'=k N'=n K'=m.
// The C input is D itself (beta = 0, or beta = 1 for an accumulated dW) except
// for fprop's residual: then C is the residual's buffer with its own leading
// dimension, which the plan key holds (C's alignment too).
//
// The hot path (a plan already built) allocates nothing and formats nothing:
// the plan key is a fixed-size array, messages are built only when a check
// fails, and the plans of a (linear, GEMM) slot are a short vector searched in
// place. One thread per object: plans are built without a lock.
//
// A linear whose row count m changes per call (LinearDesc::variable_rows: the
// MoE experts) runs on plans built for a bucket of row counts rather than for
// each m: m rounded up to a multiple of 256, or above 2048 rows of an eighth
// of m's power of two, at most max_rows (gpu::row_bucket). The bucket stands in
// m's place in the plan's key (N' for fprop and dgrad, K' for wgrad); the
// plans are shared by every variable-row linear of the same problem (all
// experts of all layers), and the first call of a problem builds the plans
// of every bucket up to max_rows at once. A call sets its m in the bucket
// plan's layouts (m is always a column count there, so leading dimensions
// stay valid; the plan assumes pointer alignments of at most 16 bytes, since
// row views start at any expert's offset) and asks cublasLtMatmulAlgoCheck
// whether the algorithm runs that problem with the workspace there is; only
// when it does not is an exact plan for that m built, as for any other
// linear. So the row counts of a run build no plans after the first call,
// and the algorithm for a given m is a function of (max_rows, m) alone — a
// resumed run computes the same bits. (One plan for max_rows alone, as
// before, took the heuristic's answer for 4x the rows the experts of
// mixtral-small get: its step was 3% slower, docs/PERFORMANCE-LOG.md, "Mixtral:
// expert GEMM plans per row bucket".)
#include "precision/common/cublaslt_linear.hpp"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>

#include "kernels/cuda/cublaslt_plan.hpp"
#include "loom/error.hpp"
#include "precision/common/residual.hpp"

namespace {
// Per plugin library (each plugin links its own copy of this static library).
std::atomic<int64_t> g_plans_built{0};
}  // namespace

extern "C" int64_t loom_precision_cublaslt_plans_built() { return g_plans_built.load(); }

namespace loom::precision_common {
namespace {

using gpu::alignment_of;
using gpu::row_bucket;

const char* gemm_name(int g) { return g == 0 ? "fprop" : g == 1 ? "dgrad" : "wgrad"; }

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    default: break;
  }
  throw Error(cat("precision: dtype ", dtype_name(t), " has no cuBLASLt GEMM in this library (fp32, bf16, fp16)"));
}

}  // namespace

// Everything cuBLASLt needs to run one GEMM shape, built once.
// (The descriptor and layouts, and their destruction: the core's
// gpu::LtMatmulObjects, kernels/cuda/cublaslt_plan.hpp.)
struct CublasLtLinears::Plan : gpu::LtMatmulObjects {
  // The call shape the plan was built for (M', N', K', leading dims, pointer alignments).
  std::array<int64_t, 11> key{};
  cublasLtMatmulAlgo_t algo{};
  size_t workspace_needed = 0;
  // Variable-row linears (LinearDesc::variable_rows): the plan is built for
  // max_rows; `rows_now` is the row count its layouts hold and the algorithm
  // passed cublasLtMatmulAlgoCheck for (-1: none yet, or the last check failed).
  int64_t rows_now = -1;
};

struct CublasLtLinears::Slot {
  // Per GEMM (fprop, dgrad, wgrad) the plans built so far; one in a training run.
  std::array<std::vector<std::unique_ptr<Plan>>, 3> plans;
};

struct CublasLtLinears::Timed {
  int gemm = 0;
  std::array<int64_t, 11> key{};
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  bool switched = false;  // another answer than the heuristic's first
};

int64_t CublasLtLinears::problems_switched() const {
  int64_t n = 0;
  for (const auto& t : timed_) n += t->switched ? 1 : 0;
  return n;
}

CublasLtLinears::CublasLtLinears(std::string recipe, GemmDTypes dtypes, GemmAlgo algo)
    : recipe_(std::move(recipe)), dtypes_(dtypes), algo_(algo) {
  // Fail at construction, not at the first GEMM, for a dtype cuBLASLt cannot take here.
  cuda_type(dtypes_.activation);
  cuda_type(dtypes_.param);
  cuda_type(dtypes_.grad);
}

CublasLtLinears::~CublasLtLinears() = default;

int CublasLtLinears::register_linear(const LinearDesc& desc) {
  LOOM_CHECK(desc.in > 0 && desc.out > 0 && desc.max_rows >= 0, "precision ", recipe_, ": linear '", desc.name,
             "' has invalid shape in=", desc.in, " out=", desc.out, " max_rows=", desc.max_rows);
  linears_.push_back(desc);
  slots_.push_back(std::make_unique<Slot>());
  return static_cast<int>(linears_.size()) - 1;
}

void CublasLtLinears::set_workspace(void* ptr, size_t bytes) {
  LOOM_CHECK(bytes == 0 || ptr != nullptr, "precision ", recipe_, ": set_workspace got ", bytes,
             " bytes at a null pointer");
  LOOM_CHECK(reinterpret_cast<uintptr_t>(ptr) % 256 == 0, "precision ", recipe_,
             ": the cuBLASLt workspace must be 256-byte aligned, got address ", ptr);
  workspace_ = ptr;
  workspace_bytes_ = bytes;
  workspace_set_ = true;
}

const LinearDesc& CublasLtLinears::lookup(const ExecContext& ctx, int id) const {
  LOOM_CHECK(ctx.device == Device::cuda, "precision ", recipe_, ": called with a ", device_name(ctx.device),
             " context; this plugin object was created for device cuda");
  LOOM_CHECK(ctx.blas_handle != nullptr, "precision ", recipe_,
             ": ExecContext::blas_handle is null (the CUDA backend must hand in its cublasLtHandle_t)");
  LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision ", recipe_, ": linear id ", id,
             " was never registered (", linears_.size(), " linears registered)");
  LOOM_CHECK(workspace_set_, "precision ", recipe_, ": ", linears_[static_cast<size_t>(id)].name,
             ": no cuBLASLt workspace: the core must call set_workspace() with workspace_bytes() = ",
             kWorkspaceBytes, " bytes of device memory before the first GEMM");
  return linears_[static_cast<size_t>(id)];
}

namespace {

RowMatrix row_matrix(const Tensor& t, const char* what, DType want, const char* role, const std::string& recipe,
                     const LinearDesc& d) {
  LOOM_CHECK(t.data != nullptr, "precision ", recipe, ": ", d.name, ": ", what, " has no data");
  LOOM_CHECK(t.dtype == want, "precision ", recipe, ": ", d.name, ": ", what, " must be ", dtype_name(want),
             ", got ", dtype_name(t.dtype), " (the ", recipe, " recipe stores ", role, " in ", dtype_name(want), ")");
  LOOM_CHECK(t.device == Device::cuda, "precision ", recipe, ": ", d.name, ": ", what, " is on ",
             device_name(t.device), "; this plugin object runs its GEMMs on cuda");
  return fold_rows(t, "precision ", recipe, ": ", d.name, ": ", what);
}

// The weight and its gradient are one packed [out, in] matrix (a parameter buffer, never a view).
void check_weight(const Tensor& t, const char* what, DType want, const char* role, const std::string& recipe,
                  const LinearDesc& d) {
  row_matrix(t, what, want, role, recipe, d);
  LOOM_CHECK(t.ndim == 2 && t.shape[0] == d.out && t.shape[1] == d.in && t.is_contiguous(), "precision ", recipe,
             ": ", d.name, ": ", what, " must be a contiguous [out, in] = [", d.out, ",", d.in, "] matrix, got shape ",
             t.shape_str(), " strides [", t.stride[0], ",", t.stride[1], "]");
}

void check_cols(const std::string& recipe, const LinearDesc& d, const RowMatrix& m, int64_t want, const char* what,
                const char* dim) {
  LOOM_CHECK(m.cols == want, "precision ", recipe, ": ", d.name, ": ", what, " has ", m.cols, " columns, expected ",
             dim, "=", want);
}

void check_rows(const std::string& recipe, const LinearDesc& d, const RowMatrix& m, const char* what) {
  LOOM_CHECK(d.max_rows == 0 || m.rows <= d.max_rows, "precision ", recipe, ": ", d.name, ": ", what, " has ",
             m.rows, " rows, more than the max_rows=", d.max_rows, " it was registered with");
}

}  // namespace

void CublasLtLinears::forward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, Tensor& y,
                              const Tensor* residual) {
  const LinearDesc& d = lookup(ctx, id);
  const RowMatrix mx = row_matrix(x, "x", dtypes_.activation, "activations", recipe_, d);
  const RowMatrix my = row_matrix(y, "y", dtypes_.activation, "activations", recipe_, d);
  check_weight(w, "w", dtypes_.param, "parameters", recipe_, d);
  check_rows(recipe_, d, mx, "x");
  check_cols(recipe_, d, mx, d.in, "x", "in");
  check_cols(recipe_, d, my, d.out, "y", "out");
  LOOM_CHECK(my.rows == mx.rows, "precision ", recipe_, ": ", d.name, ": y has ", my.rows, " rows but x has ",
             mx.rows);
  const void* c = y.data;
  int64_t ldc = my.ld;
  if (residual != nullptr) {
    // The residual is the C input (beta = 1): y = x W^T + residual in one pass.
    const RowMatrix mr = row_matrix(*residual, "residual", dtypes_.activation, "activations", recipe_, d);
    LOOM_CHECK(mr.rows == my.rows && mr.cols == my.cols, "precision ", recipe_, ": ", d.name, ": residual is [",
               mr.rows, ", ", mr.cols, "] but y is [", my.rows, ", ", my.cols, "] (the residual must have y's shape)");
    // cuBLASLt computes in place only with C == D and one layout; an
    // out-of-place product reading C where it writes D is undefined.
    LOOM_CHECK(residual_layout_ok(residual->data, mr.ld, y.data, my.ld, my.rows, my.cols,
                                  dtype_size(dtypes_.activation)),
               "precision ", recipe_, ": ", d.name, ": residual overlaps y without being y (residual at ",
               residual->data, " row stride ", mr.ld, ", y at ", y.data, " row stride ", my.ld,
               "): it must be y itself (same data and row stride) or share no element with it");
    c = residual->data;
    ldc = residual->data == y.data ? my.ld : mr.ld;  // one row: fold_rows may report different strides
  }
  if (mx.rows == 0) return;
  matmul(ctx, id, kFprop, d.out, mx.rows, d.in, w.data, d.in, x.data, mx.ld, c, ldc, y.data, my.ld,
         residual != nullptr ? 1.0f : 0.0f);
}

void CublasLtLinears::backward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, const Tensor& dy,
                               Tensor* dx, Tensor& dw, bool accumulate) {
  const LinearDesc& d = lookup(ctx, id);
  const RowMatrix mx = row_matrix(x, "x", dtypes_.activation, "activations", recipe_, d);
  const RowMatrix mdy = row_matrix(dy, "dy", dtypes_.activation, "activations", recipe_, d);
  check_weight(w, "w", dtypes_.param, "parameters", recipe_, d);
  check_weight(dw, "dw", dtypes_.grad, "gradients", recipe_, d);
  check_rows(recipe_, d, mx, "x");
  check_cols(recipe_, d, mx, d.in, "x", "in");
  check_cols(recipe_, d, mdy, d.out, "dy", "out");
  LOOM_CHECK(mdy.rows == mx.rows, "precision ", recipe_, ": ", d.name, ": dy has ", mdy.rows, " rows but x has ",
             mx.rows);
  RowMatrix mdx;
  if (dx != nullptr) {
    mdx = row_matrix(*dx, "dx", dtypes_.activation, "activations", recipe_, d);
    check_cols(recipe_, d, mdx, d.in, "dx", "in");
    LOOM_CHECK(mdx.rows == mx.rows, "precision ", recipe_, ": ", d.name, ": dx has ", mdx.rows, " rows but x has ",
               mx.rows);
  }
  const int64_t m = mx.rows;
  if (m == 0) {
    // No rows: dx is empty and dW = 0 (written) or unchanged (accumulated);
    // cuBLASLt is not asked for a K' = 0 product.
    if (!accumulate) {
      const cudaError_t e = cudaMemsetAsync(dw.data, 0, dw.bytes(), static_cast<cudaStream_t>(ctx.stream));
      LOOM_CHECK(e == cudaSuccess, "precision ", recipe_, ": ", d.name, ": cudaMemsetAsync(dw, 0, ", dw.bytes(),
                 ") failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
    }
    return;
  }
  if (dx != nullptr)
    matmul(ctx, id, kDgrad, d.in, m, d.out, w.data, d.in, dy.data, mdy.ld, dx->data, mdx.ld, dx->data, mdx.ld, 0.0f);
  matmul(ctx, id, kWgrad, d.in, d.out, m, x.data, mx.ld, dy.data, mdy.ld, dw.data, d.in, dw.data, d.in,
         accumulate ? 1.0f : 0.0f);
}

// Builds the plan for `key` (M', N', K', leading dimensions, alignments: see
// matmul) and appends it to `plans`: layouts, the heuristic's algorithm.
// With `candidates`, up to kGemmAlgoCandidates of the heuristic's answers land
// there (their count in *found_out); the plan takes the first.
template <typename Where>
CublasLtLinears::Plan* build_plan(cublasLtHandle_t handle, std::vector<std::unique_ptr<CublasLtLinears::Plan>>& plans,
                                  const std::array<int64_t, 11>& key, cublasOperation_t op_a, cublasOperation_t op_b,
                                  DType ta, DType tb, DType td, size_t workspace_bytes, const Where& where,
                                  cublasLtMatmulHeuristicResult_t* candidates = nullptr, int* found_out = nullptr) {
  using Plan = CublasLtLinears::Plan;
  const int64_t rows = key[0], cols = key[1], inner = key[2], lda = key[3], ldb = key[4], ldd = key[5],
                ldc = key[9];
  Plan* plan = nullptr;
  {
    auto p = std::make_unique<Plan>();
    p->key = key;
    // fp32 accumulation and scaling for every recipe; CUBLAS_COMPUTE_32F never
    // uses TF32 (that would be CUBLAS_COMPUTE_32F_FAST_TF32), so fp32 is exact fp32.
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), where());
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)),
                        where());
    LOOM_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)),
                        where());
    // Stored (pre-op) shapes: op N reads A as M'xK', op T as K'xM'; B likewise with K'xN'.
    const uint64_t a_rows = op_a == CUBLAS_OP_N ? rows : inner, a_cols = op_a == CUBLAS_OP_N ? inner : rows;
    const uint64_t b_rows = op_b == CUBLAS_OP_N ? inner : cols, b_cols = op_b == CUBLAS_OP_N ? cols : inner;
    LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->a, cuda_type(ta), a_rows, a_cols, lda), where());
    LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->b, cuda_type(tb), b_rows, b_cols, ldb), where());
    LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->d, cuda_type(td), rows, cols, ldd), where());
    // C (the residual, or D itself) gets its own layout only where its leading
    // dimension differs: an in-place product (C == D) must pass one layout for both.
    if (ldc != ldd) LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&p->c, cuda_type(td), rows, cols, ldc), where());

    cublasLtMatmulPreference_t pref = nullptr;
    LOOM_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref), where());
    // The preference lives only for the query.
    struct PrefGuard {
      cublasLtMatmulPreference_t p;
      ~PrefGuard() { cublasLtMatmulPreferenceDestroy(p); }
    } guard{pref};
    const uint64_t ws = workspace_bytes;
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
        where());
    // Views into wider buffers need not be 256-byte aligned (cuBLASLt's default
    // assumption): tell the heuristic what the pointers really are.
    const uint32_t al_a = static_cast<uint32_t>(key[6]), al_b = static_cast<uint32_t>(key[7]),
                   al_d = static_cast<uint32_t>(key[8]), al_c = static_cast<uint32_t>(key[10]);
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)),
        where());
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)),
        where());
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)),
        where());
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d)),
        where());

    cublasLtMatmulHeuristicResult_t one{};
    cublasLtMatmulHeuristicResult_t* results = candidates != nullptr ? candidates : &one;
    const int want = candidates != nullptr ? kGemmAlgoCandidates : 1;
    int found = 0;
    LOOM_CUBLASLT_CHECK(
        cublasLtMatmulAlgoGetHeuristic(handle, p->op, p->a, p->b, p->c_layout(), p->d, pref, want, results, &found),
        where());
    LOOM_CHECK(found > 0 && results[0].state == CUBLAS_STATUS_SUCCESS, where(),
               ": cuBLASLt has no algorithm for this problem with a ", workspace_bytes, "-byte workspace");
    p->algo = results[0].algo;
    p->workspace_needed = results[0].workspaceSize;
    if (found_out != nullptr) *found_out = found;
    plan = p.get();
    plans.push_back(std::move(p));
    ++g_plans_built;
  }
  return plan;
}

void CublasLtLinears::matmul(const ExecContext& ctx, int id, Gemm g, int64_t rows, int64_t cols, int64_t inner,
                             const void* a, int64_t lda, const void* b, int64_t ldb, const void* c, int64_t ldc,
                             void* d, int64_t ldd, float beta) {
  auto handle = static_cast<cublasLtHandle_t>(ctx.blas_handle);
  const LinearDesc& desc = linears_[static_cast<size_t>(id)];
  // See the file comment for why these are the ops of each GEMM.
  const cublasOperation_t op_a = g == kFprop ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = g == kWgrad ? CUBLAS_OP_T : CUBLAS_OP_N;
  const DType ta = g == kWgrad ? dtypes_.activation : dtypes_.param;
  const DType tb = dtypes_.activation;
  const DType td = g == kWgrad ? dtypes_.grad : dtypes_.activation;
  const std::array<int64_t, 11> key{rows, cols, inner, lda, ldb, ldd, alignment_of(a), alignment_of(b),
                                    alignment_of(d), ldc, alignment_of(c)};
  // Every message names the linear, the GEMM and the cuBLASLt problem.
  auto where = [&] {
    return cat("precision ", recipe_, ": ", desc.name, ": ", gemm_name(g), " (", op_a == CUBLAS_OP_T ? "T" : "N",
               op_b == CUBLAS_OP_T ? "T" : "N", " column-major D[", rows, ",", cols, "] = op(A) op(B), K=", inner,
               ", lda=", lda, " ldb=", ldb, " ldc=", ldc, " ldd=", ldd, ", A ", dtype_name(ta), " B ",
               dtype_name(tb), " C/D ", dtype_name(td), ", alignments A/B/D/C ", key[6], "/", key[7], "/", key[8],
               "/", key[10], " bytes)");
  };

  auto& plans = slots_[static_cast<size_t>(id)]->plans[g];
  Plan* plan = nullptr;

  // The row count m and where it sits (fprop, dgrad: N' = cols; wgrad: K' = inner).
  const int mi = g == kWgrad ? 2 : 1;
  const int64_t m = g == kWgrad ? inner : cols;
  if (desc.variable_rows && desc.max_rows > 0 && m <= desc.max_rows) {
    std::array<int64_t, 11> vkey = key;
    vkey[static_cast<size_t>(mi)] = row_bucket(m, desc.max_rows);
    // Row views start wherever the previous expert's rows end, so their
    // alignment changes from call to call: the plan assumes at most 16 bytes
    // (what the vectorised kernels need), one plan for every such offset.
    for (size_t i : {size_t{6}, size_t{7}, size_t{8}, size_t{10}}) vkey[i] = std::min<int64_t>(vkey[i], 16);
    auto& shared = variable_plans_[g];
    auto find = [&](const std::array<int64_t, 11>& k) -> Plan* {
      for (auto& p : shared)
        if (p->key == k) return p.get();
      return nullptr;
    };
    Plan* v = find(vkey);
    // The heuristic's answer under every gemm_algo: a pick timed at one row
    // count may not run at another, and each count it cannot run would build
    // a plan mid-training (timing the experts gained nothing on mixtral-small,
    // docs/PERFORMANCE-LOG.md, "cuBLASLt algorithms by timing"). Every bucket
    // of the problem now: later steps' row counts then find theirs built.
    if (v == nullptr) {
      std::array<int64_t, 11> bkey = vkey;
      for (int64_t b = row_bucket(1, desc.max_rows);; b = row_bucket(b + 1, desc.max_rows)) {
        bkey[static_cast<size_t>(mi)] = b;
        if (find(bkey) == nullptr) {
          build_plan(handle, shared, bkey, op_a, op_b, ta, tb, td, workspace_bytes_, where);
          ++plans_built_;
        }
        if (b >= desc.max_rows) break;
      }
      v = find(vkey);
      LOOM_CHECK(v != nullptr, where(), ": no plan for the bucket of ", m, " rows (", vkey[static_cast<size_t>(mi)],
                 ") among those built up to max_rows=", desc.max_rows);
    }
    if (v->rows_now != m) {
      // m is the column count of B and D (and C) for fprop and dgrad, of A and B for wgrad.
      const uint64_t mm = static_cast<uint64_t>(m);
      auto set_cols = [&](cublasLtMatrixLayout_t l) {
        if (l != nullptr)
          LOOM_CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_COLS, &mm, sizeof(mm)),
                              where());
      };
      v->rows_now = -1;
      if (g == kWgrad) {
        set_cols(v->a);
        set_cols(v->b);
      } else {
        set_cols(v->b);
        set_cols(v->d);
        set_cols(v->c);
      }
      cublasLtMatmulHeuristicResult_t chk{};
      const cublasStatus_t st =
          cublasLtMatmulAlgoCheck(handle, v->op, v->a, v->b, v->c_layout(), v->d, &v->algo, &chk);
      if (st == CUBLAS_STATUS_SUCCESS && chk.state == CUBLAS_STATUS_SUCCESS &&
          chk.workspaceSize <= workspace_bytes_) {
        v->rows_now = m;
        v->workspace_needed = chk.workspaceSize;
      }
    }
    if (v->rows_now == m) plan = v;  // else: an exact plan for this m, below
  }
  for (auto& p : plans) {
    if (plan != nullptr) break;
    if (p->key == key && p->rows_now < 0) plan = p.get();
  }
  if (plan == nullptr) {
    // Variable-row linears (the experts) keep the heuristic's answer here
    // too: timing would run at any step and differ from step to step.
    if (algo_ == GemmAlgo::heuristic || desc.variable_rows) {
      plan = build_plan(handle, plans, key, op_a, op_b, ta, tb, td, workspace_bytes_, where);
    } else {
      std::array<cublasLtMatmulHeuristicResult_t, kGemmAlgoCandidates> cand;  // filled by build_plan
      int found = 0;
      plan = build_plan(handle, plans, key, op_a, op_b, ta, tb, td, workspace_bytes_, where, cand.data(), &found);
      // GemmAlgo::fastest: timed once per problem on this call's operands (D
      // and C in a scratch), the pick shared by every later plan of the
      // problem (every layer's).
      const Timed* t = nullptr;
      for (const auto& x : timed_)
        if (x->gemm == g && x->key == key) {
          t = x.get();
          break;
        }
      if (t == nullptr) {
        const size_t es = dtype_size(td);
        const int best = gpu::fastest_algorithm(
            handle, *plan, cand.data(), found, a, b, beta, static_cast<size_t>(ldd * cols) * es,
            plan->c ? static_cast<size_t>(ldc * cols) * es : 0, workspace_, workspace_bytes_,
            static_cast<cudaStream_t>(ctx.stream), where());
        timed_.push_back(std::make_unique<Timed>(Timed{g, key, cand[static_cast<size_t>(best)].algo,
                                                       cand[static_cast<size_t>(best)].workspaceSize, best != 0}));
        t = timed_.back().get();
      }
      plan->algo = t->algo;
      plan->workspace_needed = t->workspace;
    }
    ++plans_built_;
  }
  LOOM_CHECK(plan->workspace_needed <= workspace_bytes_, where(), ": the plan needs ", plan->workspace_needed,
             " workspace bytes but set_workspace() now gives ", workspace_bytes_);

  // Host scalars (cuBLASLt's default pointer mode); beta = 1 accumulates into dW.
  const float alpha = 1.0f;
  LOOM_CUBLASLT_CHECK(cublasLtMatmul(handle, plan->op, &alpha, a, plan->a, b, plan->b, &beta, c, plan->c_layout(), d,
                                     plan->d, &plan->algo, workspace_, workspace_bytes_,
                                     static_cast<cudaStream_t>(ctx.stream)),
                      where());
}

}  // namespace loom::precision_common
