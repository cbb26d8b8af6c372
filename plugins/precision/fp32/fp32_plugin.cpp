// The fp32 precision recipe: everything is stored and computed in fp32, the
// optimizer updates the parameters directly (no master copy). It is the
// reference the other recipes are measured against: on the CPU it is the slow
// exact path the tests run (CBLAS), on CUDA the GPU reference (cuBLASLt with
// fp32 compute, no TF32). One object serves the device it was created for.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "loom/error.hpp"
#include "loom/precision.hpp"
#include "precision/common/residual.hpp"
#include "loom/cpu_gemm.hpp"
#ifdef LOOM_FP32_WITH_CUDA
#include "precision/common/cublaslt_linear.hpp"
#endif

namespace loom::fp32 {
namespace {

RowMatrix as_matrix(const Tensor& t, const char* what, const std::string& linear) {
  LOOM_CHECK(t.data != nullptr, "precision fp32: ", linear, ": ", what, " has no data");
  LOOM_CHECK(t.dtype == DType::f32, "precision fp32: ", linear, ": ", what, " must be fp32, got ",
             dtype_name(t.dtype), " (the fp32 recipe stores every tensor in fp32)");
  LOOM_CHECK(t.device == Device::cpu, "precision fp32: ", linear, ": ", what, " is on ", device_name(t.device),
             "; this plugin object was created for device cpu");
  return fold_rows(t, "precision fp32: ", linear, ": ", what);
}

class Fp32Precision final : public Precision {
 public:
  explicit Fp32Precision(const PluginInit& init) {
#ifdef LOOM_FP32_WITH_CUDA
    if (init.device == Device::cuda)
      gpu_ = std::make_unique<precision_common::CublasLtLinears>(
          "fp32", precision_common::GemmDTypes{DType::f32, DType::f32, DType::f32});
#else
    LOOM_CHECK(init.device == Device::cpu,
               "precision fp32: device ", device_name(init.device),
               " is not available in this plugin: the CUDA fp32 path is part of the CUDA backend (build with "
               "LOOM_WITH_CUDA=ON), this plugin runs on the CPU");
#endif
    // The recipe has no options of its own; finish() rejects any key given.
    init.config.finish();
  }

  PrecisionDTypes dtypes() const override {
    return {DType::f32, DType::f32, DType::f32, DType::f32, DType::f32, /*has_master=*/false};
  }

  int register_linear(const LinearDesc& desc) override {
#ifdef LOOM_FP32_WITH_CUDA
    if (gpu_) return gpu_->register_linear(desc);
#endif
    LOOM_CHECK(desc.in > 0 && desc.out > 0 && desc.max_rows >= 0, "precision fp32: linear '", desc.name,
               "' has invalid shape in=", desc.in, " out=", desc.out, " max_rows=", desc.max_rows);
    linears_.push_back(desc);
    return static_cast<int>(linears_.size()) - 1;
  }

#ifdef LOOM_FP32_WITH_CUDA
  size_t workspace_bytes() const override { return gpu_ ? precision_common::CublasLtLinears::kWorkspaceBytes : 0; }
  void set_workspace(void* ptr, size_t bytes) override {
    if (gpu_) gpu_->set_workspace(ptr, bytes);
  }
#endif

  void linear_forward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, Tensor& y,
                      const Tensor* residual) override {
#ifdef LOOM_FP32_WITH_CUDA
    if (gpu_) return gpu_->forward(ctx, id, x, w, y, residual);
#endif
    const LinearDesc& d = lookup(ctx, id);
    const RowMatrix mx = as_matrix(x, "x", d.name), my = as_matrix(y, "y", d.name);
    weight(w, "w", d);
    check_rows(d, mx, "x");
    check_cols(d, mx, d.in, "x", "in");
    check_cols(d, my, d.out, "y", "out");
    LOOM_CHECK(my.rows == mx.rows, "precision fp32: ", d.name, ": y has ", my.rows, " rows but x has ", mx.rows);
    if (residual != nullptr) {
      // y = residual first (unless it is y), then the GEMM adds onto it (beta = 1).
      const RowMatrix mr = as_matrix(*residual, "residual", d.name);
      LOOM_CHECK(mr.rows == my.rows && mr.cols == my.cols, "precision fp32: ", d.name, ": residual is [", mr.rows,
                 ", ", mr.cols, "] but y is [", my.rows, ", ", my.cols, "] (the residual must have y's shape)");
      LOOM_CHECK(precision_common::residual_layout_ok(residual->data, mr.ld, y.data, my.ld, my.rows, my.cols,
                                                      sizeof(float)),
                 "precision fp32: ", d.name, ": residual overlaps y without being y (residual at ", residual->data,
                 " row stride ", mr.ld, ", y at ", y.data, " row stride ", my.ld,
                 "): it must be y itself (same data and row stride) or share no element with it");
      if (residual->data != y.data) {
        const float* src = residual->ptr<const float>();
        float* dst = y.ptr<float>();
        for (int64_t r = 0; r < my.rows; ++r)
          std::copy(src + r * mr.ld, src + r * mr.ld + my.cols, dst + r * my.ld);
      }
    }
    cpu::linear_forward(y.ptr<float>(), my.ld, x.ptr<const float>(), mx.ld, w.ptr<const float>(), mx.rows, d.in,
                         d.out, residual != nullptr);
  }

