// The fp8_block recipe on the CPU (fp8_block.hpp): every cast emulated with
// loom/fp8_block.hpp's reference casts into fp32 copies of the dequantised
// values, the GEMMs in fp32 (loom/cpu_gemm.hpp).
#include "precision/common/fp8_block.hpp"

#include <algorithm>
#include <sstream>

#include "loom/cpu_gemm.hpp"
#include "loom/error.hpp"
#include "loom/fp8_block.hpp"
#include "loom/log.hpp"

namespace loom::fp8_block {

namespace blk = fp8::block;

namespace {

const std::string kPlugin = "fp8_block";

bool aligned(int64_t v) { return v % blk::kBlock == 0; }

using fp8_common::host::check_shape;
using fp8_common::host::matrix;
using fp8_common::host::place_residual;

struct Linear {
  LinearDesc desc;
  bool fp8 = false;
  int64_t weight_offset = 0;  // floats into the workspace: q(W) [out, in] (128x128 blocks; "step" only)
  int64_t saved_offset = 0;   // floats into the saved activations: x in 128x1 tiles, [max_rows, in]
  bool weight_cast = false;   // cast (and its tiles counted) since the last end_step
  int64_t saved_rows = -1;    // rows the last forward cast (-1: none since the last backward)
  bool full_call = false;     // the last forward ran in full precision (rows not a multiple of 128)
};

class Fp8BlockEmulation final : public Precision {
 public:
  explicit Fp8BlockEmulation(const Options& o) : o_(o) {}

  PrecisionDTypes dtypes() const override {
    return {DType::f32, DType::f32, DType::f32, DType::f32, DType::f32, /*has_master=*/false};
  }

  int register_linear(const LinearDesc& d) override {
    LOOM_CHECK(!set_up_, "precision fp8_block: linear '", d.name, "' registered after setup()");
    fp8_options::check_linear_shape(kPlugin, d);
    Linear l;
    l.desc = d;
    l.fp8 = d.role != LinearRole::lm_head || o_.fp8_head;
    if (l.fp8) {
      if (!aligned(d.in) || !aligned(d.out) || (!d.variable_rows && !aligned(d.max_rows)))
        throw Error(Fp8BlockRecipe::dims_message(d));
      l.weight_offset = weight_floats_;
      weight_floats_ += d.out * d.in;
      max_weight_floats_ = std::max(max_weight_floats_, d.out * d.in);
      l.saved_offset = saved_floats_;
      saved_floats_ += d.max_rows * d.in;
      x_floats_ = std::max(x_floats_, d.max_rows * d.in);    // x in 1x128 tiles (fprop)
      dy_floats_ = std::max(dy_floats_, d.max_rows * d.out);  // dy in 1x128 tiles, then in 128x1 tiles
    }
    linears_.push_back(l);
    return static_cast<int>(linears_.size()) - 1;
  }

  size_t saved_activation_bytes(int id) const override {
    LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision fp8_block: linear id ", id,
               " was never registered");
    const Linear& l = linears_[static_cast<size_t>(id)];
    return l.fp8 ? static_cast<size_t>(l.desc.max_rows * l.desc.in) * sizeof(float) : 0;
  }

  bool keeps_wgrad_input(int id) const override {
    LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision fp8_block: linear id ", id,
               " was never registered");
    // The wgrad reads the token-axis cast of x in the saved activations; a
    // variable_rows linear answers false like the GPU path's (whose calls of
    // row counts that are not multiples of 128 fall back to GEMMs reading x).
    const Linear& l = linears_[static_cast<size_t>(id)];
    return l.fp8 && !l.desc.variable_rows;
  }

  // Cast W ("step": every FP8 linear's; "layer": one scratch for the largest),
  // then the x scratch (fprop) and the dy scratch (dgrad, then wgrad).
  size_t workspace_bytes() const override {
    return static_cast<size_t>(weight_region_floats() + x_floats_ + 2 * dy_floats_) * sizeof(float);
  }

  void setup(const PrecisionSetup& s) override {
    LOOM_CHECK(s.data_parallel != nullptr, "precision fp8_block: setup without a data-parallel communicator");
    per_layer_ = weight_cache_per_layer(o_.weight_cache, s.grad_accum, s.params_sharded);
    set_up_ = true;
    const auto [n, full] = fp8_options::split_linears(linears_);
    log_info(cat("precision fp8_block: ", n,
                 " linears in FP8 emulated on the CPU, E4M3 with fine-grained scaling (x and dy in 1x128 tiles, "
                 "W in 128x128 blocks, wgrad operands in 1x128 tiles along the tokens)",
                 full.empty() ? std::string() : cat("; in fp32: ", full), "; ",
                 fp8_options::weight_cache_summary(o_.weight_cache, per_layer_, s.params_sharded)));
  }

