// The skeleton both FP8 recipe families of this tree share: fp8_delayed and
// fp8_current (fp8_recipe.hpp), fp8_block (fp8_block.hpp). A family is its
// options (read and checked once: its own keys, then fp8_options::read_common),
// a CPU emulation and a GPU path, each a Precision of its own; the plugin's
// object is Fp8Skeleton over the one its device calls for, and every call of
// the precision interface goes there. So the families write their two paths
// and nothing between them, and a third family (or a test variant that
// overrides one answer) starts from the same place. The CPU emulations also
// share the host-tensor checks and the fp32 GEMMs of the linears they keep in
// full precision (namespace host below), and all four paths the check that a
// backward follows its own forward.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "loom/cpu_gemm.hpp"
#include "loom/error.hpp"
#include "loom/precision.hpp"
#include "loom/tensor.hpp"
#include "precision/common/fp8_options.hpp"
#include "precision/common/residual.hpp"

namespace loom::fp8_common {

class Fp8Skeleton : public Precision, public Fp8OperandAmax, public Fp8RecastOperand {
 public:
  PrecisionDTypes dtypes() const override { return impl().dtypes(); }
  int register_linear(const LinearDesc& desc) override { return impl().register_linear(desc); }
  size_t saved_activation_bytes(int id) const override { return impl().saved_activation_bytes(id); }
  bool keeps_wgrad_input(int id) const override { return impl().keeps_wgrad_input(id); }
  size_t workspace_bytes() const override { return impl().workspace_bytes(); }
  void setup(const PrecisionSetup& setup) override { impl().setup(setup); }
  void set_workspace(void* ptr, size_t bytes) override { impl().set_workspace(ptr, bytes); }
  void set_saved_activations(void* ptr, size_t bytes) override { impl().set_saved_activations(ptr, bytes); }
  void linear_forward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, Tensor& y,
                      const Tensor* residual) override {
    impl().linear_forward(ctx, id, x, w, y, residual);
  }
  void linear_backward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx,
                       Tensor& dw, bool accumulate) override {
    impl().linear_backward(ctx, id, x, w, dy, dx, dw, accumulate);
  }
  void end_step(const ExecContext& ctx) override { impl().end_step(ctx); }
  std::vector<StateTensor> state_tensors() override { return impl().state_tensors(); }
  void state_loaded() override { impl().state_loaded(); }
  std::string log_summary() const override { return impl().log_summary(); }
  std::unique_ptr<GatherCodec> gather_codec(const GatherCodecSetup& setup) override {
    return impl().gather_codec(setup);
  }
  int64_t variable_row_multiple() const override { return impl().variable_row_multiple(); }
  bool fp8_operand(const ExecContext& ctx, int id, Fp8OperandRole role, int64_t rows, Fp8Operand* op) override {
    return impl().fp8_operand(ctx, id, role, rows, op);
  }
  // The chosen path's, when it has one (the CPU emulations do not measure
  // or recast through the blocks' kernels); found once, in use().
  float* operand_amax(const ExecContext& ctx, int id, Fp8OperandRole role, int64_t rows) override {
    return amax_ != nullptr ? amax_->operand_amax(ctx, id, role, rows) : nullptr;
  }
  bool recast_operand(const ExecContext& ctx, int id, int64_t rows, Fp8Operand* op) override {
    return recast_ != nullptr && recast_->recast_operand(ctx, id, rows, op);
  }

  bool on_gpu() const { return on_gpu_; }

 protected:
  // Once, by the family's constructor: the emulation, or on device cuda the GPU path.
  void use(std::unique_ptr<Precision> impl, bool gpu) {
    impl_ = std::move(impl);
    on_gpu_ = gpu;
    amax_ = dynamic_cast<Fp8OperandAmax*>(impl_.get());
    recast_ = dynamic_cast<Fp8RecastOperand*>(impl_.get());
  }

 private:
  Precision& impl() const {
    LOOM_CHECK(impl_ != nullptr, "FP8 recipe: called before its constructor chose the CPU or GPU path");
    return *impl_;
  }
  std::unique_ptr<Precision> impl_;
  Fp8OperandAmax* amax_ = nullptr;      // impl_'s optional interfaces, or null
  Fp8RecastOperand* recast_ = nullptr;
  bool on_gpu_ = false;
};

