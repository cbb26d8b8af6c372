// The fp8_block recipe on CUDA (fp8_block.hpp's make_gpu_recipe): the block
// casts of loom/ops/fp8_block_cast.hpp and the block-scaled cuBLASLt
// GEMMs of loom/ops/gemm.hpp. Built only with CUDA.
//
// Per step and FP8 linear (all but the LM head unless fp8_head = true; the
// head, and any call whose row count is not a multiple of 128, goes through
// the bf16 cuBLASLt GEMMs of cublaslt_linear.hpp):
//   forward   weight_cache = "step": W cast once per optimizer step in
//             128x128 blocks into W and Wᵀ with their block scale inverses
//             (workspace, 2 bytes per parameter), read by every micro-batch;
//             weight_cache = "layer": W (q and its block scales only) cast
//             into one scratch shared by every linear (sized for the
//             largest) just before fprop, and Wᵀ into it again before dgrad
//             (the scales are per block of W itself: the same bits as
//             "step"); x cast in 1x128
//             tiles (workspace scratch, fprop) and in 128x1 tiles as xᵀ (the
//             linear's saved activation, wgrad); fprop y = x Wᵀ (+ residual).
//   backward  dy cast in 1x128 tiles (dgrad) and as dyᵀ in 128x1 tiles
//             (wgrad); dgrad dx = dy W (B = Wᵀ, the same block scales on the
//             transposed grid), wgrad dW = dyᵀ x (C = dW when accumulating).
//             x itself is never read by an FP8 call (the wgrad reads the saved
//             xᵀ), so the FP8 linears of fixed rows answer keeps_wgrad_input.
// No scaling state: every tile takes its scale from its own amax in the cast
// kernel. The only state is a device counter of tiles with an inf or NaN
// amax, read by the host for the log line and a checkpoint.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <sstream>

#include "loom/ops/cuda_check.hpp"
#include "loom/ops/gemm.hpp"
#include "loom/ops/fp8_block_cast.hpp"
#include "loom/error.hpp"
#include "loom/fp8_block.hpp"
#include "loom/log.hpp"
#include "precision/common/cublaslt_linear.hpp"
#include "precision/common/fp8_gpu_checks.hpp"
#include "precision/common/log_mirror.hpp"
#include "precision/common/fp8_block.hpp"

namespace loom::fp8_block {
namespace {

using loom::fp8_gpu_checks::RowSplit;

namespace blk = fp8::block;
using blk::ScaleMode;

constexpr size_t kAlign = 256;
size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
size_t scale_bytes(ScaleMode m, int64_t rows, int64_t k) {
  return round_up(static_cast<size_t>(blk::scale_floats(m, rows, k)) * sizeof(float));
}
bool aligned(int64_t v) { return v % blk::kBlock == 0; }

class Fp8BlockGpu final : public Precision {
 public:
  explicit Fp8BlockGpu(const Options& o)
      : o_(o),
        lt_("fp8_block",
            precision_common::GemmDTypes{DType::bf16, DType::bf16, o.master_bf16 ? DType::bf16 : DType::f32},
            o.gemm_algo) {}

  ~Fp8BlockGpu() override {
    if (counter_ != nullptr) cudaFree(counter_);  // teardown: nothing worth reporting
  }

  PrecisionDTypes dtypes() const override { return fp8_common::device_dtypes(o_); }

  // A 1x128 tile of every row: other counts of a variable-row linear split
  // off a bf16 tail.
  int64_t variable_row_multiple() const override { return blk::kBlock; }

