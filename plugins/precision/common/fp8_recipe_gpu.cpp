// The FP8 recipes on CUDA (fp8_recipe.hpp's make_gpu_recipe): the casts and
// scale updates of loom/ops/fp8_cast.hpp, the GEMMs of
// the plan cache of loom/ops/gemm.hpp, the scaling state on the device in
// ScalingState's layout (slot 3·linear + role). Built only with CUDA.
//
// Per step and FP8 linear (all but the LM head unless fp8_head = true; the
// head goes through the bf16 cuBLASLt GEMMs of cublaslt_linear.hpp):
//   forward   weight_cache = "step": W cast once per optimizer step into W
//             and Wᵀ (workspace, 2 bytes per parameter), read by every
//             micro-batch; weight_cache = "layer": W cast into one scratch
//             shared by every linear (sized for the largest) just before
//             fprop, Wᵀ into it again before dgrad, with the step's scale
//             (the same bits as "step"); x cast into x (workspace scratch,
//             for fprop) and xᵀ (the linear's saved activation, for wgrad);
//             fprop y = x Wᵀ (+ residual as C) with Fp8Gemm;
//   backward  dy cast into dy and dyᵀ (workspace scratch); dgrad dx = dy W
//             (A = dy, B = Wᵀ), wgrad dW = dyᵀ x (A = dyᵀ, B = xᵀ, C = dW
//             when accumulating).
// With fused_casts (delayed scaling only) a block may write x or dy in FP8
// itself (fp8_operand, ABI 8.0: the fused blocks' RMSNorm and SwiGLU): it
// gets the same scratch, saved slot, scale and amax slot the cast would use,
// and linear_forward/backward then skip that cast.
// Delayed scaling casts with the scales of the steps before. The forward's
// amaxes go to a pending buffer and enter the step's amax buffer when the
// backward runs (a validation forward leaves the scales alone, as on the
// CPU); end_step all-reduces the one step amax buffer (max) over the
// data-parallel group, then fp8_delayed_update rolls the history and
// recomputes every scale on the device. Current scaling measures each tensor
// just before its cast (fp8_amax, then fp8_update_scales on its slot), all on
// the stream: no host sync in a step. The host reads the state only for the
// log line, a checkpoint and a resume.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <iomanip>
#include <sstream>
#include <utility>

#include "loom/ops/cuda_check.hpp"
#include "loom/ops/gemm.hpp"
#include "loom/ops/fp8_cast.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"
#include "precision/common/cublaslt_linear.hpp"
#include "precision/common/fp8_gather.hpp"
#include "precision/common/fp8_gpu_checks.hpp"
#include "precision/common/log_mirror.hpp"
#include "precision/common/fp8_recipe.hpp"

namespace loom::fp8_recipe {
namespace {

using loom::fp8_gpu_checks::RowSplit;

using fp8::Role;

constexpr size_t kAlign = 256;
size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

DType fp8_dtype(fp8::Format f) { return f == fp8::Format::e4m3 ? DType::e4m3 : DType::e5m2; }

class Fp8Gpu final : public Precision, public Fp8OperandAmax, public Fp8RecastOperand {
 public:
  explicit Fp8Gpu(const GpuOptions& o)
      : o_(o),
        host_(o.scaling),
        lt_(o.plugin, precision_common::GemmDTypes{DType::bf16, DType::bf16, o.master_bf16 ? DType::bf16 : DType::f32},
            o.gemm_algo) {}

  ~Fp8Gpu() override {
    // Teardown: nothing worth reporting if the context is already gone.
    if (dev_ != nullptr) cudaFree(dev_);
  }

  PrecisionDTypes dtypes() const override { return fp8_common::device_dtypes(o_); }

  // The FP8 GEMMs' row multiple: other counts of a variable-row linear split
  // off a bf16 tail.
  int64_t variable_row_multiple() const override { return 16; }

  int register_linear(const LinearDesc& d) override {
    LOOM_CHECK(!set_up_, "precision ", o_.plugin, ": linear '", d.name, "' registered after setup()");
    fp8_options::check_linear_shape(o_.plugin, d);
    Linear l;
    l.desc = d;
    l.fp8 = d.role != LinearRole::lm_head || o_.fp8_head;
    if (l.fp8) {
      // cuBLASLt's FP8 kernels take m, n and k in multiples of 16 (every GEMM
      // of the linear uses each of in, out and the rows as one of them).
      LOOM_CHECK(d.in % 16 == 0 && d.out % 16 == 0 && d.max_rows % 16 == 0, "precision ", o_.plugin, ": linear '",
                 d.name, "' is [out, in] = [", d.out, ", ", d.in, "] with up to ", d.max_rows,
                 fp8_options::rows_origin(d), "; cuBLASLt's FP8 GEMMs need in, out and the rows to be multiples of "
                 "16. ", fp8_options::dims_to_change(d, 16, true), ", or use precision.plugin = \"bf16\"",
                 d.role == LinearRole::lm_head ? " (or leave fp8_head = false to keep the LM head in bf16)" : "");
      l.slot = host_.add_linear(d.name);
      l.w_off = weight_bytes_;
      weight_bytes_ += round_up(static_cast<size_t>(d.out * d.in));
      l.wt_off = weight_bytes_;
      weight_bytes_ += round_up(static_cast<size_t>(d.out * d.in));
      max_weight_bytes_ = std::max(max_weight_bytes_, round_up(static_cast<size_t>(d.out * d.in)));
      // input_in_backward: the backward is handed x again and casts xᵀ into
      // the x scratch (unused in a backward); nothing saved in between.
      l.recast_x = d.input_in_backward && !d.variable_rows;
      if (!l.recast_x) {
        l.saved_bytes = round_up(static_cast<size_t>(d.max_rows * d.in));
        l.saved_off = saved_total_;
        saved_total_ += l.saved_bytes;
      }
      x_scratch_ = std::max(x_scratch_, round_up(static_cast<size_t>(d.max_rows * d.in)));
      dy_scratch_ = std::max(dy_scratch_, round_up(static_cast<size_t>(d.max_rows * d.out)));
    }
    l.lt_id = lt_.register_linear(d);
    linears_.push_back(l);
    return static_cast<int>(linears_.size()) - 1;
  }

  size_t saved_activation_bytes(int id) const override {
    LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision ", o_.plugin, ": linear id ", id,
               " was never registered");
    // xᵀ in FP8 (one byte an element), rounded up so that every slot starts 256-byte aligned.
    return linears_[static_cast<size_t>(id)].saved_bytes;
  }

  bool keeps_wgrad_input(int id) const override {
    LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision ", o_.plugin, ": linear id ", id,
               " was never registered");
    // The wgrad reads xᵀ from the saved activations; a variable_rows linear
    // (an MoE expert) may get a row count that is not a multiple of 16, whose
    // call falls back to the bf16 GEMMs that read x.
    const Linear& l = linears_[static_cast<size_t>(id)];
    return l.fp8 && !l.desc.variable_rows && !l.recast_x;
  }

