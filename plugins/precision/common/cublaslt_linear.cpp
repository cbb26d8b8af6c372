// The three GEMMs of a linear on libloom's cuBLASLt plan cache
// (loom/ops/gemm.hpp), in its row-major form D[m, n] = A B^T:
//
//   fprop  y  = x W^T  : A = x  [rows, in]  (k-major)     B = W [out, in] (k-major)
//   dgrad  dx = dy W   : A = dy [rows, out] (k-major)     B = W as [k = out, n = in]
//   wgrad  dW = dy^T x : A = dy as [k = rows, m = out]    B = x as [k = rows, n = in]
//
// The C input is D itself (beta = 0, or 1 for an accumulated dW) except for
// fprop's residual. A variable-row linear (LinearDesc::variable_rows: the MoE
// experts) varies m in fprop and dgrad, k in wgrad, up to max_rows: the cache
// plans it per bucket of row counts, with the heuristic's answer (timing one
// count's pick gained nothing on mixtral-small, docs/PERFORMANCE-LOG.md).
#include "precision/common/cublaslt_linear.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "loom/error.hpp"
#include "precision/common/residual.hpp"

namespace {
// Per plugin library (each plugin links its own copy of this static library).
std::atomic<int64_t> g_plans_built{0};
}  // namespace

extern "C" int64_t loom_precision_cublaslt_plans_built() { return g_plans_built.load(); }

namespace loom::precision_common {
namespace {

bool gemm_dtype_ok(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

}  // namespace

CublasLtLinears::CublasLtLinears(std::string recipe, GemmDTypes dtypes, GemmAlgo algo)
    : recipe_(std::move(recipe)), dtypes_(dtypes), plans_(nullptr, nullptr, 0, algo) {
  // Fail at construction, not at the first GEMM, for a dtype cuBLASLt cannot take here.
  for (DType t : {dtypes_.activation, dtypes_.param, dtypes_.grad})
    LOOM_CHECK(gemm_dtype_ok(t), "precision ", recipe_, ": dtype ", dtype_name(t),
               " has no cuBLASLt GEMM in this library (fp32, bf16, fp16)");
}

CublasLtLinears::~CublasLtLinears() = default;

int CublasLtLinears::register_linear(const LinearDesc& desc) {
  LOOM_CHECK(desc.in > 0 && desc.out > 0 && desc.max_rows >= 0, "precision ", recipe_, ": linear '", desc.name,
             "' has invalid shape in=", desc.in, " out=", desc.out, " max_rows=", desc.max_rows);
  linears_.push_back(desc);
  what_.push_back({cat(recipe_, ": ", desc.name, ": fprop"), cat(recipe_, ": ", desc.name, ": dgrad"),
                   cat(recipe_, ": ", desc.name, ": wgrad")});
  return static_cast<int>(linears_.size()) - 1;
}

void CublasLtLinears::set_workspace(void* ptr, size_t bytes) {
  LOOM_CHECK(bytes == 0 || ptr != nullptr, "precision ", recipe_, ": set_workspace got ", bytes,
             " bytes at a null pointer");
  LOOM_CHECK(reinterpret_cast<uintptr_t>(ptr) % 256 == 0, "precision ", recipe_,
             ": the cuBLASLt workspace must be 256-byte aligned, got address ", ptr);
  plans_.set_workspace(ptr, bytes);
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
  }
  if (mx.rows == 0) return;
  ops::GemmArgs g;
  g.a = {&x, true};
  g.b = {&w, true};
  g.d = &y;
  g.c = residual;
  g.beta = residual != nullptr ? 1.0f : 0.0f;
  g.varying = ops::GemmVarying::m;
  run(ctx, id, kFprop, g);
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
  if (dx != nullptr) {
    ops::GemmArgs g;
    g.a = {&dy, true};
    g.b = {&w, false};
    g.d = dx;
    g.varying = ops::GemmVarying::m;
    run(ctx, id, kDgrad, g);
  }
  ops::GemmArgs g;
  g.a = {&dy, false};
  g.b = {&x, false};
  g.d = &dw;
  g.beta = accumulate ? 1.0f : 0.0f;
  g.varying = ops::GemmVarying::k;
  run(ctx, id, kWgrad, g);
}

void CublasLtLinears::run(const ExecContext& ctx, int id, Gemm gm, ops::GemmArgs& g) {
  const LinearDesc& d = linears_[static_cast<size_t>(id)];
  if (!d.variable_rows || d.max_rows <= 0) g.varying = ops::GemmVarying::none;
  g.varying_max = d.max_rows;
  g.what = what_[static_cast<size_t>(id)][gm].c_str();
  plans_.set_handle(ctx.blas_handle);
  const int64_t before = plans_.plans_built();
  plans_.gemm(g, ctx.stream);
  g_plans_built += plans_.plans_built() - before;
}

}  // namespace loom::precision_common