  int register_linear(const LinearDesc& d) override {
    LOOM_CHECK(!set_up_, "precision fp8_block: linear '", d.name, "' registered after setup()");
    fp8_options::check_linear_shape("fp8_block", d);
    Linear l;
    l.desc = d;
    l.fp8 = d.role != LinearRole::lm_head || o_.fp8_head;
    if (l.fp8) {
      if (!aligned(d.in) || !aligned(d.out) || (!d.variable_rows && !aligned(d.max_rows)))
        throw Error(Fp8BlockRecipe::dims_message(d));
      const int64_t rows = d.max_rows / blk::kBlock * blk::kBlock;  // the most rows an FP8 call can have
      const auto wb = static_cast<size_t>(d.out * d.in);
      l.w_off = weight_bytes_;
      weight_bytes_ += round_up(wb);
      l.wt_off = weight_bytes_;
      weight_bytes_ += round_up(wb);
      l.sw_off = weight_bytes_;
      weight_bytes_ += scale_bytes(ScaleMode::block_128x128, d.out, d.in);
      l.swt_off = weight_bytes_;
      weight_bytes_ += scale_bytes(ScaleMode::block_128x128, d.in, d.out);
      // "layer": W or Wᵀ, then its block scales at round_up(wb), in one scratch.
      max_weight_bytes_ = std::max(max_weight_bytes_, round_up(wb) + std::max(scale_bytes(ScaleMode::block_128x128, d.out, d.in),
                                                                              scale_bytes(ScaleMode::block_128x128, d.in, d.out)));
      // Saved: xᵀ [in, rows] in 1x128 tiles along the tokens, then its scales.
      l.saved_off = saved_total_;
      l.sxt_rel = round_up(static_cast<size_t>(d.in * rows));
      l.saved_bytes = l.sxt_rel + scale_bytes(ScaleMode::tile_1x128, d.in, std::max<int64_t>(rows, blk::kBlock));
      saved_total_ += l.saved_bytes;
      x_scratch_ = std::max(x_scratch_, round_up(static_cast<size_t>(rows * d.in)) +
                                            scale_bytes(ScaleMode::tile_1x128, std::max<int64_t>(rows, 1), d.in));
      dy_scratch_ = std::max(dy_scratch_, round_up(static_cast<size_t>(rows * d.out)) +
                                              scale_bytes(ScaleMode::tile_1x128, std::max<int64_t>(rows, 1), d.out));
      dyt_scratch_ = std::max(dyt_scratch_, round_up(static_cast<size_t>(rows * d.out)) +
                                                scale_bytes(ScaleMode::tile_1x128, d.out,
                                                            std::max<int64_t>(rows, blk::kBlock)));
    }
    l.lt_id = lt_.register_linear(d);
    linears_.push_back(l);
    return static_cast<int>(linears_.size()) - 1;
  }

  size_t saved_activation_bytes(int id) const override {
    LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision fp8_block: linear id ", id,
               " was never registered");
    return linears_[static_cast<size_t>(id)].saved_bytes;
  }

  bool keeps_wgrad_input(int id) const override {
    LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision fp8_block: linear id ", id,
               " was never registered");
    // The wgrad reads xᵀ from the saved activations; a variable_rows linear
    // (an MoE expert) may get a row count that is not a multiple of 128,
    // whose call falls back to the bf16 GEMMs that read x.
    const Linear& l = linears_[static_cast<size_t>(id)];
    return l.fp8 && !l.desc.variable_rows;
  }

  // [0, gemm): the cuBLASLt workspace (the bf16 head's GEMMs and the block
  // GEMMs, one stream); the cast weights ("step": every FP8 linear's W, Wᵀ
  // and their block scales; "layer": one scratch for the largest W or Wᵀ and
  // its scales); the x, dy and dyᵀ scratch with their tile scales.
  size_t gemm_bytes() const { return round_up(ops::GemmPlans::kWorkspaceBytes + ops::GemmPlans::kScaleSlotBytes); }
  // Before setup() "auto" is planned as "step" (the larger).
  bool per_layer() const { return set_up_ ? per_layer_ : o_.weight_cache == WeightCache::layer; }
  size_t weight_region() const { return per_layer() ? max_weight_bytes_ : weight_bytes_; }
  size_t workspace_bytes() const override {
    return gemm_bytes() + weight_region() + x_scratch_ + dy_scratch_ + dyt_scratch_;
  }