// The GPU paths' storage: bf16 parameters and activations with an fp32 master
// copy, gradients and AdamW state (the bf16 recipe's), or with master = "bf16"
// bf16_pure's layout: no master copy, the optimizer rounds into the bf16
// parameters (stochastically when asked). optimizer_state sets AdamW's m and
// v apart (bf16 beside an fp32 master: half their memory).
inline PrecisionDTypes device_dtypes(const fp8_options::Common& o) {
  const DType state = o.state_bf16 ? DType::bf16 : DType::f32;
  if (o.master_bf16) {
    PrecisionDTypes t{DType::bf16, DType::bf16, DType::bf16, state, DType::bf16, /*has_master=*/false};
    t.stochastic_rounding = o.stochastic_rounding;
    return t;
  }
  return {DType::bf16, DType::f32, DType::f32, state, DType::bf16, /*has_master=*/true};
}

// The backward of a linear must follow a forward of as many rows (the forward
// cast x for it; -1: none since the last backward).
inline void check_saved_rows(const std::string& plugin, const LinearDesc& d, int64_t saved_rows, int64_t rows) {
  LOOM_CHECK(saved_rows == rows, "precision ", plugin, ": ", d.name, ": backward of ", rows,
             " rows, but the forward before it cast ",
             saved_rows < 0 ? std::string("none") : std::to_string(saved_rows),
             " (every backward follows its own forward)");
}

