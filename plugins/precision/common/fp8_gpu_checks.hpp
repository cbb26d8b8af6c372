// The argument checks both GPU FP8 recipes (fp8_recipe_gpu.cpp: fp8_delayed,
// fp8_current; fp8_block_gpu.cpp) run on every call and at set-up, with one
// wording: each throws a loom::Error naming the recipe, the linear and the
// value, and formats nothing unless it fails.
#pragma once
#include <cstdint>
#include <string>

#include "loom/context.hpp"
#include "loom/error.hpp"
#include "loom/precision.hpp"
#include "loom/tensor.hpp"

namespace loom::fp8_gpu_checks {

// The context a GPU recipe's call came with, and the linear id it names
// (`registered` linears so far).
inline void call(const std::string& plugin, const ExecContext& ctx, int id, size_t registered) {
  LOOM_CHECK(ctx.device == Device::cuda, "precision ", plugin, ": called with a ", device_name(ctx.device),
             " context; this plugin object was created for device cuda");
  LOOM_CHECK(ctx.blas_handle != nullptr, "precision ", plugin,
             ": ExecContext::blas_handle is null (the CUDA backend must hand in its cublasLtHandle_t)");
  LOOM_CHECK(id >= 0 && static_cast<size_t>(id) < registered, "precision ", plugin, ": linear id ", id,
             " was never registered (", registered, " linears registered)");
}

// A linear's operand `what` as rows: a cuda tensor of dtype `want` with data.
inline RowMatrix matrix(const std::string& plugin, const Tensor& t, const LinearDesc& d, const char* what,
                        DType want) {
  LOOM_CHECK(t.data != nullptr, "precision ", plugin, ": ", d.name, ": ", what, " has no data");
  LOOM_CHECK(t.dtype == want && t.device == Device::cuda, "precision ", plugin, ": ", d.name, ": ", what,
             " must be a ", dtype_name(want), " cuda tensor, got ", dtype_name(t.dtype), " on ",
             device_name(t.device));
  return fold_rows(t, "precision ", plugin, ": ", d.name, ": ", what);
}

// The weight: a contiguous [out, in] matrix of dtype `want`.
inline void weight(const std::string& plugin, const Tensor& t, const LinearDesc& d, const char* what, DType want) {
  matrix(plugin, t, d, what, want);
  LOOM_CHECK(t.ndim == 2 && t.shape[0] == d.out && t.shape[1] == d.in && t.is_contiguous(), "precision ", plugin,
             ": ", d.name, ": ", what, " must be a contiguous [out, in] = [", d.out, ",", d.in, "] matrix, got ",
             t.shape_str());
}

// An input with `in` columns and at most max_rows rows; returns the rows.
inline int64_t rows(const std::string& plugin, const LinearDesc& d, const RowMatrix& m, const char* what) {
  LOOM_CHECK(m.cols == d.in, "precision ", plugin, ": ", d.name, ": ", what, " has ", m.cols, " columns, expected in=",
             d.in);
  LOOM_CHECK(m.rows <= d.max_rows, "precision ", plugin, ": ", d.name, ": ", what, " has ", m.rows,
             " rows, more than the max_rows=", d.max_rows, " it was registered with");
  return m.rows;
}

// A variable-row call (an MoE expert) whose row count the FP8 GEMMs cannot
// take whole is split into its first `head` rows, which they can take, and
// the tail (for the bf16 GEMMs): `what`'s two row views, after the checks of
// matrix() and that it has `rows` rows. An absent tensor (no data: a
// residual or dx not asked for) gives two absent views.
struct RowSplit {
  Tensor head, tail;
  Tensor* head_or_null() { return head.data != nullptr ? &head : nullptr; }
  Tensor* tail_or_null() { return tail.data != nullptr ? &tail : nullptr; }
};
inline RowSplit split_rows(const std::string& plugin, const Tensor* t, const LinearDesc& d, const char* what,
                           int64_t rows, int64_t head) {
  if (t == nullptr) return {};
  const RowMatrix m = matrix(plugin, *t, d, what, DType::bf16);
  LOOM_CHECK(m.rows == rows, "precision ", plugin, ": ", d.name, ": ", what, " has ", m.rows, " rows but x has ",
             rows);
  auto rows_view = [&](int64_t r0, int64_t n) {
    Tensor v(static_cast<char*>(t->data) + r0 * m.ld * static_cast<int64_t>(dtype_size(t->dtype)), t->dtype,
             t->device, {n, m.cols});
    v.stride[0] = m.ld;
    return v;
  };
  return {rows_view(0, head), rows_view(head, rows - head)};
}

// The saved activations the core hands over: `needed` bytes at least,
// 16-byte aligned (FP8 GEMM operands).
inline char* saved_activations(const std::string& plugin, void* ptr, size_t bytes, size_t needed) {
  LOOM_CHECK(bytes >= needed && ptr != nullptr, "precision ", plugin, ": saved activations of ", bytes, " bytes at ",
             ptr, ", ", needed, " needed");
  LOOM_CHECK(reinterpret_cast<uintptr_t>(ptr) % 16 == 0, "precision ", plugin,
             ": the saved activations must be 16-byte aligned (FP8 GEMM operands), got address ", ptr);
  return static_cast<char*>(ptr);
}

}  // namespace loom::fp8_gpu_checks