  void set_workspace(void* ptr, size_t bytes) override {
    LOOM_CHECK(bytes >= workspace_bytes() && (ptr != nullptr || workspace_bytes() == 0),
               "precision fp8_block: workspace of ", bytes, " bytes, ", workspace_bytes(), " needed");
    workspace_ = static_cast<float*>(ptr);
    for (Linear& l : linears_) l.weight_cast = false;
  }

  void set_saved_activations(void* ptr, size_t bytes) override {
    LOOM_CHECK(bytes >= static_cast<size_t>(saved_floats_) * sizeof(float) && ptr != nullptr,
               "precision fp8_block: saved activations of ", bytes, " bytes, ", saved_floats_ * 4, " needed");
    saved_ = static_cast<float*>(ptr);
  }

  void linear_forward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, Tensor& y,
                      const Tensor* residual) override {
    Linear& l = lookup(ctx, id);
    if (!l.fp8) return full_forward(l, x, w, y, residual);
    const LinearDesc& d = l.desc;
    const auto [mx, my] = fp8_common::host::forward_operands(kPlugin, d, x, w, y);
    const int64_t rows = mx.rows;
    if (!aligned(rows)) {
      unaligned_rows(l, rows);
      l.saved_rows = rows;
      l.full_call = true;
      return full_forward(l, x, w, y, residual);
    }
    l.full_call = false;
    const float* qw = cast_weight(l, w);
    float* qx = workspace_ + weight_region_floats();
    const float* xs = x.ptr<const float>();
    // fprop's x in 1x128 tiles along in; the wgrad's in 128x1 tiles along the tokens, kept for the backward.
    count(blk::qdq_row_tiles(xs, rows, d.in, mx.ld, qx));
    count(blk::qdq_col_tiles(xs, rows, d.in, mx.ld, saved_ + l.saved_offset));
    l.saved_rows = rows;
    place_residual(residual, y, my, kPlugin, d);
    if (rows > 0) cpu::linear_forward(y.ptr<float>(), my.ld, qx, d.in, qw, rows, d.in, d.out, residual != nullptr);
  }

  void linear_backward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w,
                       const Tensor& dy, Tensor* dx, Tensor& dw, bool accumulate) override {
    Linear& l = lookup(ctx, id);
    if (!l.fp8) return full_backward(l, x, w, dy, dx, dw, accumulate);
    const LinearDesc& d = l.desc;
    // x is read only by the full-precision fallback (rows not a multiple of
    // 128); it may be empty (keeps_wgrad_input), the rows then come from dy.
    const bool have_x = x.data != nullptr;
    const auto [mx, mdy] = fp8_common::host::backward_operands(kPlugin, d, x, w, dy, dw);
    const int64_t rows = mx.rows;
    fp8_common::check_saved_rows(kPlugin, d, l.saved_rows, rows);
    l.saved_rows = -1;
    if (!aligned(rows)) {
      LOOM_CHECK(have_x, "precision fp8_block: ", d.name, ": backward of ", rows,
                 " rows (not a multiple of 128: a full-precision GEMM that reads x) was given an empty x; the linear "
                 "is not variable_rows, so keeps_wgrad_input said x was not needed");
      return full_backward(l, x, w, dy, dx, dw, accumulate);
    }
    if (rows == 0) {
      if (!accumulate) std::fill(dw.ptr<float>(), dw.ptr<float>() + d.out * d.in, 0.0f);
      return;
    }
    float* qdy = workspace_ + weight_region_floats() + x_floats_;
    float* qdy_t = qdy + dy_floats_;
    const float* dys = dy.ptr<const float>();
    count(blk::qdq_row_tiles(dys, rows, d.out, mdy.ld, qdy));    // dgrad: 1x128 tiles along out
    count(blk::qdq_col_tiles(dys, rows, d.out, mdy.ld, qdy_t));  // wgrad: 128x1 tiles along the tokens
    if (dx != nullptr) {
      const RowMatrix mdx = matrix(*dx, kPlugin, d, "dx");
      check_shape(mdx, kPlugin, d, d.in, rows, "dx");
      // "step": the forward's copy; "layer": W cast into the scratch again (only dgrad reads it).
      const float* qw = cast_weight(l, w);
      cpu::linear_backward_input(dx->ptr<float>(), mdx.ld, qdy, d.out, qw, rows, d.in, d.out);
    }
    cpu::linear_backward_weight(dw.ptr<float>(), qdy_t, d.out, saved_ + l.saved_offset, d.in, rows, d.in, d.out,
                                accumulate);
  }

  void end_step(const ExecContext& ctx) override {
    LOOM_CHECK(set_up_, "precision fp8_block: end_step before setup()");
    ++steps_;
    for (Linear& l : linears_) l.weight_cast = false;  // the optimizer changed the weights
  }

  std::vector<StateTensor> state_tensors() override {
    counters_[0] = static_cast<double>(steps_);
    counters_[1] = static_cast<double>(nonfinite_);
    // Each rank counts its own tiles.
    return {{"fp8_block.counters", Tensor(counters_, DType::f64, Device::cpu, {2}), false}};
  }

  void state_loaded() override {
    // Both counts are checked before either is taken; they mean the same under
    // any [precision] option (steps, and tiles cast with scale 1 for an inf or
    // NaN amax), so they resume whatever changed.
    const int64_t steps = fp8_options::restored_count(counters_[0], "fp8_block.counters", 0, "the steps taken");
    const int64_t nonfinite =
        fp8_options::restored_count(counters_[1], "fp8_block.counters", 1, "the tiles with a non-finite amax");
    steps_ = steps;
    nonfinite_ = nonfinite;
    nonfinite_mark_ = nonfinite_;
    for (Linear& l : linears_) {
      l.weight_cast = false;
      l.saved_rows = -1;
    }
  }

  // 1: the emulation casts any row count that is a multiple of 128 and runs
  // the others whole in full precision (the GPU path answers 128).
  int64_t variable_row_multiple() const override { return 1; }

  std::string log_summary() const override {
    std::ostringstream os;
    os << "fp8_block non-finite tiles " << nonfinite_ << " (" << (nonfinite_ - nonfinite_mark_)
       << " since the last log line)";
    nonfinite_mark_ = nonfinite_;
    return os.str();
  }

 private:
  Linear& lookup(const ExecContext& ctx, int id) {
    LOOM_CHECK(ctx.device == Device::cpu, "precision fp8_block: called with a ", device_name(ctx.device),
               " context; this recipe object runs on the CPU");
    LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision fp8_block: linear id ", id,
               " was never registered (", linears_.size(), " linears registered)");
    Linear& l = linears_[static_cast<size_t>(id)];
    LOOM_CHECK(!l.fp8 || (set_up_ && workspace_ != nullptr && saved_ != nullptr), "precision fp8_block: ", l.desc.name,
               " called before setup() and the planned memory were given");
    return l;
  }

  // The resolved weight_cache (after setup(); before it, "auto" reads as "step").
  bool weights_per_layer() const {
    return set_up_ ? per_layer_ : o_.weight_cache == WeightCache::layer;
  }

  void count(int64_t nonfinite) {
    if (nonfinite == 0) return;
    nonfinite_ += nonfinite;
    warn_nonfinite_tiles(warned_nonfinite_, nonfinite, cat("at step ", steps_ + 1));
  }

  void unaligned_rows(const Linear& l, int64_t rows) {
    warn_unaligned_rows(warned_rows_, l.desc, rows, "full precision");
  }

  // The linears and calls kept in fp32 (fp8_skeleton.hpp's reference GEMMs).
  void full_forward(const Linear& l, const Tensor& x, const Tensor& w, Tensor& y, const Tensor* residual) {
    fp8_common::host::full_forward(kPlugin, l.desc, x, w, y, residual);
  }
  void full_backward(const Linear& l, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx, Tensor& dw,
                     bool accumulate) {
    fp8_common::host::full_backward(kPlugin, l.desc, x, w, dy, dx, dw, accumulate);
  }

  const float* cast_weight(Linear& l, const Tensor& w) {
    if (per_layer_) {
      // The shared scratch, cast again at every call (the same blocks, scales
      // and codes each time: the weight changes only at end_step); its tiles
      // are counted at the first cast of the step only, as "step" counts them.
      float* qw = workspace_;
      const int64_t nonfinite = blk::qdq_blocks(w.ptr<const float>(), l.desc.out, l.desc.in, l.desc.in, qw);
      if (!l.weight_cast) count(nonfinite);
      l.weight_cast = true;
      return qw;
    }
    float* qw = workspace_ + l.weight_offset;
    if (l.weight_cast) return qw;
    count(blk::qdq_blocks(w.ptr<const float>(), l.desc.out, l.desc.in, l.desc.in, qw));
    l.weight_cast = true;
    return qw;
  }

  Options o_;
  std::vector<Linear> linears_;
  bool set_up_ = false;
  float* workspace_ = nullptr;
  float* saved_ = nullptr;
  bool per_layer_ = false;          // weight_cache resolved at setup()
  int64_t max_weight_floats_ = 0;  // the largest FP8 weight: the "layer" scratch
  int64_t weight_region_floats() const { return weights_per_layer() ? max_weight_floats_ : weight_floats_; }
  int64_t weight_floats_ = 0, x_floats_ = 0, dy_floats_ = 0, saved_floats_ = 0;
  int64_t steps_ = 0, nonfinite_ = 0;
  mutable int64_t nonfinite_mark_ = 0;  // for the log line's "since the last"
  double counters_[2] = {0, 0};  // checkpointed: steps, non-finite tiles
  bool warned_nonfinite_ = false, warned_rows_ = false;
};

}  // namespace