  void linear_backward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx,
                       Tensor& dw, bool accumulate) override {
#ifdef LOOM_FP32_WITH_CUDA
    if (gpu_) return gpu_->backward(ctx, id, x, w, dy, dx, dw, accumulate);
#endif
    const LinearDesc& d = lookup(ctx, id);
    const RowMatrix mx = as_matrix(x, "x", d.name), mdy = as_matrix(dy, "dy", d.name);
    weight(w, "w", d);
    weight(dw, "dw", d);
    check_rows(d, mx, "x");
    check_cols(d, mx, d.in, "x", "in");
    check_cols(d, mdy, d.out, "dy", "out");
    LOOM_CHECK(mdy.rows == mx.rows, "precision fp32: ", d.name, ": dy has ", mdy.rows, " rows but x has ", mx.rows);
    if (dx != nullptr) {
      const RowMatrix mdx = as_matrix(*dx, "dx", d.name);
      check_cols(d, mdx, d.in, "dx", "in");
      LOOM_CHECK(mdx.rows == mx.rows, "precision fp32: ", d.name, ": dx has ", mdx.rows, " rows but x has ", mx.rows);
      cpu::linear_backward_input(dx->ptr<float>(), mdx.ld, dy.ptr<const float>(), mdy.ld, w.ptr<const float>(),
                                  mx.rows, d.in, d.out);
    }
    cpu::linear_backward_weight(dw.ptr<float>(), dy.ptr<const float>(), mdy.ld, x.ptr<const float>(), mx.ld, mx.rows,
                                 d.in, d.out, accumulate);
  }

 private:
  const LinearDesc& lookup(const ExecContext& ctx, int id) const {
    LOOM_CHECK(ctx.device == Device::cpu, "precision fp32: called with a ", device_name(ctx.device),
               " context but this plugin object was created for device cpu (the CUDA backend creates it with "
               "device cuda)");
    LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision fp32: linear id ", id,
               " was never registered (", linears_.size(), " linears registered)");
    return linears_[static_cast<size_t>(id)];
  }
  // The weight is one packed [out, in] matrix: a parameter buffer, never a view.
  void weight(const Tensor& t, const char* what, const LinearDesc& d) const {
    as_matrix(t, what, d.name);
    LOOM_CHECK(t.ndim == 2 && t.shape[0] == d.out && t.shape[1] == d.in && t.is_contiguous(), "precision fp32: ",
               d.name, ": ", what, " must be a contiguous [out, in] = [", d.out, ",", d.in, "] matrix, got shape ",
               t.shape_str(), " strides [", t.stride[0], ",", t.stride[1], "]");
  }
  static void check_rows(const LinearDesc& d, const RowMatrix& m, const char* what) {
    LOOM_CHECK(d.max_rows == 0 || m.rows <= d.max_rows, "precision fp32: ", d.name, ": ", what, " has ", m.rows,
               " rows, more than the max_rows=", d.max_rows, " it was registered with");
  }
  static void check_cols(const LinearDesc& d, const RowMatrix& m, int64_t want, const char* what, const char* dim) {
    LOOM_CHECK(m.cols == want, "precision fp32: ", d.name, ": ", what, " has ", m.cols, " columns, expected ", dim,
               "=", want);
  }

  std::vector<LinearDesc> linears_;  // CPU path only
#ifdef LOOM_FP32_WITH_CUDA
  std::unique_ptr<precision_common::CublasLtLinears> gpu_;  // set when created for device cuda
#endif
};

}  // namespace
}  // namespace loom::fp32

using loom::fp32::Fp32Precision;
LOOM_PLUGIN(precision, Fp32Precision, "fp32", "1.0.0",
            "fp32 everywhere, no master copy: the reference recipe (CPU GEMMs through CBLAS, CUDA GEMMs through "
            "cuBLASLt without TF32)")