// The CPU emulations' operands: fp32 host tensors, checked with the recipe's
// name and the linear's in every message.
namespace host {

inline RowMatrix matrix(const Tensor& t, const std::string& plugin, const LinearDesc& d, const char* what) {
  LOOM_CHECK(t.data != nullptr, "precision ", plugin, ": ", d.name, ": ", what, " has no data");
  LOOM_CHECK(t.dtype == DType::f32 && t.device == Device::cpu, "precision ", plugin, ": ", d.name, ": ", what,
             " must be an fp32 host tensor, got ", dtype_name(t.dtype), " on ", device_name(t.device));
  return fold_rows(t, "precision ", plugin, ": ", d.name, ": ", what);
}

inline void check_weight(const Tensor& t, const std::string& plugin, const LinearDesc& d, const char* what) {
  matrix(t, plugin, d, what);
  LOOM_CHECK(t.ndim == 2 && t.shape[0] == d.out && t.shape[1] == d.in && t.is_contiguous(), "precision ", plugin,
             ": ", d.name, ": ", what, " must be a contiguous [out, in] = [", d.out, ",", d.in, "] matrix, got ",
             t.shape_str());
}

inline void check_shape(const RowMatrix& m, const std::string& plugin, const LinearDesc& d, int64_t cols,
                        int64_t rows, const char* what) {
  LOOM_CHECK(m.cols == cols && m.rows == rows && m.rows <= d.max_rows, "precision ", plugin, ": ", d.name, ": ",
             what, " is [", m.rows, ", ", m.cols, "], expected [", rows, ", ", cols, "] with at most max_rows=",
             d.max_rows, " rows");
}

// y = residual first (unless it is y): the GEMM then adds onto y.
inline void place_residual(const Tensor* residual, Tensor& y, const RowMatrix& my, const std::string& plugin,
                           const LinearDesc& d) {
  if (residual == nullptr) return;
  const RowMatrix mr = matrix(*residual, plugin, d, "residual");
  LOOM_CHECK(mr.rows == my.rows && mr.cols == my.cols, "precision ", plugin, ": ", d.name, ": residual is [", mr.rows,
             ", ", mr.cols, "] but y is [", my.rows, ", ", my.cols, "]");
  LOOM_CHECK(precision_common::residual_layout_ok(residual->data, mr.ld, y.data, my.ld, my.rows, my.cols,
                                                  sizeof(float)),
             "precision ", plugin, ": ", d.name, ": residual overlaps y without being y");
  if (residual->data == y.data) return;
  const float* src = residual->ptr<const float>();
  float* dst = y.ptr<float>();
  for (int64_t r = 0; r < my.rows; ++r) std::copy(src + r * mr.ld, src + r * mr.ld + my.cols, dst + r * my.ld);
}

// The operands of a forward, checked: x [rows, in], w [out, in], y [rows, out].
struct ForwardOperands {
  RowMatrix x, y;
};
inline ForwardOperands forward_operands(const std::string& plugin, const LinearDesc& d, const Tensor& x,
                                        const Tensor& w, const Tensor& y) {
  const RowMatrix mx = matrix(x, plugin, d, "x"), my = matrix(y, plugin, d, "y");
  check_weight(w, plugin, d, "w");
  check_shape(mx, plugin, d, d.in, mx.rows, "x");
  check_shape(my, plugin, d, d.out, mx.rows, "y");
  return {mx, my};
}

// The operands of a backward, checked: x may be empty (a recipe that keeps
// its own cast of x answers keeps_wgrad_input = true), the rows then come from dy.
struct BackwardOperands {
  RowMatrix x, dy;
};
inline BackwardOperands backward_operands(const std::string& plugin, const LinearDesc& d, const Tensor& x,
                                          const Tensor& w, const Tensor& dy, const Tensor& dw) {
  const RowMatrix mdy = matrix(dy, plugin, d, "dy");
  const RowMatrix mx = x.data != nullptr ? matrix(x, plugin, d, "x") : RowMatrix{mdy.rows, d.in, d.in};
  check_weight(w, plugin, d, "w");
  check_weight(dw, plugin, d, "dw");
  check_shape(mx, plugin, d, d.in, mx.rows, "x");
  check_shape(mdy, plugin, d, d.out, mx.rows, "dy");
  return {mx, mdy};
}

// A linear the emulation keeps in fp32 (the LM head unless fp8_head, or a
// call whose rows the FP8 casts cannot take): the reference GEMMs.
inline void full_forward(const std::string& plugin, const LinearDesc& d, const Tensor& x, const Tensor& w, Tensor& y,
                         const Tensor* residual) {
  const auto [mx, my] = forward_operands(plugin, d, x, w, y);
  place_residual(residual, y, my, plugin, d);
  cpu::linear_forward(y.ptr<float>(), my.ld, x.ptr<const float>(), mx.ld, w.ptr<const float>(), mx.rows, d.in, d.out,
                      residual != nullptr);
}

// x must be given (the fp32 GEMM reads it).
inline void full_backward(const std::string& plugin, const LinearDesc& d, const Tensor& x, const Tensor& w,
                          const Tensor& dy, Tensor* dx, Tensor& dw, bool accumulate) {
  matrix(x, plugin, d, "x");
  const auto [mx, mdy] = backward_operands(plugin, d, x, w, dy, dw);
  if (dx != nullptr) {
    const RowMatrix mdx = matrix(*dx, plugin, d, "dx");
    check_shape(mdx, plugin, d, d.in, mx.rows, "dx");
    cpu::linear_backward_input(dx->ptr<float>(), mdx.ld, dy.ptr<const float>(), mdy.ld, w.ptr<const float>(), mx.rows,
                               d.in, d.out);
  }
  cpu::linear_backward_weight(dw.ptr<float>(), dy.ptr<const float>(), mdy.ld, x.ptr<const float>(), mx.ld, mx.rows,
                              d.in, d.out, accumulate);
}

}  // namespace host

}  // namespace loom::fp8_common