std::string Fp8BlockRecipe::dims_message(const LinearDesc& d) {
  return cat("precision fp8_block: linear '", d.name, "' is [out, in] = [", d.out, ", ", d.in, "] with up to ",
             d.max_rows, fp8_options::rows_origin(d), d.variable_rows ? " (variable rows)" : "",
             "; fine-grained FP8 scaling cuts x and dy in 1x128 tiles (along in, out and the tokens) and W in "
             "128x128 blocks, so in, out",
             d.variable_rows ? "" : " and the rows", " must be multiples of 128. ",
             fp8_options::dims_to_change(d, blk::kBlock, !d.variable_rows),
             ", or use precision.plugin = \"fp8_current\" (per-tensor scaling, multiples of 16)",
             d.role == LinearRole::lm_head ? ", or leave fp8_head = false to keep the LM head in full precision" : "");
}

Fp8BlockRecipe::Fp8BlockRecipe(const PluginInit& init) {
  const ConfigTable& c = init.config;
  const std::string format = c.get_choice("format", "e4m3", {"e4m3", "hybrid"});
  if (format == "hybrid")
    c.fail("format",
           "format = \"hybrid\" (E5M2 gradients) is not offered by precision.plugin = \"fp8_block\": DeepSeek-V3's "
           "fine-grained recipe is E4M3 for every operand (the 1x128 tiles give gradients the range E5M2 would), "
           "and cuBLASLt's block-scaled FP8 GEMMs (VEC128_32F / BLK128x128_32F scales) are established on Hopper "
           "for E4M3 x E4M3 only (benchmarks/fp8_gemm.cpp's probe prints what cuBLASLt answers for E5M2). Use "
           "format = \"e4m3\" (the default), or precision.plugin = \"fp8_current\" / \"fp8_delayed\" for hybrid");
  fp8_options::refuse_history_keys(c, kPlugin, "its own 1x128 tile's or 128x128 block's amax");
  fp8_options::refuse_fused_casts(c, kPlugin, "takes each 1x128 tile's scale from that tile when it casts it");
  fp8_options::refuse_producer_amax(c, kPlugin, "measures each 1x128 tile's amax in the kernel that casts it");
  for (const char* key : {"fast_accum_fprop", "fast_accum_dgrad", "fast_accum_wgrad"})
    if (c.get_bool(key, false))
      c.fail(key, cat(key, " = true: block-scaled FP8 GEMMs have no fast-accumulation mode; the per-block scales "
                      "are applied as the fp32 partial sums are promoted, every 128 k. PyTorch's scaled_gemm refuses "
                      "it (\"scaled_gemm doesn't support fast accum with 1x128 blockwise scaling\", "
                      "aten/src/ATen/cuda/CUDABlas.cpp) and TransformerEngine forces use_split_accumulator = True "
                      "for its blockwise FP8 GEMMs. Set it to false or remove it"));
  Options o;
  static_cast<fp8_options::Common&>(o) = fp8_options::read_common(c, init);
  const bool gpu = init.device == Device::cuda;
  use(gpu ? make_gpu_recipe(o) : make_cpu_recipe(o), gpu);
}