  void setup(const PrecisionSetup& s) override {
    LOOM_CHECK(s.data_parallel != nullptr, "precision fp8_block: setup without a data-parallel communicator");
    LOOM_CHECK(s.device == Device::cuda, "precision fp8_block: the GPU path was set up for device ",
               device_name(s.device));
    per_layer_ = weight_cache_per_layer(o_.weight_cache, s.grad_accum, s.params_sharded);
    set_up_ = true;
    const auto [n, full] = fp8_options::split_linears(linears_);
    log_info(cat("precision fp8_block: ", n,
                 " linears in FP8 on CUDA (cuBLASLt block-scaled GEMMs), E4M3, x and dy in 1x128 tiles, W in "
                 "128x128 blocks, wgrad operands in 1x128 tiles along the tokens; no fast accumulation",
                 full.empty() ? std::string() : cat("; in bf16: ", full), "; master ",
                 o_.master_bf16 ? (o_.stochastic_rounding ? "bf16 (stochastic rounding)" : "bf16") : "fp32",
                 "; ", fp8_options::weight_cache_summary(o_.weight_cache, per_layer_, s.params_sharded), "; gemm_algo ",
                 gemm_algo_name(o_.gemm_algo)));
  }

  void set_workspace(void* ptr, size_t bytes) override {
    LOOM_CHECK(bytes >= workspace_bytes() && ptr != nullptr, "precision fp8_block: workspace of ", bytes, " bytes at ",
               ptr, ", ", workspace_bytes(), " needed");
    LOOM_CHECK(reinterpret_cast<uintptr_t>(ptr) % kAlign == 0,
               "precision fp8_block: the workspace must be 256-byte aligned, got address ", ptr);
    LOOM_CHECK(set_up_, "precision fp8_block: set_workspace before setup()");
    if (counter_ == nullptr) {
      LOOM_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&counter_), kAlign), "precision fp8_block: the non-finite tile counter (", kAlign,
                      " bytes)");
      LOOM_CUDA_CHECK(cudaMemset(counter_, 0, kAlign), "precision fp8_block: clearing the non-finite tile counter");
      LOOM_CUDA_CHECK(cudaDeviceSynchronize(), "precision fp8_block: initialising the counter");
      mirror_.allocate({sizeof(uint32_t)}, "fp8_block");
    }
    ws_ = static_cast<char*>(ptr);
    lt_.set_workspace(ws_, precision_common::CublasLtLinears::kWorkspaceBytes);
    if (gemm_) gemm_->set_workspace(ws_, ops::GemmPlans::kWorkspaceBytes + ops::GemmPlans::kScaleSlotBytes);
    for (Linear& l : linears_) l.weight_cast = false;
  }

  void set_saved_activations(void* ptr, size_t bytes) override {
    saved_ = fp8_gpu_checks::saved_activations(kPlugin, ptr, bytes, saved_total_);
  }

  void linear_forward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, Tensor& y,
                      const Tensor* residual) override {
    Linear& l = lookup(ctx, id);
    if (!l.fp8) return lt_.forward(ctx, l.lt_id, x, w, y, residual);
    const LinearDesc& d = l.desc;
    auto stream = static_cast<cudaStream_t>(ctx.stream);
    const RowMatrix mx = matrix(x, d, "x", DType::bf16);
    matrix(y, d, "y", DType::bf16);
    check_weight(w, d, "w", DType::bf16);
    const int64_t rows = check_rows(d, mx, "x");
    if (!aligned(rows)) {
      const int64_t head = rows / blk::kBlock * blk::kBlock;
      if (d.variable_rows && head > 0) {
        // An expert's rows: the first `head` in FP8, the rest (< 128) in bf16.
        split_rows(l, rows, head);
        RowSplit xs = fp8_gpu_checks::split_rows(kPlugin, &x, d, "x", rows, head),
                 ys = fp8_gpu_checks::split_rows(kPlugin, &y, d, "y", rows, head),
                 rs = fp8_gpu_checks::split_rows(kPlugin, residual, d, "residual", rows, head);
        linear_forward(ctx, id, xs.head, w, ys.head, rs.head_or_null());
        l.saved_rows = rows;  // the backward splits the same rows
        return lt_.forward(ctx, l.lt_id, xs.tail, w, ys.tail, rs.tail_or_null());
      }
      unaligned_rows(l, rows);
      l.saved_rows = rows;
      return lt_.forward(ctx, l.lt_id, x, w, y, residual);
    }
    l.saved_rows = rows;
    if (rows == 0) return;
    const Tensor qw = cast_weight(l, w, /*transposed=*/false, stream);
    Tensor qx(ws_ + x_off(), DType::e4m3, Device::cuda, {rows, d.in});
    float* sx = reinterpret_cast<float*>(ws_ + x_off() + round_up(static_cast<size_t>(rows * d.in)));
    Tensor qxt(saved_ + l.saved_off, DType::e4m3, Device::cuda, {d.in, rows});
    gpu::fp8_block_cast_rows_cols(x, qx, sx, qxt, reinterpret_cast<float*>(saved_ + l.saved_off + l.sxt_rel),
                                  counter_, stream);
    ops::scaled_gemm(gemm(ctx), {&qx, sx, ops::GemmScale::tile_1x128}, {&qw, weight_scales(l, false), ops::GemmScale::block_128x128}, y,
                   residual, stream, d.variable_rows ? ops::GemmVarying::m : ops::GemmVarying::none, d.max_rows);
  }

  void linear_backward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx,
                       Tensor& dw, bool accumulate) override {
    Linear& l = lookup(ctx, id);
    if (!l.fp8) return lt_.backward(ctx, l.lt_id, x, w, dy, dx, dw, accumulate);
    const LinearDesc& d = l.desc;
    auto stream = static_cast<cudaStream_t>(ctx.stream);
    const RowMatrix mdy = matrix(dy, d, "dy", DType::bf16);
    check_weight(w, d, "w", DType::bf16);
    check_weight(dw, d, "dw", o_.master_bf16 ? DType::bf16 : DType::f32);
    // x is read only by the bf16 fallback (rows not a multiple of 128); an
    // empty x (keeps_wgrad_input) takes the rows from dy.
    const bool have_x = x.data != nullptr;
    const int64_t rows = have_x ? check_rows(d, matrix(x, d, "x", DType::bf16), "x") : mdy.rows;
    LOOM_CHECK(rows <= d.max_rows, "precision fp8_block: ", d.name, ": dy has ", rows,
               " rows, more than the max_rows=", d.max_rows, " it was registered with");
    fp8_common::check_saved_rows("fp8_block", d, l.saved_rows, rows);
    l.saved_rows = -1;
    if (!aligned(rows)) {
      LOOM_CHECK(have_x, "precision fp8_block: ", d.name, ": backward of ", rows,
                 " rows (not a multiple of 128: a bf16 GEMM that reads x) was given an empty x; the linear is not "
                 "variable_rows, so keeps_wgrad_input said x was not needed");
      const int64_t head = rows / blk::kBlock * blk::kBlock;
      if (d.variable_rows && head > 0) {
        // As the forward split it: the FP8 backward of the first `head` rows
        // (its forward cast them), then the tail's bf16 GEMMs adding to dW.
        RowSplit xs = fp8_gpu_checks::split_rows(kPlugin, &x, d, "x", rows, head),
                 dys = fp8_gpu_checks::split_rows(kPlugin, &dy, d, "dy", rows, head),
                 dxs = fp8_gpu_checks::split_rows(kPlugin, dx, d, "dx", rows, head);
        l.saved_rows = head;  // what the forward's FP8 part cast
        linear_backward(ctx, id, xs.head, w, dys.head, dxs.head_or_null(), dw, accumulate);
        return lt_.backward(ctx, l.lt_id, xs.tail, w, dys.tail, dxs.tail_or_null(), dw, /*accumulate=*/true);
      }
      return lt_.backward(ctx, l.lt_id, x, w, dy, dx, dw, accumulate);
    }
    LOOM_CHECK(mdy.rows == rows && mdy.cols == d.out, "precision fp8_block: ", d.name, ": dy is [", mdy.rows, ", ",
               mdy.cols, "], expected [", rows, ", ", d.out, "]");
    if (dx != nullptr) {
      const RowMatrix mdx = matrix(*dx, d, "dx", DType::bf16);
      LOOM_CHECK(mdx.rows == rows && mdx.cols == d.in, "precision fp8_block: ", d.name, ": dx is [", mdx.rows, ", ",
                 mdx.cols, "], expected [", rows, ", ", d.in, "]");
    }
    if (rows == 0) {
      if (!accumulate)
        LOOM_CUDA_CHECK(cudaMemsetAsync(dw.data, 0, dw.bytes(), stream), "precision fp8_block: ", d.name,
                        ": clearing dW (", dw.bytes(), " bytes)");
      return;
    }
    Tensor qdy(ws_ + dy_off(), DType::e4m3, Device::cuda, {rows, d.out});
    float* sdy = reinterpret_cast<float*>(ws_ + dy_off() + round_up(static_cast<size_t>(rows * d.out)));
    Tensor qdyt(ws_ + dyt_off(), DType::e4m3, Device::cuda, {d.out, rows});
    float* sdyt = reinterpret_cast<float*>(ws_ + dyt_off() + round_up(static_cast<size_t>(rows * d.out)));
    gpu::fp8_block_cast_rows_cols(dy, qdy, sdy, qdyt, sdyt, counter_, stream);
    if (dx != nullptr) {
      // "step": the copy cast by the forward; "layer": Wᵀ cast into the scratch now (only dgrad reads it).
      const Tensor qwt = cast_weight(l, w, /*transposed=*/true, stream);
      ops::scaled_gemm(gemm(ctx), {&qdy, sdy, ops::GemmScale::tile_1x128}, {&qwt, weight_scales(l, true), ops::GemmScale::block_128x128},
                     *dx, nullptr, stream, d.variable_rows ? ops::GemmVarying::m : ops::GemmVarying::none, d.max_rows);
    }
    const Tensor qxt(saved_ + l.saved_off, DType::e4m3, Device::cuda, {d.in, rows});
    ops::scaled_gemm(gemm(ctx), {&qdyt, sdyt, ops::GemmScale::tile_1x128},
                   {&qxt, reinterpret_cast<const float*>(saved_ + l.saved_off + l.sxt_rel), ops::GemmScale::tile_1x128}, dw,
                   accumulate ? &dw : nullptr, stream, d.variable_rows ? ops::GemmVarying::k : ops::GemmVarying::none,
                   d.max_rows);
  }

  void end_step(const ExecContext& ctx) override {
    LOOM_CHECK(set_up_, "precision fp8_block: end_step before setup()");
    stream_ = static_cast<cudaStream_t>(ctx.stream);
    for (Linear& l : linears_) l.weight_cast = false;  // the optimizer changed the weights
    ++steps_;
    // What the log line of this step shows, read by log_summary() without a sync.
    if (counter_ != nullptr) mirror_.queue(stream_, {counter_}, steps_, "fp8_block");
  }

  std::vector<StateTensor> state_tensors() override {
    read_counter();
    counters_[0] = static_cast<double>(steps_);
    counters_[1] = static_cast<double>(h_count_);
    return {{"fp8_block.counters", Tensor(counters_, DType::f64, Device::cpu, {2}), false}};
  }

  void state_loaded() override {
    for (Linear& l : linears_) {
      l.weight_cast = false;
      l.saved_rows = -1;
    }
    // Both checked before either is taken (the device counts tiles in 32 bits).
    const int64_t steps = fp8_options::restored_count(counters_[0], "fp8_block.counters", 0, "the steps taken");
    const int64_t tiles = fp8_options::restored_count(counters_[1], "fp8_block.counters", 1,
                                                      "the tiles with a non-finite amax", UINT32_MAX);
    steps_ = steps;
    h_count_ = static_cast<uint32_t>(tiles);
    mark_ = h_count_;
    if (counter_ != nullptr) {
      LOOM_CUDA_CHECK(cudaMemcpy(counter_, &h_count_, sizeof(h_count_), cudaMemcpyHostToDevice),
                      "precision fp8_block: writing the restored non-finite tile count ", h_count_);
      LOOM_CUDA_CHECK(cudaDeviceSynchronize(), "precision fp8_block: writing the restored counter");
    }
  }

  std::string log_summary() const override {
    // The newest end_step copy the device has finished: no host sync.
    int64_t at = 0;
    const char* got = mirror_.newest(&at);
    if (got == nullptr) return "fp8_block state not copied back yet";
    uint32_t count = 0;
    std::memcpy(&count, got, sizeof(count));
    const int64_t since = static_cast<int64_t>(count) - mark_;
    mark_ = count;
    warn_nonfinite_tiles(warned_, since, cat("by step ", at));
    std::ostringstream os;
    os << "fp8_block non-finite tiles " << count << " (" << since << " since the last log line) as of step " << at;
    return os.str();
  }

 private:
  inline static const std::string kPlugin = "fp8_block";  // for the shared checks' messages
  struct Linear {
    LinearDesc desc;
    bool fp8 = false;
    int lt_id = -1;
    size_t w_off = 0, wt_off = 0, sw_off = 0, swt_off = 0;  // bytes after the GEMM workspace
    size_t saved_off = 0, saved_bytes = 0, sxt_rel = 0;      // xᵀ, then its scales at saved_off + sxt_rel
    bool weight_cast = false;
    int64_t saved_rows = -1;
  };

  size_t x_off() const { return gemm_bytes() + weight_region(); }
  size_t dy_off() const { return x_off() + x_scratch_; }
  size_t dyt_off() const { return dy_off() + dy_scratch_; }

  Linear& lookup(const ExecContext& ctx, int id) {
    fp8_gpu_checks::call(kPlugin, ctx, id, linears_.size());
    Linear& l = linears_[static_cast<size_t>(id)];
    LOOM_CHECK(set_up_ && ws_ != nullptr && (!l.fp8 || saved_ != nullptr), "precision fp8_block: ", l.desc.name,
               " called before setup() and the planned memory were given");
    stream_ = static_cast<cudaStream_t>(ctx.stream);
    return l;
  }

  ops::GemmPlans& gemm(const ExecContext& ctx) {
    if (!gemm_)
      gemm_ = std::make_unique<ops::GemmPlans>(ctx.blas_handle, ws_, ops::GemmPlans::kWorkspaceBytes + ops::GemmPlans::kScaleSlotBytes,
                                                  o_.gemm_algo);
    return *gemm_;
  }

  RowMatrix matrix(const Tensor& t, const LinearDesc& d, const char* what, DType want) const {
    return fp8_gpu_checks::matrix(kPlugin, t, d, what, want);
  }
  void check_weight(const Tensor& t, const LinearDesc& d, const char* what, DType want) const {
    fp8_gpu_checks::weight(kPlugin, t, d, what, want);
  }
  int64_t check_rows(const LinearDesc& d, const RowMatrix& m, const char* what) const {
    return fp8_gpu_checks::rows(kPlugin, d, m, what);
  }

  // 1x128 tiles along the tokens need a multiple of 128 rows. A variable-row
  // linear (an MoE expert's share of the tokens) runs the largest multiple of
  // 128 of its rows in FP8 and the rest (fewer than 128) in bf16, forward and
  // backward alike. Said once.
  void split_rows(const Linear& l, int64_t rows, int64_t head) {
    if (told_split_) return;
    told_split_ = true;
    log_info(cat("precision fp8_block: ", l.desc.name, " was called with ", rows, " rows: the first ", head,
                 " run in FP8, the last ", rows - head, " in bf16 (1x128 tiles along the tokens take multiples of "
                 "128 rows; every variable-row linear's calls are split so; said once)"));
  }
  // Any other call whose rows are not a multiple of 128 (fewer than 128 rows
  // of an expert) runs in bf16.
  void unaligned_rows(const Linear& l, int64_t rows) { warn_unaligned_rows(warned_rows_, l.desc, rows, "bf16"); }

  // W ([out, in], transposed = false) or Wᵀ ([in, out]) in FP8 for the
  // GEMM. "step": both cast together once per optimizer step into the
  // linear's own copies. "layer": the one asked for cast into the shared
  // scratch at every call (its block scales after it, weight_scales), the
  // tiles counted at the first cast of the step only, as "step" counts them.
  Tensor cast_weight(Linear& l, const Tensor& w, bool transposed, cudaStream_t stream) {
    const LinearDesc& d = l.desc;
    char* base = ws_ + gemm_bytes();
    const int64_t r = transposed ? d.in : d.out, c = transposed ? d.out : d.in;
    if (per_layer_) {
      Tensor q(base, DType::e4m3, Device::cuda, {r, c});
      float* s = const_cast<float*>(weight_scales(l, transposed));
      gpu::fp8_block_cast_blocks(w, transposed ? nullptr : &q, transposed ? &q : nullptr, transposed ? nullptr : s,
                                 transposed ? s : nullptr, l.weight_cast ? nullptr : counter_, stream);
      l.weight_cast = true;
      return q;
    }
    if (!l.weight_cast) {
      Tensor qw(base + l.w_off, DType::e4m3, Device::cuda, {d.out, d.in});
      Tensor qwt(base + l.wt_off, DType::e4m3, Device::cuda, {d.in, d.out});
      gpu::fp8_block_cast_blocks(w, &qw, &qwt, reinterpret_cast<float*>(base + l.sw_off),
                                 reinterpret_cast<float*>(base + l.swt_off), counter_, stream);
      l.weight_cast = true;
    }
    return Tensor(base + (transposed ? l.wt_off : l.w_off), DType::e4m3, Device::cuda, {r, c});
  }

  // The block scale inverses of cast_weight's W or Wᵀ.
  const float* weight_scales(const Linear& l, bool transposed) const {
    char* base = ws_ + gemm_bytes();
    if (per_layer_) return reinterpret_cast<const float*>(base + round_up(static_cast<size_t>(l.desc.out * l.desc.in)));
    return reinterpret_cast<const float*>(base + (transposed ? l.swt_off : l.sw_off));
  }

  void read_counter() {
    if (counter_ == nullptr) return;
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_), "precision fp8_block: waiting for the step's casts");
    LOOM_CUDA_CHECK(cudaMemcpy(&h_count_, counter_, sizeof(h_count_), cudaMemcpyDeviceToHost),
                    "precision fp8_block: reading the non-finite tile counter");
  }

  Options o_;
  precision_common::CublasLtLinears lt_;
  std::unique_ptr<ops::GemmPlans> gemm_;
  std::vector<Linear> linears_;
  bool set_up_ = false;
  char* ws_ = nullptr;
  char* saved_ = nullptr;
  size_t max_weight_bytes_ = 0;  // "layer": the largest W or Wᵀ with its block scales, rounded
  bool per_layer_ = false;       // weight_cache resolved at setup()
  size_t weight_bytes_ = 0, x_scratch_ = 0, dy_scratch_ = 0, dyt_scratch_ = 0, saved_total_ = 0;
  uint32_t* counter_ = nullptr;  // device: tiles with an inf or NaN amax
  precision_common::LogMirror mirror_;  // the log line's pinned copy of the counter (log_summary)
  cudaStream_t stream_ = nullptr;
  int64_t steps_ = 0;
  uint32_t h_count_ = 0;
  double counters_[2] = {0, 0};  // checkpointed: steps, non-finite tiles
  mutable int64_t mark_ = 0;
  mutable bool warned_ = false;
  bool warned_rows_ = false;
  bool told_split_ = false;
};

}  // namespace

std::unique_ptr<Precision> make_gpu_recipe(const Options& options) { return std::make_unique<Fp8BlockGpu>(options); }

}  // namespace loom::fp8_block