  // [0, gemm): the cuBLASLt workspace (shared by the bf16 head's GEMMs and
  // Fp8Gemm, whose aligned scale slots follow it); then the cast weights
  // ("step": every FP8 linear's W and Wᵀ; "layer": one scratch for the
  // largest W or Wᵀ); then the x, dy and dyᵀ scratch.
  size_t gemm_bytes() const { return round_up(ops::GemmPlans::kWorkspaceBytes + ops::GemmPlans::kScaleSlotBytes); }
  // Before setup() "auto" is planned as "step" (the larger).
  bool per_layer() const { return set_up_ ? per_layer_ : o_.weight_cache == WeightCache::layer; }
  size_t weight_region() const { return per_layer() ? max_weight_bytes_ : weight_bytes_; }
  size_t workspace_bytes() const override { return gemm_bytes() + weight_region() + x_scratch_ + 2 * dy_scratch_; }

  void setup(const PrecisionSetup& s) override {
    LOOM_CHECK(s.data_parallel != nullptr, "precision ", o_.plugin, ": setup without a data-parallel communicator");
    LOOM_CHECK(s.device == Device::cuda, "precision ", o_.plugin, ": the GPU path was set up for device ",
               device_name(s.device));
    LOOM_CHECK(s.data_parallel->size() == 1 || s.data_parallel->device_tensors(), "precision ", o_.plugin,
               ": the data-parallel communicator (", s.data_parallel->size(),
               " ranks) carries host tensors, but on CUDA this recipe keeps its amaxes on the device and reduces "
               "them with one device all-reduce per step: run data-parallel CUDA training with the NCCL "
               "communicator");
    dp_ = s.data_parallel;
    per_layer_ = weight_cache_per_layer(o_.weight_cache, s.grad_accum, s.params_sharded);
    // The gathered codes serve the GEMMs where the weights are cast per
    // layer at every gather anyway ("layer"); a "step" cache casts W once
    // per step from the bf16 parameters, which must then hold bf16.
    if (codes_ != nullptr) codes_->set_direct(per_layer_ && o_.gathered_codes);
    set_up_ = true;
    T_ = host_.tensors();
    const auto [fp8_linears, full] = fp8_options::split_linears(linears_);
    const fp8::ScalingConfig& sc = o_.scaling;
    const std::string how =
        sc.scaling == fp8::Scaling::delayed
            ? cat("delayed scaling (amax_history_len ", sc.amax_history_len, ", amax_compute_algo ",
                  fp8::name(sc.amax_compute_algo), ", margin ", sc.margin, ")")
            : std::string("current scaling");
    log_info(cat("precision ", o_.plugin, ": ", fp8_linears, " linears in FP8 on CUDA (cuBLASLt), format ",
                 fp8::name(sc.formats),
                 sc.formats == fp8::Formats::hybrid ? " (E4M3 x and w, E5M2 dy)" : " (E4M3 x, w and dy)", ", ", how,
                 full.empty() ? std::string() : cat("; in bf16: ", full), "; fast accumulation fprop ",
                 o_.gemm.fast_accum_fprop ? "on" : "off", ", dgrad ", o_.gemm.fast_accum_dgrad ? "on" : "off",
                 ", wgrad ", o_.gemm.fast_accum_wgrad ? "on" : "off",
                 sc.scaling != fp8::Scaling::delayed ? ""
                 : o_.fused_casts ? "; fused_casts on (fused layers' norms and SwiGLU write FP8)"
                                  : "; fused_casts off",
                 "; ",
                 fp8_options::weight_cache_summary(o_.weight_cache, per_layer_, s.params_sharded),
                 " (cast weights ", weight_region(), " bytes)",
                 codes_ == nullptr ? "" : per_layer_ && o_.gathered_codes ? "; FP8-gathered weights: the GEMMs read the codes"
                                                                           : "; FP8-gathered weights: decoded and cast again",
                 "; master ",
                 o_.master_bf16 ? (o_.stochastic_rounding ? "bf16 (stochastic rounding)" : "bf16") : "fp32",
                 "; gemm_algo ", gemm_algo_name(o_.gemm_algo)));
  }

  // The device state, allocated and set to the host state's fresh values with
  // the first memory the core gives (setup() leaves the GPU alone: `loom
  // check` plans without one).
  void allocate_state() {
    if (dev_ != nullptr || T_ == 0) return;
    {
      const auto T = static_cast<size_t>(T_);
      const size_t per = round_up(T * sizeof(float));
      const size_t hist = o_.scaling.scaling == fp8::Scaling::delayed
                              ? round_up(static_cast<size_t>(o_.scaling.amax_history_len) * T * sizeof(float))
                              : 0;
      const size_t bytes = 6 * per + hist + kAlign;
      LOOM_CUDA_CHECK(cudaMalloc(&dev_, bytes), "precision ", o_.plugin, ": FP8 scaling state of ", bytes,
                      " bytes for ", T_, " tensors");
      char* p = static_cast<char*>(dev_);
      step_amax_ = reinterpret_cast<float*>(p);
      pend_ = reinterpret_cast<float*>(p + per);
      cur_ = reinterpret_cast<float*>(p + 2 * per);
      last_amax_ = reinterpret_cast<float*>(p + 3 * per);
      scale_ = reinterpret_cast<float*>(p + 4 * per);
      scale_inv_ = reinterpret_cast<float*>(p + 5 * per);
      history_ = hist > 0 ? reinterpret_cast<float*>(p + 6 * per) : nullptr;
      counts_ = reinterpret_cast<uint32_t*>(p + 6 * per + hist);  // skipped, non-finite
      LOOM_CUDA_CHECK(cudaMemset(dev_, 0, bytes), "precision ", o_.plugin, ": clearing ", bytes,
                      " bytes of FP8 state");
      // The host state's fresh scales (1) and inverse scales.
      LOOM_CUDA_CHECK(cudaMemcpy(scale_, host_.scales(), T * sizeof(float), cudaMemcpyHostToDevice), "precision ",
                      o_.plugin, ": initial scales (", T_, " floats)");
      LOOM_CUDA_CHECK(cudaMemcpy(scale_inv_, host_.scale_invs(), T * sizeof(float), cudaMemcpyHostToDevice),
                      "precision ", o_.plugin, ": initial inverse scales (", T_, " floats)");
      // Complete before any stream of the core (which may not sync with the legacy stream) reads it.
      LOOM_CUDA_CHECK(cudaDeviceSynchronize(), "precision ", o_.plugin, ": initialising the FP8 state");
      // The log line's copies: scales, this step's amaxes, the counters.
      mirror_.allocate({T * sizeof(float), T * sizeof(float), 2 * sizeof(uint32_t)}, o_.plugin);
    }
  }

  void set_workspace(void* ptr, size_t bytes) override {
    LOOM_CHECK(bytes >= workspace_bytes() && ptr != nullptr, "precision ", o_.plugin, ": workspace of ", bytes,
               " bytes at ", ptr, ", ", workspace_bytes(), " needed");
    LOOM_CHECK(reinterpret_cast<uintptr_t>(ptr) % kAlign == 0, "precision ", o_.plugin,
               ": the workspace must be 256-byte aligned, got address ", ptr);
    LOOM_CHECK(set_up_, "precision ", o_.plugin, ": set_workspace before setup()");
    allocate_state();
    ws_ = static_cast<char*>(ptr);
    lt_.set_workspace(ws_, precision_common::CublasLtLinears::kWorkspaceBytes);
    if (fp8gemm_) fp8gemm_->set_workspace(ws_, ops::GemmPlans::kWorkspaceBytes + ops::GemmPlans::kScaleSlotBytes);
    for (Linear& l : linears_) l.weight_cast = l.w_scale_known = false;
  }