void warn_unaligned_rows(bool& said, const LinearDesc& d, int64_t rows, const char* fallback) {
  if (said) return;
  said = true;
  log_warn(cat("precision fp8_block: ", d.name, " was called with ", rows,
               " rows, not a multiple of 128, which 1x128 tiles along the tokens need: such calls run in ", fallback,
               " (this linear's and any other's; said once)"));
}

void warn_nonfinite_tiles(bool& said, int64_t tiles, const std::string& when) {
  if (said || tiles <= 0) return;
  said = true;
  log_warn(cat("precision fp8_block: ", tiles, " FP8 tile(s) had an inf or NaN amax ", when,
               "; they were cast with scale 1. Later ones are counted in the \"precision:\" part of the log line, "
               "not warned again"));
}

#ifndef LOOM_FP8_BLOCK_GPU
std::unique_ptr<Precision> make_gpu_recipe(const Options&) {
  throw Error("precision.plugin = \"fp8_block\" cannot run with run.device = \"cuda\": this build of Loom has no CUDA "
              "backend. Run it with run.device = \"cpu\" (FP8 emulated on the CPU), or rebuild with CUDA");
}
#endif

std::unique_ptr<Precision> make_cpu_recipe(const Options& o) { return std::make_unique<Fp8BlockEmulation>(o); }

}  // namespace loom::fp8_block
