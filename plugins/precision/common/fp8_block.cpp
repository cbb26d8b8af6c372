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
#include "precision/common/residual.hpp"

namespace loom::fp8_block {

namespace blk = fp8::block;

struct Fp8BlockRecipe::Linear {
  LinearDesc desc;
  bool fp8 = false;
  int64_t weight_offset = 0;  // floats into the workspace: q(W) [out, in] (128x128 blocks; "step" only)
  int64_t saved_offset = 0;   // floats into the saved activations: x in 128x1 tiles, [max_rows, in]
  bool weight_cast = false;   // cast (and its tiles counted) since the last end_step
  int64_t saved_rows = -1;    // rows the last forward cast (-1: none since the last backward)
  bool full_call = false;     // the last forward ran in full precision (rows not a multiple of 128)
};

namespace {

constexpr const char* kPlugin = "fp8_block";

bool aligned(int64_t v) { return v % blk::kBlock == 0; }

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
  for (const char* key : {"fast_accum_fprop", "fast_accum_dgrad", "fast_accum_wgrad"})
    if (c.get_bool(key, false))
      c.fail(key, cat(key, " = true: block-scaled FP8 GEMMs have no fast-accumulation mode; the per-block scales "
                      "are applied as the fp32 partial sums are promoted, every 128 k. PyTorch's scaled_gemm refuses "
                      "it (\"scaled_gemm doesn't support fast accum with 1x128 blockwise scaling\", "
                      "aten/src/ATen/cuda/CUDABlas.cpp) and TransformerEngine forces use_split_accumulator = True "
                      "for its blockwise FP8 GEMMs. Set it to false or remove it"));
  const fp8_options::Master master = fp8_options::Master::read(c);
  o_.fp8_head = c.get_bool("fp8_head", false);
  o_.weight_cache = fp8_options::read_weight_cache(c);
  o_.gemm_algo = read_gemm_algo(c, init.deterministic);  // CUDA's GEMMs; the CPU emulation has one way
  c.finish();
  master.check(c, init.device);
  o_.master_bf16 = master.bf16;
  o_.stochastic_rounding = master.stochastic_rounding;
  if (init.device == Device::cuda) gpu_ = make_gpu_recipe(o_);
}

Fp8BlockRecipe::~Fp8BlockRecipe() = default;

#ifndef LOOM_FP8_BLOCK_GPU
std::unique_ptr<Precision> make_gpu_recipe(const Options&) {
  throw Error("precision.plugin = \"fp8_block\" cannot run with run.device = \"cuda\": this build of Loom has no CUDA "
              "backend. Run it with run.device = \"cpu\" (FP8 emulated on the CPU), or rebuild with CUDA");
}
#endif

PrecisionDTypes Fp8BlockRecipe::dtypes() const {
  if (gpu_) return gpu_->dtypes();
  return {DType::f32, DType::f32, DType::f32, DType::f32, DType::f32, /*has_master=*/false};
}

int Fp8BlockRecipe::register_linear(const LinearDesc& d) {
  if (gpu_) return gpu_->register_linear(d);
  LOOM_CHECK(!set_up_, "precision fp8_block: linear '", d.name, "' registered after setup()");
  fp8_options::check_linear_shape(kPlugin, d);
  Linear l;
  l.desc = d;
  l.fp8 = d.role != LinearRole::lm_head || o_.fp8_head;
  if (l.fp8) {
    if (!aligned(d.in) || !aligned(d.out) || (!d.variable_rows && !aligned(d.max_rows)))
      throw Error(dims_message(d));
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

size_t Fp8BlockRecipe::saved_activation_bytes(int id) const {
  if (gpu_) return gpu_->saved_activation_bytes(id);
  LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision fp8_block: linear id ", id,
             " was never registered");
  const Linear& l = linears_[static_cast<size_t>(id)];
  return l.fp8 ? static_cast<size_t>(l.desc.max_rows * l.desc.in) * sizeof(float) : 0;
}

bool Fp8BlockRecipe::keeps_wgrad_input(int id) const {
  if (gpu_) return gpu_->keeps_wgrad_input(id);
  LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision fp8_block: linear id ", id,
             " was never registered");
  // The wgrad reads the token-axis cast of x in the saved activations; a
  // variable_rows linear answers false like the GPU path's (whose calls of
  // row counts that are not multiples of 128 fall back to GEMMs reading x).
  const Linear& l = linears_[static_cast<size_t>(id)];
  return l.fp8 && !l.desc.variable_rows;
}

bool Fp8BlockRecipe::weights_per_layer() const {
  return set_up_ ? per_layer_ : o_.weight_cache == WeightCache::layer;
}

// Cast W ("step": every FP8 linear's; "layer": one scratch for the largest),
// then the x scratch (fprop) and the dy scratch (dgrad, then wgrad).
size_t Fp8BlockRecipe::workspace_bytes() const {
  if (gpu_) return gpu_->workspace_bytes();
  return static_cast<size_t>(weight_region_floats() + x_floats_ + 2 * dy_floats_) * sizeof(float);
}

void Fp8BlockRecipe::setup(const PrecisionSetup& s) {
  if (gpu_) return gpu_->setup(s);
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

void Fp8BlockRecipe::set_workspace(void* ptr, size_t bytes) {
  if (gpu_) return gpu_->set_workspace(ptr, bytes);
  LOOM_CHECK(bytes >= workspace_bytes() && (ptr != nullptr || workspace_bytes() == 0),
             "precision fp8_block: workspace of ", bytes, " bytes, ", workspace_bytes(), " needed");
  workspace_ = static_cast<float*>(ptr);
  for (Linear& l : linears_) l.weight_cast = false;
}

void Fp8BlockRecipe::set_saved_activations(void* ptr, size_t bytes) {
  if (gpu_) return gpu_->set_saved_activations(ptr, bytes);
  LOOM_CHECK(bytes >= static_cast<size_t>(saved_floats_) * sizeof(float) && ptr != nullptr,
             "precision fp8_block: saved activations of ", bytes, " bytes, ", saved_floats_ * 4, " needed");
  saved_ = static_cast<float*>(ptr);
}

Fp8BlockRecipe::Linear& Fp8BlockRecipe::lookup(const ExecContext& ctx, int id) {
  LOOM_CHECK(ctx.device == Device::cpu, "precision fp8_block: called with a ", device_name(ctx.device),
             " context; this recipe object runs on the CPU");
  LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision fp8_block: linear id ", id,
             " was never registered (", linears_.size(), " linears registered)");
  Linear& l = linears_[static_cast<size_t>(id)];
  LOOM_CHECK(!l.fp8 || (set_up_ && workspace_ != nullptr && saved_ != nullptr), "precision fp8_block: ", l.desc.name,
             " called before setup() and the planned memory were given");
  return l;
}

namespace {

RowMatrix matrix(const Tensor& t, const LinearDesc& d, const char* what) {
  LOOM_CHECK(t.data != nullptr, "precision fp8_block: ", d.name, ": ", what, " has no data");
  LOOM_CHECK(t.dtype == DType::f32 && t.device == Device::cpu, "precision fp8_block: ", d.name, ": ", what,
             " must be an fp32 host tensor, got ", dtype_name(t.dtype), " on ", device_name(t.device));
  return fold_rows(t, "precision fp8_block: ", d.name, ": ", what);
}

void check_weight(const Tensor& t, const LinearDesc& d, const char* what) {
  matrix(t, d, what);
  LOOM_CHECK(t.ndim == 2 && t.shape[0] == d.out && t.shape[1] == d.in && t.is_contiguous(), "precision fp8_block: ",
             d.name, ": ", what, " must be a contiguous [out, in] = [", d.out, ",", d.in, "] matrix, got ",
             t.shape_str());
}

void check_shape(const RowMatrix& m, const LinearDesc& d, int64_t cols, int64_t rows, const char* what) {
  LOOM_CHECK(m.cols == cols && m.rows == rows && m.rows <= d.max_rows, "precision fp8_block: ", d.name, ": ", what,
             " is [", m.rows, ", ", m.cols, "], expected [", rows, ", ", cols, "] with at most max_rows=", d.max_rows,
             " rows");
}

void place_residual(const Tensor* residual, Tensor& y, const RowMatrix& my, const LinearDesc& d) {
  if (residual == nullptr) return;
  const RowMatrix mr = matrix(*residual, d, "residual");
  LOOM_CHECK(mr.rows == my.rows && mr.cols == my.cols, "precision fp8_block: ", d.name, ": residual is [", mr.rows,
             ", ", mr.cols, "] but y is [", my.rows, ", ", my.cols, "]");
  LOOM_CHECK(precision_common::residual_layout_ok(residual->data, mr.ld, y.data, my.ld, my.rows, my.cols,
                                                  sizeof(float)),
             "precision fp8_block: ", d.name, ": residual overlaps y without being y");
  if (residual->data == y.data) return;
  const float* src = residual->ptr<const float>();
  float* dst = y.ptr<float>();
  for (int64_t r = 0; r < my.rows; ++r) std::copy(src + r * mr.ld, src + r * mr.ld + my.cols, dst + r * my.ld);
}

}  // namespace

void Fp8BlockRecipe::count(int64_t nonfinite) {
  if (nonfinite == 0) return;
  nonfinite_ += nonfinite;
  if (warned_nonfinite_) return;
  warned_nonfinite_ = true;
  log_warn(cat("precision fp8_block: ", nonfinite, " FP8 tile(s) had an inf or NaN amax at step ", steps_ + 1,
               "; they were cast with scale 1. Later ones are counted in the \"precision:\" part of the log line, "
               "not warned again"));
}

void Fp8BlockRecipe::unaligned_rows(const Linear& l, int64_t rows) {
  if (warned_rows_) return;
  warned_rows_ = true;
  log_warn(cat("precision fp8_block: ", l.desc.name, " was called with ", rows,
               " rows, not a multiple of 128, which 1x128 tiles along the tokens need: such calls run in full "
               "precision (this linear's and any other's; said once)"));
}

void Fp8BlockRecipe::full_forward(const Linear& l, const Tensor& x, const Tensor& w, Tensor& y,
                                  const Tensor* residual) {
  const LinearDesc& d = l.desc;
  const RowMatrix mx = matrix(x, d, "x"), my = matrix(y, d, "y");
  check_weight(w, d, "w");
  check_shape(mx, d, d.in, mx.rows, "x");
  check_shape(my, d, d.out, mx.rows, "y");
  place_residual(residual, y, my, d);
  cpu::linear_forward(y.ptr<float>(), my.ld, x.ptr<const float>(), mx.ld, w.ptr<const float>(), mx.rows, d.in, d.out,
                      residual != nullptr);
}

void Fp8BlockRecipe::full_backward(const Linear& l, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx,
                                   Tensor& dw, bool accumulate) {
  const LinearDesc& d = l.desc;
  const RowMatrix mx = matrix(x, d, "x"), mdy = matrix(dy, d, "dy");
  check_weight(w, d, "w");
  check_weight(dw, d, "dw");
  check_shape(mx, d, d.in, mx.rows, "x");
  check_shape(mdy, d, d.out, mx.rows, "dy");
  if (dx != nullptr) {
    const RowMatrix mdx = matrix(*dx, d, "dx");
    check_shape(mdx, d, d.in, mx.rows, "dx");
    cpu::linear_backward_input(dx->ptr<float>(), mdx.ld, dy.ptr<const float>(), mdy.ld, w.ptr<const float>(), mx.rows,
                               d.in, d.out);
  }
  cpu::linear_backward_weight(dw.ptr<float>(), dy.ptr<const float>(), mdy.ld, x.ptr<const float>(), mx.ld, mx.rows,
                              d.in, d.out, accumulate);
}

const float* Fp8BlockRecipe::cast_weight(Linear& l, const Tensor& w) {
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

void Fp8BlockRecipe::linear_forward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, Tensor& y,
                                    const Tensor* residual) {
  if (gpu_) return gpu_->linear_forward(ctx, id, x, w, y, residual);
  Linear& l = lookup(ctx, id);
  if (!l.fp8) return full_forward(l, x, w, y, residual);
  const LinearDesc& d = l.desc;
  const RowMatrix mx = matrix(x, d, "x"), my = matrix(y, d, "y");
  check_weight(w, d, "w");
  check_shape(mx, d, d.in, mx.rows, "x");
  check_shape(my, d, d.out, mx.rows, "y");
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
  place_residual(residual, y, my, d);
  if (rows > 0) cpu::linear_forward(y.ptr<float>(), my.ld, qx, d.in, qw, rows, d.in, d.out, residual != nullptr);
}

void Fp8BlockRecipe::linear_backward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w,
                                     const Tensor& dy, Tensor* dx, Tensor& dw, bool accumulate) {
  if (gpu_) return gpu_->linear_backward(ctx, id, x, w, dy, dx, dw, accumulate);
  Linear& l = lookup(ctx, id);
  if (!l.fp8) return full_backward(l, x, w, dy, dx, dw, accumulate);
  const LinearDesc& d = l.desc;
  // x is read only by the full-precision fallback (rows not a multiple of
  // 128); it may be empty (keeps_wgrad_input), the rows then come from dy.
  const bool have_x = x.data != nullptr;
  const RowMatrix mdy = matrix(dy, d, "dy");
  const RowMatrix mx = have_x ? matrix(x, d, "x") : RowMatrix{mdy.rows, d.in, d.in};
  check_weight(w, d, "w");
  check_weight(dw, d, "dw");
  check_shape(mx, d, d.in, mx.rows, "x");
  check_shape(mdy, d, d.out, mx.rows, "dy");
  const int64_t rows = mx.rows;
  LOOM_CHECK(l.saved_rows == rows, "precision fp8_block: ", d.name, ": backward of ", rows,
             " rows, but the forward before it cast ",
             l.saved_rows < 0 ? std::string("none") : std::to_string(l.saved_rows),
             " (every backward follows its own forward)");
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
    const RowMatrix mdx = matrix(*dx, d, "dx");
    check_shape(mdx, d, d.in, rows, "dx");
    // "step": the forward's copy; "layer": W cast into the scratch again (only dgrad reads it).
    const float* qw = cast_weight(l, w);
    cpu::linear_backward_input(dx->ptr<float>(), mdx.ld, qdy, d.out, qw, rows, d.in, d.out);
  }
  cpu::linear_backward_weight(dw.ptr<float>(), qdy_t, d.out, saved_ + l.saved_offset, d.in, rows, d.in, d.out,
                              accumulate);
}