  void set_saved_activations(void* ptr, size_t bytes) override {
    saved_ = fp8_gpu_checks::saved_activations(o_.plugin, ptr, bytes, saved_total_);
  }

  void linear_forward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, Tensor& y,
                      const Tensor* residual) override {
    Linear& l = lookup(ctx, id);
    const bool given = is_fp8(x.dtype);  // written by the block (fp8_operand)
    const int64_t offered = l.offered_x, measured = l.measured_x;
    l.offered_x = l.measured_x = -1;
    if (given) take_operand(l, x, offered, Fp8OperandRole::x);
    if (!l.fp8) return lt_.forward(ctx, l.lt_id, x, w, y, residual);
    const LinearDesc& d = l.desc;
    auto stream = static_cast<cudaStream_t>(ctx.stream);
    const RowMatrix mx = given ? RowMatrix{x.shape[0], d.in, d.in} : matrix(x, d, "x", DType::bf16);
    matrix(y, d, "y", DType::bf16);
    check_weight(w, d, "w", param_dtype());
    const int64_t rows = check_rows(d, mx, "x");
    if (rows % 16 != 0) {
      refuse_bf16_of_codes(l, id, rows);
      const int64_t head = rows / 16 * 16;
      if (d.variable_rows && head > 0) {
        // An expert's rows: the first `head` in FP8, the rest (< 16) in bf16.
        split_rows(l, rows, head);
        RowSplit xs = fp8_gpu_checks::split_rows(o_.plugin, &x, d, "x", rows, head),
                 ys = fp8_gpu_checks::split_rows(o_.plugin, &y, d, "y", rows, head),
                 rs = fp8_gpu_checks::split_rows(o_.plugin, residual, d, "residual", rows, head);
        linear_forward(ctx, id, xs.head, w, ys.head, rs.head_or_null());
        return lt_.forward(ctx, l.lt_id, xs.tail, w, ys.tail, rs.tail_or_null());
      }
      unaligned_rows(l, rows);
      return lt_.forward(ctx, l.lt_id, x, w, y, residual);
    }
    if (rows == 0) {
      l.saved_rows = 0;
      return;
    }
    const Tensor qw = weight_for_fprop(l, id, w, stream);
    const int64_t xs = fp8::ScalingState::slot(l.slot, Role::x), ws = fp8::ScalingState::slot(l.slot, Role::w);
    const DType tx = fp8_dtype(host_.format(Role::x));
    Tensor qx(ws_ + x_off(), tx, Device::cuda, {rows, d.in});
    Tensor qxt(saved_ + l.saved_off, tx, Device::cuda, {d.in, rows});
    if (!given)
      cast(x, &qx, l.recast_x ? nullptr : &qxt, xs, /*pending=*/true, stream, took_amax(l, measured, rows, "x"));
    ops::Fp8GemmOptions opt;
    opt.c = residual;
    opt.fast_accum = o_.gemm.fast_accum_fprop;
    vary(opt, d, ops::GemmVarying::m);
    ops::fp8_gemm(gemm(ctx), qx, scale_inv_ + xs, qw, scale_inv_ + ws, y, opt, stream);
    l.saved_rows = rows;
  }

  void linear_backward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx,
                       Tensor& dw, bool accumulate) override {
    Linear& l = lookup(ctx, id);
    const bool given = is_fp8(dy.dtype);  // written by the block (fp8_operand)
    const int64_t offered = l.offered_dy, measured = l.measured_dy, recast = l.offered_recast;
    l.offered_dy = l.measured_dy = l.offered_recast = -1;
    if (given) take_operand(l, dy, offered, Fp8OperandRole::dy);
    const bool x_given = is_fp8(x.dtype);  // xᵀ, written by the block (recast_operand)
    if (x_given) take_recast(l, x, recast);
    if (!l.fp8) return lt_.backward(ctx, l.lt_id, x, w, dy, dx, dw, accumulate);
    const LinearDesc& d = l.desc;
    auto stream = static_cast<cudaStream_t>(ctx.stream);
    const RowMatrix mdy = given ? RowMatrix{dy.shape[0], d.out, d.out} : matrix(dy, d, "dy", DType::bf16);
    check_weight(w, d, "w", param_dtype());
    check_weight(dw, d, "dw", grad_dtype());
    // x is read only by the bf16 fallback (rows not a multiple of 16) and the
    // recast; an empty x (keeps_wgrad_input) or one given as xᵀ takes the
    // rows from dy.
    const bool have_x = x.data != nullptr && !x_given;
    const int64_t rows = have_x ? check_rows(d, matrix(x, d, "x", DType::bf16), "x") : mdy.rows;
    LOOM_CHECK(rows <= d.max_rows, "precision ", o_.plugin, ": ", d.name, ": dy has ", rows,
               " rows, more than the max_rows=", d.max_rows, " it was registered with");
    if (rows % 16 != 0) {
      refuse_bf16_of_codes(l, id, rows);
      LOOM_CHECK(have_x, "precision ", o_.plugin, ": ", d.name, ": backward of ", rows,
                 " rows (not a multiple of 16: a bf16 GEMM that reads x) was given an empty x; the linear "
                 "is not variable_rows, so keeps_wgrad_input said x was not needed");
      const int64_t head = rows / 16 * 16;
      if (d.variable_rows && head > 0) {
        // As the forward split it: the FP8 backward of the first `head` rows
        // (its forward cast them), then the tail's bf16 GEMMs adding to dW.
        RowSplit xs = fp8_gpu_checks::split_rows(o_.plugin, &x, d, "x", rows, head),
                 dys = fp8_gpu_checks::split_rows(o_.plugin, &dy, d, "dy", rows, head),
                 dxs = fp8_gpu_checks::split_rows(o_.plugin, dx, d, "dx", rows, head);
        linear_backward(ctx, id, xs.head, w, dys.head, dxs.head_or_null(), dw, accumulate);
        return lt_.backward(ctx, l.lt_id, xs.tail, w, dys.tail, dxs.tail_or_null(), dw, /*accumulate=*/true);
      }
      return lt_.backward(ctx, l.lt_id, x, w, dy, dx, dw, accumulate);
    }
    LOOM_CHECK(mdy.rows == rows && mdy.cols == d.out, "precision ", o_.plugin, ": ", d.name, ": dy is [", mdy.rows,
               ", ", mdy.cols, "], expected [", rows, ", ", d.out, "]");
    LOOM_CHECK(!x_given || recast == rows, "precision ", o_.plugin, ": ", d.name, ": the xᵀ passed covers ", recast,
               " rows, dy ", rows);
    fp8_common::check_saved_rows(o_.plugin, d, l.saved_rows, rows);
    if (dx != nullptr) {
      const RowMatrix mdx = matrix(*dx, d, "dx", DType::bf16);
      LOOM_CHECK(mdx.rows == rows && mdx.cols == d.in, "precision ", o_.plugin, ": ", d.name, ": dx is [", mdx.rows,
                 ", ", mdx.cols, "], expected [", rows, ", ", d.in, "]");
    }
    l.saved_rows = -1;
    if (rows == 0) {
      // No rows: dW = 0 (written) or unchanged (accumulated).
      if (!accumulate)
        LOOM_CUDA_CHECK(cudaMemsetAsync(dw.data, 0, dw.bytes(), stream), "precision ", o_.plugin, ": ", d.name,
                        ": clearing dW (", dw.bytes(), " bytes)");
      return;
    }
    if (!per_layer_) cast_weight(l, w, stream);
    const int64_t xs = fp8::ScalingState::slot(l.slot, Role::x), ws = fp8::ScalingState::slot(l.slot, Role::w),
                  ds = fp8::ScalingState::slot(l.slot, Role::dy);
    const DType tdy = fp8_dtype(host_.format(Role::dy));
    Tensor qdy(ws_ + dy_off(), tdy, Device::cuda, {rows, d.out});
    Tensor qdyt(ws_ + dy_off() + dy_scratch_, tdy, Device::cuda, {d.out, rows});
    if (!given) cast(dy, &qdy, &qdyt, ds, /*pending=*/false, stream, took_amax(l, measured, rows, "dy"));
    if (o_.scaling.scaling == fp8::Scaling::delayed) {
      // The forward's amaxes count now that it is part of a training step.
      merge_pending(xs, stream);
      merge_pending(ws, stream);
    }
    if (dx != nullptr) {
      const Tensor qwt = weight_for_dgrad(l, id, w, stream);
      ops::Fp8GemmOptions opt;
      opt.fast_accum = o_.gemm.fast_accum_dgrad;
      vary(opt, d, ops::GemmVarying::m);
      ops::fp8_gemm(gemm(ctx), qdy, scale_inv_ + ds, qwt, scale_inv_ + ws, *dx, opt, stream);
    }
    Tensor qxt(saved_ + l.saved_off, fp8_dtype(host_.format(Role::x)), Device::cuda, {d.in, rows});
    if (l.recast_x) {
      // The forward's x, handed again: xᵀ cast now with the scale the forward
      // used (its amax was taken then), the same codes; into the x scratch,
      // which only a forward uses. Or xᵀ itself, there already: the block's
      // kernel that recomputed x wrote it (recast_operand).
      qxt = Tensor(ws_ + x_off(), qxt.dtype, Device::cuda, {d.in, rows});
      if (!x_given) {
        LOOM_CHECK(have_x, "precision ", o_.plugin, ": ", d.name, ": the backward was given no x, but the linear was "
                   "registered with input_in_backward (the block hands x again, and the recipe keeps no copy)");
        gpu::fp8_cast(x, nullptr, &qxt, scale_ + xs, nullptr, stream);
      }
    }
    ops::Fp8GemmOptions opt;
    opt.c = accumulate ? &dw : nullptr;
    opt.fast_accum = o_.gemm.fast_accum_wgrad;
    vary(opt, d, ops::GemmVarying::k);  // the tokens are the contracted dim
    ops::fp8_gemm(gemm(ctx), qdyt, scale_inv_ + ds, qxt, scale_inv_ + xs, dw, opt, stream);
  }

  // Delayed scaling knows a tensor's scale before the tensor exists, so a
  // block's kernel may write x or dy in FP8 itself: into the scratch, saved
  // slot, scale and amax slot that cast() would use (a forward's x into the
  // pending amax, cleared here as cast() clears it). Not for the bf16 LM head,
  // a variable-row linear (an MoE expert), or rows the FP8 GEMMs cannot take;
  // dy only for the rows the forward before it cast.
  bool fp8_operand(const ExecContext& ctx, int id, Fp8OperandRole role, int64_t rows, Fp8Operand* op) override {
    if (!o_.fused_casts || o_.scaling.scaling != fp8::Scaling::delayed || op == nullptr) return false;
    Linear& l = lookup(ctx, id);
    const LinearDesc& d = l.desc;
    if (!l.fp8 || d.variable_rows || rows <= 0 || rows % 16 != 0 || rows > d.max_rows) return false;
    if (role == Fp8OperandRole::x && l.recast_x) return false;  // no saved slot for its xᵀ
    auto stream = static_cast<cudaStream_t>(ctx.stream);
    if (role == Fp8OperandRole::x) {
      const int64_t t = fp8::ScalingState::slot(l.slot, Role::x);
      const DType tx = fp8_dtype(host_.format(Role::x));
      LOOM_CUDA_CHECK(cudaMemsetAsync(pend_ + t, 0, sizeof(float), stream), "precision ", o_.plugin,
                      ": clearing the pending amax of slot ", t);
      op->q = Tensor(ws_ + x_off(), tx, Device::cuda, {rows, d.in});
      op->q_t = Tensor(saved_ + l.saved_off, tx, Device::cuda, {d.in, rows});
      op->scale = scale_ + t;
      op->amax = pend_ + t;
      l.offered_x = rows;
      return true;
    }
    if (l.saved_rows != rows) return false;  // linear_backward reports the mismatch
    const int64_t t = fp8::ScalingState::slot(l.slot, Role::dy);
    const DType tdy = fp8_dtype(host_.format(Role::dy));
    op->q = Tensor(ws_ + dy_off(), tdy, Device::cuda, {rows, d.out});
    op->q_t = Tensor(ws_ + dy_off() + dy_scratch_, tdy, Device::cuda, {d.out, rows});
    op->scale = scale_ + t;
    op->amax = step_amax_ + t;
    l.offered_dy = rows;
    return true;
  }

  // Current scaling measures each x and dy just before casting it; the fused
  // layers' RMSNorm and SwiGLU can measure what they write instead
  // (precision.producer_amax): into the slot's amax, cleared here as cast()
  // clears it, which the next call of the linear then takes. Where
  // fp8_operand would decline (the bf16 LM head, a variable-row linear, rows
  // the FP8 GEMMs cannot take), so does this; dy only for the rows the
  // forward before it cast.
  float* operand_amax(const ExecContext& ctx, int id, Fp8OperandRole role, int64_t rows) override {
    if (!o_.producer_amax || o_.scaling.scaling != fp8::Scaling::current) return nullptr;
    Linear& l = lookup(ctx, id);
    const LinearDesc& d = l.desc;
    if (!l.fp8 || d.variable_rows || rows <= 0 || rows % 16 != 0 || rows > d.max_rows) return nullptr;
    const bool is_x = role == Fp8OperandRole::x;
    if (!is_x && l.saved_rows != rows) return nullptr;  // linear_backward reports the mismatch
    const int64_t t = fp8::ScalingState::slot(l.slot, is_x ? Role::x : Role::dy);
    LOOM_CUDA_CHECK(cudaMemsetAsync(cur_ + t, 0, sizeof(float), static_cast<cudaStream_t>(ctx.stream)), "precision ",
                    o_.plugin, ": clearing the amax of slot ", t, " for ", d.name, "'s ", is_x ? "x" : "dy");
    (is_x ? l.measured_x : l.measured_dy) = rows;
    return cur_ + t;
  }

  // Selective recompute: the block recomputes a linear's x (an RMSNorm's or
  // SwiGLU's output) just before its backward, which casts xᵀ from it with
  // the forward's scale. The recomputing kernel can write that xᵀ itself
  // (fused_casts under delayed scaling, producer_amax under current: the
  // switches of the fused layers' kernels), straight into the x scratch the
  // cast would write, and no bf16 x is written or read. Only for a linear
  // whose forward cast those rows (the scale is the forward's).
  bool recast_operand(const ExecContext& ctx, int id, int64_t rows, Fp8Operand* op) override {
    const bool on = o_.scaling.scaling == fp8::Scaling::delayed ? o_.fused_casts : o_.producer_amax;
    if (!on || op == nullptr) return false;
    Linear& l = lookup(ctx, id);
    const LinearDesc& d = l.desc;
    if (!l.fp8 || !l.recast_x || rows <= 0 || rows % 16 != 0 || rows > d.max_rows || l.saved_rows != rows)
      return false;
    op->q = Tensor();
    op->q_t = Tensor(ws_ + x_off(), fp8_dtype(host_.format(Role::x)), Device::cuda, {d.in, rows});
    op->scale = scale_ + fp8::ScalingState::slot(l.slot, Role::x);
    op->amax = nullptr;
    l.offered_recast = rows;
    return true;
  }

  void end_step(const ExecContext& ctx) override {
    LOOM_CHECK(set_up_, "precision ", o_.plugin, ": end_step before setup()");
    stream_ = static_cast<cudaStream_t>(ctx.stream);
    for (Linear& l : linears_) l.weight_cast = l.w_scale_known = false;  // the optimizer changed the weights
    ++steps_;
    if (T_ == 0) return;
    const size_t tb = static_cast<size_t>(T_) * sizeof(float);
    // The one all-reduce of the step: every rank's amaxes, max-reduced, so that
    // delayed scaling gives every rank the same scales (and the log line the
    // global amax under current scaling).
    if (dp_->size() > 1) {
      Tensor amaxes(step_amax_, DType::f32, Device::cuda, {T_});
      const CommTicket t = dp_->all_reduce(ctx, amaxes, ReduceOp::max);
      dp_->wait(ctx, t);
    }
    LOOM_CUDA_CHECK(cudaMemcpyAsync(last_amax_, step_amax_, tb, cudaMemcpyDeviceToDevice, stream_), "precision ",
                    o_.plugin, ": keeping this step's ", T_, " amaxes for the log line");
    if (o_.scaling.scaling == fp8::Scaling::delayed) {
      head_ = (head_ + 1) % o_.scaling.amax_history_len;
      gpu::fp8_delayed_update(step_amax_, history_, o_.scaling.amax_history_len, static_cast<int>(head_), T_,
                              o_.scaling.amax_compute_algo, o_.scaling.formats, o_.scaling.margin, scale_, scale_inv_,
                              counts_, counts_ + 1, stream_);
    } else {
      LOOM_CUDA_CHECK(cudaMemsetAsync(step_amax_, 0, tb, stream_), "precision ", o_.plugin, ": clearing ", T_,
                      " step amaxes");
    }
    // What the log line of this step shows, read by log_summary() without a sync.
    mirror_.queue(stream_, {scale_, last_amax_, counts_}, steps_, o_.plugin);
  }

  std::vector<StateTensor> state_tensors() override {
    if (T_ == 0) return {};
    LOOM_CHECK(dev_ != nullptr, "precision ", o_.plugin,
               ": state_tensors() before the memory was given (the state lives on the device)");
    read_counts();
    counters_[0] = static_cast<double>(head_);
    counters_[1] = static_cast<double>(steps_);
    counters_[2] = static_cast<double>(h_counts_[0]);
    counters_[3] = static_cast<double>(h_counts_[1]);
    const bool replicated = o_.scaling.scaling == fp8::Scaling::delayed;
    std::vector<StateTensor> out;
    out.push_back({"fp8.scale", Tensor(scale_, DType::f32, Device::cuda, {T_}), replicated});
    if (history_ != nullptr)
      out.push_back({"fp8.amax_history",
                     Tensor(history_, DType::f32, Device::cuda,
                            {static_cast<int64_t>(o_.scaling.amax_history_len), T_}),
                     true});
    out.push_back({"fp8.counters", Tensor(counters_, DType::f64, Device::cpu, {4}), replicated});
    // The options that give the state its meaning (as on the CPU).
    host_.options_record(options_);
    out.push_back(
        {"fp8.options", Tensor(options_, DType::f64, Device::cpu, {fp8::ScalingState::kOptionsRecord}), true});
    return out;
  }

  void state_loaded() override {
    for (Linear& l : linears_) {
      l.weight_cast = l.w_scale_known = false;
      l.saved_rows = l.offered_x = l.offered_dy = l.measured_x = l.measured_dy = l.offered_recast = -1;
    }
    if (T_ == 0 || dev_ == nullptr) return;
    // The core uploaded the device tensors; check them on the host (ScalingState's
    // rules) and derive the inverse scales there, bitwise the host's.
    LOOM_CUDA_CHECK(cudaDeviceSynchronize(), "precision ", o_.plugin, ": waiting for the restored FP8 state");
    const size_t tb = static_cast<size_t>(T_) * sizeof(float);
    LOOM_CUDA_CHECK(cudaMemcpy(host_.scale_data(), scale_, tb, cudaMemcpyDeviceToHost), "precision ", o_.plugin,
                    ": reading ", T_, " restored scales");
    if (history_ != nullptr)
      LOOM_CUDA_CHECK(cudaMemcpy(host_.history_data(), history_,
                                 static_cast<size_t>(host_.history_floats()) * sizeof(float), cudaMemcpyDeviceToHost),
                      "precision ", o_.plugin, ": reading the restored amax history (", host_.history_floats(),
                      " floats)");
    // Every restored value checked before any is taken (ScalingState's
    // rules, as on the CPU; the core names the checkpoint and rank file).
    const fp8::ScalingState::Counters c = fp8::ScalingState::counters_from(counters_);
    // The device counts skipped updates and non-finite amaxes in 32 bits.
    for (const auto& [v, what] : {std::pair<int64_t, const char*>{c.skipped, "[2] (the skipped scale updates)"},
                                  std::pair<int64_t, const char*>{c.nonfinite, "[3] (the non-finite amaxes)"}})
      if (v > static_cast<int64_t>(UINT32_MAX))
        throw Error(cat("precision state 'fp8.counters' ", what, " is ", v, ", beyond the ", UINT32_MAX,
                        " the CUDA recipe counts to"));
    const std::vector<std::string> changed = host_.restore(c, options_);
    for (const std::string& line : changed) log_warn(cat("precision ", o_.plugin, ": ", line));
    log_info(cat("precision ", o_.plugin, ": ", changed.empty() ? "its FP8 state resumes" : "the rest of its FP8 state resumes",
                 " (", T_, " scales", history_ != nullptr ? ", the amax history" : "", ", counters after ", c.steps,
                 " step(s))"));
    head_ = c.head;
    steps_ = c.steps;
    h_counts_[0] = static_cast<uint32_t>(c.skipped);
    h_counts_[1] = static_cast<uint32_t>(c.nonfinite);
    skipped_mark_ = c.skipped;
    // The scales too: restore() starts afresh those an option change made stale.
    LOOM_CUDA_CHECK(cudaMemcpy(scale_, host_.scales(), tb, cudaMemcpyHostToDevice), "precision ", o_.plugin,
                    ": writing ", T_, " restored scales");
    LOOM_CUDA_CHECK(cudaMemcpy(scale_inv_, host_.scale_invs(), tb, cudaMemcpyHostToDevice), "precision ", o_.plugin,
                    ": writing ", T_, " restored inverse scales");
    LOOM_CUDA_CHECK(cudaMemcpy(counts_, h_counts_, sizeof(h_counts_), cudaMemcpyHostToDevice), "precision ",
                    o_.plugin, ": writing the restored counters");
    LOOM_CUDA_CHECK(cudaMemset(step_amax_, 0, tb), "precision ", o_.plugin, ": clearing ", T_, " step amaxes");
    LOOM_CUDA_CHECK(cudaMemset(pend_, 0, tb), "precision ", o_.plugin, ": clearing ", T_, " pending amaxes");
    LOOM_CUDA_CHECK(cudaDeviceSynchronize(), "precision ", o_.plugin, ": writing the restored FP8 state");
  }

  // The FP8 weight gathers (fp8_gather.hpp, on the device casts): current
  // scaling casts W from its own amax on every call of a linear whose rows
  // always suit the FP8 GEMMs (a variable_rows linear may fall back to bf16).
  // Delayed scaling offers none (the core's stand-in says why).
  std::unique_ptr<GatherCodec> gather_codec(const GatherCodecSetup& setup) override {
    if (o_.scaling.scaling != fp8::Scaling::current) return nullptr;
    auto casts = [this](int id, int* margin) {
      if (id < 0 || static_cast<size_t>(id) >= linears_.size()) return false;
      const Linear& l = linears_[static_cast<size_t>(id)];
      if (!l.fp8 || l.desc.variable_rows || l.desc.max_rows % 16 != 0) return false;
      *margin = o_.scaling.margin;
      return true;
    };
    return fp8_gather::make_codec(setup, casts, fp8_gather::device_ops(), o_.plugin, &codes_);
  }

  std::string log_summary() const override {
    if (T_ == 0 || dev_ == nullptr) return {};
    // The newest end_step copy the device has finished: no host sync (the
    // step's own read is the log step's one, loom/precision.hpp).
    int64_t at = 0;
    const char* got = mirror_.newest(&at);
    if (got == nullptr) return cat(o_.plugin, " state not copied back yet");
    const auto* h_scale = reinterpret_cast<const float*>(got);
    const auto* h_amax = reinterpret_cast<const float*>(got + mirror_.offset(1));
    const auto* h_counts = reinterpret_cast<const uint32_t*>(got + mirror_.offset(2));
    float lo = FLT_MAX, hi = 0.0f, m = 0.0f;
    for (int64_t t = 0; t < T_; ++t) {
      lo = std::min(lo, h_scale[t]);
      hi = std::max(hi, h_scale[t]);
      m = std::max(m, h_amax[t]);
    }
    const int64_t skipped = h_counts[0];
    const int64_t since = skipped - skipped_mark_;
    skipped_mark_ = skipped;
    if (since > 0 && !warned_skip_) {
      warned_skip_ = true;
      log_warn(cat("precision ", o_.plugin, ": ", since, " FP8 scale update(s) skipped by step ", steps_,
                   " because an amax was 0, inf or NaN; those tensors keep their previous scale. Later skips are "
                   "counted in the \"precision:\" part of the log line, not warned again"));
    }
    std::ostringstream os;
    os << o_.plugin << " scales " << std::setprecision(4) << lo << ".." << hi << " over " << T_
       << " tensors, max amax " << m << ", skipped updates " << skipped << " (" << since
       << " since the last log line, non-finite amaxes " << h_counts[1] << ") as of step " << at;
    return os.str();
  }

 private:
  struct Linear {
    LinearDesc desc;
    bool fp8 = false;
    int slot = -1;   // index in the scaling state (FP8 linears)
    int lt_id = -1;  // id in the bf16 GEMMs (linears kept in bf16)
    size_t w_off = 0, wt_off = 0;            // bytes after the GEMM workspace: W and Wᵀ in FP8
    size_t saved_off = 0, saved_bytes = 0;   // xᵀ in FP8 in the saved activations
    bool recast_x = false;                   // LinearDesc::input_in_backward: xᵀ cast in the backward instead
    bool weight_cast = false;                // "step": this step's W and Wᵀ are in the workspace
    bool w_scale_known = false;              // "layer": W was measured (and its amax kept) this step
    int64_t saved_rows = -1;                 // rows the last forward cast (-1: none since the last backward)
    int64_t offered_x = -1, offered_dy = -1;  // rows of the FP8 operand fp8_operand handed out for the next call
    int64_t measured_x = -1, measured_dy = -1;  // rows whose amax operand_amax's kernel measures for the next call
    int64_t offered_recast = -1;  // rows of the xᵀ recast_operand handed out for the next backward
  };

  static bool is_fp8(DType t) { return t == DType::e4m3 || t == DType::e5m2; }

  // An FP8 x in a backward is the xᵀ recast_operand handed out for this very
  // call: the same memory, dtype and shape, and never a second use.
  void take_recast(const Linear& l, const Tensor& t, int64_t offered) const {
    const LinearDesc& d = l.desc;
    LOOM_CHECK(offered > 0, "precision ", o_.plugin, ": ", d.name, ": x is ", dtype_name(t.dtype), " ",
               t.shape_str(), ", but recast_operand did not hand out an FP8 xᵀ for this backward of the linear (each "
               "one serves exactly the next linear_backward; otherwise pass x in bf16)");
    const void* at = ws_ + x_off();
    const DType want = fp8_dtype(host_.format(Role::x));
    LOOM_CHECK(t.data == at && t.dtype == want && t.ndim == 2 && t.shape[0] == d.in && t.shape[1] == offered &&
                   t.is_contiguous(),
               "precision ", o_.plugin, ": ", d.name, ": the FP8 x passed (", dtype_name(t.dtype), " ", t.shape_str(),
               " at ", t.data, ") is not the xᵀ recast_operand handed out (", dtype_name(want), " [", d.in, ", ",
               offered, "] at ", at, "); pass op.q_t itself");
  }

  // True when operand_amax handed out the amax of this call's x or dy (its
  // producer measured it): the same rows, or a block broke the contract.
  bool took_amax(const Linear& l, int64_t measured, int64_t rows, const char* what) const {
    if (measured < 0) return false;
    LOOM_CHECK(measured == rows, "precision ", o_.plugin, ": ", l.desc.name, ": operand_amax was asked for the amax of ",
               measured, " rows of ", what, ", but the call passes ", rows, " rows (each amax serves exactly the next ",
               "call of the linear, with those rows)");
    return true;
  }

  // An x or dy in FP8 is the operand fp8_operand handed out for this very
  // call: the same memory, dtype and shape, and never a second use.
  void take_operand(const Linear& l, const Tensor& t, int64_t offered, Fp8OperandRole role) const {
    const LinearDesc& d = l.desc;
    const bool is_x = role == Fp8OperandRole::x;
    const char* what = is_x ? "x" : "dy";
    LOOM_CHECK(offered > 0, "precision ", o_.plugin, ": ", d.name, ": ", what, " is ", dtype_name(t.dtype),
               " ", t.shape_str(), ", but fp8_operand did not hand out an FP8 ", what,
               " for this call of the linear (each one serves exactly the next ",
               is_x ? "linear_forward" : "linear_backward", "; otherwise pass ", what, " in bf16)");
    const int64_t cols = is_x ? d.in : d.out;
    const void* at = is_x ? static_cast<const void*>(ws_ + x_off()) : static_cast<const void*>(ws_ + dy_off());
    const DType want = fp8_dtype(host_.format(is_x ? Role::x : Role::dy));
    LOOM_CHECK(t.data == at && t.dtype == want && t.ndim == 2 && t.shape[0] == offered && t.shape[1] == cols &&
                   t.is_contiguous(),
               "precision ", o_.plugin, ": ", d.name, ": the FP8 ", what, " passed (", dtype_name(t.dtype), " ",
               t.shape_str(), " at ", t.data, ") is not the operand fp8_operand handed out (", dtype_name(want),
               " [", offered, ", ", cols, "] at ", at, "); pass op.q itself");
  }

  DType param_dtype() const { return DType::bf16; }
  DType grad_dtype() const { return o_.master_bf16 ? DType::bf16 : DType::f32; }
  size_t x_off() const { return gemm_bytes() + weight_region(); }
  size_t dy_off() const { return x_off() + x_scratch_; }

  Linear& lookup(const ExecContext& ctx, int id) {
    fp8_gpu_checks::call(o_.plugin, ctx, id, linears_.size());
    Linear& l = linears_[static_cast<size_t>(id)];
    LOOM_CHECK(set_up_ && ws_ != nullptr && (!l.fp8 || l.recast_x || saved_ != nullptr), "precision ", o_.plugin, ": ",
               l.desc.name, " called before setup() and the planned memory were given");
    stream_ = static_cast<cudaStream_t>(ctx.stream);  // what the host waits for before reading the state
    return l;
  }

  ops::GemmPlans& gemm(const ExecContext& ctx) {
    // Built at the first FP8 GEMM (the handle comes with the context); one per recipe.
    if (!fp8gemm_)
      fp8gemm_ = std::make_unique<ops::GemmPlans>(
          ctx.blas_handle, ws_, ops::GemmPlans::kWorkspaceBytes + ops::GemmPlans::kScaleSlotBytes, o_.gemm_algo);
    return *fp8gemm_;
  }

  RowMatrix matrix(const Tensor& t, const LinearDesc& d, const char* what, DType want) const {
    return fp8_gpu_checks::matrix(o_.plugin, t, d, what, want);
  }
  void check_weight(const Tensor& t, const LinearDesc& d, const char* what, DType want) const {
    fp8_gpu_checks::weight(o_.plugin, t, d, what, want);
  }
  int64_t check_rows(const LinearDesc& d, const RowMatrix& m, const char* what) const {
    return fp8_gpu_checks::rows(o_.plugin, d, m, what);
  }

  // A variable-row linear's GEMMs (an MoE expert's: its token count changes
  // every call) share plans per bucket of counts (loom/ops/gemm.hpp).
  static void vary(ops::Fp8GemmOptions& opt, const LinearDesc& d, ops::GemmVarying dim) {
    if (!d.variable_rows) return;
    opt.varying = dim;
    opt.varying_max = d.max_rows;
  }

  // cuBLASLt's FP8 GEMMs take a multiple of 16 rows. A variable-row linear
  // (an MoE expert's share of the tokens) runs the largest multiple of 16 of
  // its rows in FP8 and the rest (fewer than 16) in bf16, forward and backward
  // alike; the tail's tensors do not enter the amaxes. Said once.
  void split_rows(const Linear& l, int64_t rows, int64_t head) {
    if (told_split_) return;
    told_split_ = true;
    log_info(cat("precision ", o_.plugin, ": ", l.desc.name, " was called with ", rows, " rows: the first ", head,
                 " run in FP8, the last ", rows - head, " in bf16 (cuBLASLt's FP8 GEMMs take multiples of 16 rows; "
                 "every variable-row linear's calls are split so; said once)"));
  }
  // Any other call whose rows are not a multiple of 16 (fewer than 16 rows
  // of an expert) runs in bf16, and its tensors do not enter the amaxes.
  void unaligned_rows(Linear& l, int64_t rows) {
    l.saved_rows = -1;
    if (warned_rows_) return;
    warned_rows_ = true;
    log_warn(cat("precision ", o_.plugin, ": ", l.desc.name, " was called with ", rows,
                 " rows, fewer than 16 or not a multiple of 16, which cuBLASLt's FP8 GEMMs need: such calls run in "
                 "bf16 (this linear's and any other's; said once)"));
  }

  // Casts `src` into q and q_t with slot t's scale. Current scaling first
  // measures the tensor and sets the slot's scale from it (on the device);
  // the cast's amax goes to the step's buffer, or under delayed scaling to
  // the pending buffer when `pending` (a forward's tensors).
  // measured: current scaling, and the tensor's producer already wrote its
  // amax into the slot (operand_amax).
  void cast(const Tensor& src, Tensor* q, Tensor* qt, int64_t t, bool pending, cudaStream_t stream,
            bool measured = false) {
    if (o_.scaling.scaling == fp8::Scaling::current) {
      if (!measured) {
        LOOM_CUDA_CHECK(cudaMemsetAsync(cur_ + t, 0, sizeof(float), stream), "precision ", o_.plugin,
                        ": clearing the amax of slot ", t);
        gpu::fp8_amax(src, cur_ + t, stream);
      }
      gpu::fp8_update_scales(cur_, scale_, scale_inv_, t, 1, o_.scaling.formats, o_.scaling.margin, counts_, stream);
      gpu::fp8_cast(src, q, qt, scale_ + t, step_amax_ + t, stream);
      return;
    }
    float* amax = step_amax_ + t;
    if (pending) {
      amax = pend_ + t;
      LOOM_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream), "precision ", o_.plugin,
                      ": clearing the pending amax of slot ", t);
    }
    gpu::fp8_cast(src, q, qt, scale_ + t, amax, stream);
  }

  // step_amax[t] = max(step_amax[t], pend[t]) (a one-element amax pass).
  void merge_pending(int64_t t, cudaStream_t stream) {
    const Tensor p(pend_ + t, DType::f32, Device::cuda, {1, 1});
    gpu::fp8_amax(p, step_amax_ + t, stream);
  }

  void cast_weight(Linear& l, const Tensor& w, cudaStream_t stream) {
    if (l.weight_cast) return;
    const DType tw = fp8_dtype(host_.format(Role::w));
    Tensor qw(ws_ + gemm_bytes() + l.w_off, tw, Device::cuda, {l.desc.out, l.desc.in});
    Tensor qwt(ws_ + gemm_bytes() + l.wt_off, tw, Device::cuda, {l.desc.in, l.desc.out});
    cast(w, &qw, &qwt, fp8::ScalingState::slot(l.slot, Role::w), /*pending=*/true, stream);
    l.weight_cast = true;
  }

  // The FP8 W that fprop reads. "step": this step's cached copy (cast at the
  // first call). "layer": cast now into the shared scratch; the first cast of
  // the step is cast() itself (current scaling measures W and sets its scale;
  // delayed puts W's amax in the pending slot, merged by each backward), the
  // later ones reuse that scale and leave the amaxes alone: the same bits and
  // the same bookkeeping as "step".
  Tensor weight_for_fprop(Linear& l, int id, const Tensor& w, cudaStream_t stream) {
    const DType tw = fp8_dtype(host_.format(Role::w));
    if (!per_layer_) {
      cast_weight(l, w, stream);
      return Tensor(ws_ + gemm_bytes() + l.w_off, tw, Device::cuda, {l.desc.out, l.desc.in});
    }
    const int64_t t = fp8::ScalingState::slot(l.slot, Role::w);
    if (holds_codes(id)) {
      // The gathered codes are W's cast (encode(W * the codec's scale)): the
      // GEMM reads them in place. The codec's scale, 1 / scale and amax
      // become the slot's at the step's first forward, as cast() would set
      // them from W's amax (the same value: the codec measured W).
      if (!l.w_scale_known) {
        LOOM_CUDA_CHECK(cudaMemcpyAsync(scale_ + t, codes_->scale(id), sizeof(float), cudaMemcpyDeviceToDevice, stream),
                        "precision ", o_.plugin, ": ", l.desc.name, ": the gathered weight's scale into slot ", t);
        LOOM_CUDA_CHECK(cudaMemcpyAsync(scale_inv_ + t, codes_->scale_inv(id), sizeof(float), cudaMemcpyDeviceToDevice,
                                        stream),
                        "precision ", o_.plugin, ": ", l.desc.name, ": the gathered weight's 1 / scale into slot ", t);
        gpu::fp8_amax(Tensor(const_cast<float*>(codes_->amax(id)), DType::f32, Device::cuda, {1, 1}), step_amax_ + t,
                      stream);
        l.w_scale_known = true;
      }
      return codes_of(l, id, w, tw);
    }
    Tensor qw(ws_ + gemm_bytes(), tw, Device::cuda, {l.desc.out, l.desc.in});
    if (!l.w_scale_known) {
      cast(w, &qw, nullptr, t, /*pending=*/true, stream);
      l.w_scale_known = true;
    } else {
      gpu::fp8_cast(w, &qw, nullptr, scale_ + t, nullptr, stream);
    }
    return qw;
  }

  // The FP8 Wᵀ that dgrad reads: "step": the cached copy; "layer": cast now
  // into the shared scratch with the step's scale (the forward of this
  // backward measured W under current scaling).
  Tensor weight_for_dgrad(Linear& l, int id, const Tensor& w, cudaStream_t stream) {
    const DType tw = fp8_dtype(host_.format(Role::w));
    if (!per_layer_) return Tensor(ws_ + gemm_bytes() + l.wt_off, tw, Device::cuda, {l.desc.in, l.desc.out});
    LOOM_CHECK(l.w_scale_known, "precision ", o_.plugin, ": ", l.desc.name,
               ": dgrad before any forward of this step cast the weight");
    Tensor qwt(ws_ + gemm_bytes(), tw, Device::cuda, {l.desc.in, l.desc.out});
    if (holds_codes(id)) {
      gpu::fp8_transpose(qwt, codes_of(l, id, w, tw), stream);  // Wᵀ from the gathered codes
      return qwt;
    }
    gpu::fp8_cast(w, nullptr, &qwt, scale_ + fp8::ScalingState::slot(l.slot, Role::w), nullptr, stream);
    return qwt;
  }

  // Linear `id`'s weight arrives as FP8 codes, not bf16 values (the codec's
  // DirectCodes, enabled at setup() for "layer").
  bool holds_codes(int id) const { return codes_ != nullptr && codes_->holds_codes(id); }

  // W's codes [out, in], where the gather of the parameters w left them: in
  // the gathered wire, or the first out * in bytes of w itself.
  Tensor codes_of(const Linear& l, int id, const Tensor& w, DType tw) const {
    LOOM_CHECK(w.is_contiguous() && w.numel() == l.desc.out * l.desc.in, "precision ", o_.plugin, ": ", l.desc.name,
               ": the gathered weight ", w.shape_str(), " is not the contiguous [", l.desc.out, ", ", l.desc.in,
               "] its codes fill");
    return Tensor(const_cast<void*>(codes_->codes(id, w.data)), tw, Device::cuda, {l.desc.out, l.desc.in});
  }

  // A call the FP8 GEMMs cannot take goes through bf16 GEMMs that read W in
  // bf16, which a weight gathered as codes does not hold. The codec only
  // takes linears whose rows always suit the FP8 GEMMs, so this is a bug.
  void refuse_bf16_of_codes(const Linear& l, int id, int64_t rows) const {
    LOOM_CHECK(!holds_codes(id), "precision ", o_.plugin, ": ", l.desc.name, ": a call of ", rows,
               " rows needs the bf16 GEMMs, but this linear's weight was gathered as FP8 codes "
               "(precision.gathered_codes); set precision.gathered_codes = false to run it");
  }

  void read_counts() {
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_), "precision ", o_.plugin, ": waiting for the FP8 counters");
    LOOM_CUDA_CHECK(cudaMemcpy(h_counts_, counts_, sizeof(h_counts_), cudaMemcpyDeviceToHost), "precision ",
                    o_.plugin, ": reading the FP8 counters");
  }

  GpuOptions o_;
  fp8_gather::DirectCodes* codes_ = nullptr;  // the codec this recipe made (gather_codec), owned by the core
  fp8::ScalingState host_;  // names, formats; checks and inverse scales on resume
  precision_common::CublasLtLinears lt_;
  std::unique_ptr<ops::GemmPlans> fp8gemm_;
  std::vector<Linear> linears_;
  Communicator* dp_ = nullptr;
  bool set_up_ = false;
  int64_t T_ = 0;
  // Planned memory.
  char* ws_ = nullptr;
  char* saved_ = nullptr;
  size_t weight_bytes_ = 0, x_scratch_ = 0, dy_scratch_ = 0, saved_total_ = 0;
  size_t max_weight_bytes_ = 0;  // the largest FP8 weight, rounded: the "layer" scratch
  bool per_layer_ = false;       // weight_cache resolved at setup()
  // Device state (one allocation, made at setup).
  void* dev_ = nullptr;
  float *step_amax_ = nullptr, *pend_ = nullptr, *cur_ = nullptr, *last_amax_ = nullptr;
  float *scale_ = nullptr, *scale_inv_ = nullptr, *history_ = nullptr;
  uint32_t* counts_ = nullptr;  // skipped updates, non-finite amaxes
  cudaStream_t stream_ = nullptr;  // the stream of the last call (the core's compute stream)
  // Host side.
  int64_t head_ = 0, steps_ = 0;
  double counters_[4] = {0, 0, 0, 0};  // checkpointed: head, steps, skipped, non-finite
  double options_[fp8::ScalingState::kOptionsRecord] = {};  // checkpointed: ScalingState::options_record
  uint32_t h_counts_[2] = {0, 0};
  precision_common::LogMirror mirror_;  // the log line's pinned copies of the state (log_summary)
  mutable int64_t skipped_mark_ = 0;
  mutable bool warned_skip_ = false;
  bool warned_rows_ = false;
  bool told_split_ = false;
};

}  // namespace

std::unique_ptr<Precision> make_gpu_recipe(const GpuOptions& options) { return std::make_unique<Fp8Gpu>(options); }

}  // namespace loom::fp8_recipe