void Fp8BlockRecipe::end_step(const ExecContext& ctx) {
  if (gpu_) return gpu_->end_step(ctx);
  LOOM_CHECK(set_up_, "precision fp8_block: end_step before setup()");
  ++steps_;
  for (Linear& l : linears_) l.weight_cast = false;  // the optimizer changed the weights
}

std::vector<StateTensor> Fp8BlockRecipe::state_tensors() {
  if (gpu_) return gpu_->state_tensors();
  counters_[0] = static_cast<double>(steps_);
  counters_[1] = static_cast<double>(nonfinite_);
  // Each rank counts its own tiles.
  return {{"fp8_block.counters", Tensor(counters_, DType::f64, Device::cpu, {2}), false}};
}

void Fp8BlockRecipe::state_loaded() {
  if (gpu_) return gpu_->state_loaded();
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

int64_t Fp8BlockRecipe::variable_row_multiple() const { return gpu_ ? blk::kBlock : 1; }

std::string Fp8BlockRecipe::log_summary() const {
  if (gpu_) return gpu_->log_summary();
  std::ostringstream os;
  os << "fp8_block non-finite tiles " << nonfinite_ << " (" << (nonfinite_ - nonfinite_mark_)
     << " since the last log line)";
  nonfinite_mark_ = nonfinite_;
  return os.str();
}

}  // namespace loom::fp8_block
