// The FP8 recipes on the CPU (fp8_recipe.hpp).
#include "precision/common/fp8_recipe.hpp"

#include <algorithm>
#include <cfloat>
#include <cstring>
#include <iomanip>
#include <sstream>

#include "loom/cpu_gemm.hpp"
#include "loom/error.hpp"
#include "loom/fp8.hpp"
#include "loom/fp8_emulated.hpp"
#include "loom/log.hpp"
#include "precision/common/fp8_gather.hpp"
#include "precision/common/residual.hpp"

namespace loom::fp8_recipe {

using fp8::Role;
using fp8_common::host::check_shape;
using fp8_common::host::matrix;
using fp8_common::host::place_residual;

class Fp8Emulation final : public Precision {
 public:
  explicit Fp8Emulation(const GpuOptions& o);

  PrecisionDTypes dtypes() const override;
  int register_linear(const LinearDesc& desc) override;
  size_t saved_activation_bytes(int id) const override;
  bool keeps_wgrad_input(int id) const override;
  size_t workspace_bytes() const override;
  void setup(const PrecisionSetup& setup) override;
  void set_workspace(void* ptr, size_t bytes) override;
  void set_saved_activations(void* ptr, size_t bytes) override;
  void linear_forward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, Tensor& y,
                      const Tensor* residual) override;
  void linear_backward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx,
                       Tensor& dw, bool accumulate) override;
  void end_step(const ExecContext& ctx) override;
  std::vector<StateTensor> state_tensors() override;
  void state_loaded() override;
  std::string log_summary() const override;
  std::unique_ptr<GatherCodec> gather_codec(const GatherCodecSetup& setup) override;

  bool weights_per_layer() const;

 private:
  struct Linear;
  // Checks the context, the id and that the memory was given; the linear.
  Linear& lookup(const ExecContext& ctx, int id);
  // The linears kept in fp32 (fp8_skeleton.hpp's reference GEMMs).
  void full_forward(const Linear& l, const Tensor& x, const Tensor& w, Tensor& y, const Tensor* residual);
  void full_backward(const Linear& l, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx, Tensor& dw,
                     bool accumulate);
  // Casts the weight of FP8 linear `l` unless this step already did.
  const float* cast_weight(Linear& l, const Tensor& w);

  std::string plugin_;
  fp8::Scaling scaling_;
  bool fp8_head_ = false;
  GemmOptions gemm_;
  bool fused_casts_ = true;
  WeightCache weight_cache_ = WeightCache::automatic;
  bool per_layer_ = false;  // resolved at setup()
  int64_t max_weight_floats_ = 0;  // the largest FP8 weight: the "layer" scratch
  int64_t weight_region_floats() const { return per_layer_ ? max_weight_floats_ : weight_floats_; }
  // After the weights and the GEMM scratch: the cast x of a recast_x linear.
  float* x_scratch() const { return workspace_ + weight_region_floats() + gemm_floats_; }
  std::unique_ptr<fp8::ScalingState> state_;
  std::vector<Linear> linears_;
  Communicator* dp_ = nullptr;
  bool set_up_ = false;
  // Memory planned by the core: cast weights ("step": every FP8 linear's;
  // "layer": one scratch for the largest) then the GEMM scratch (workspace),
  // cast x per FP8 linear (saved activations).
  float* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  float* saved_ = nullptr;
  int64_t weight_floats_ = 0, gemm_floats_ = 0, saved_floats_ = 0;
  int64_t x_scratch_floats_ = 0;  // the largest x of a linear whose backward is handed x again
  // Checkpointed beside the scaling state: head, steps, skipped, non-finite
  // (f64), and the options that give the state its meaning (ScalingState's
  // options record), so that a resume under other options can tell.
  double counters_[4] = {0, 0, 0, 0};
  double options_[fp8::ScalingState::kOptionsRecord] = {};
  // The log line: this step's largest amax (after the all-reduce), updates kept.
  float last_max_amax_ = 0.0f;
  int64_t last_kept_ = 0, skipped_mark_ = 0;
  bool warned_skip_ = false;
};

struct Fp8Emulation::Linear {
  LinearDesc desc;
  bool fp8 = false;
  int slot = -1;                // the linear's index in the scaling state (FP8 linears)
  int64_t weight_offset = 0;    // floats into the workspace: the cast weight, [out, in]
  int64_t saved_offset = 0;     // floats into the saved activations: the cast x, [max_rows, in]
  // LinearDesc::input_in_backward: no saved copy; the forward casts x into the
  // x scratch and the backward casts the x it is handed again, with l.x_scale.
  bool recast_x = false;
  bool weight_cast = false;     // "step": this step's cast weight is in the workspace
  bool w_scale_known = false;   // "layer": w_scale and w_amax are this step's (the weight measured once)
  float w_scale = 1.0f, x_scale = 1.0f;
  float w_amax = 0.0f, x_amax = 0.0f;  // delayed: the forward's amaxes, recorded by the backward
  int64_t saved_rows = -1;      // rows of x the last forward cast (-1: none since the last backward)
};

void Fp8Emulation::full_forward(const Linear& l, const Tensor& x, const Tensor& w, Tensor& y, const Tensor* residual) {
  fp8_common::host::full_forward(plugin_, l.desc, x, w, y, residual);
}

void Fp8Emulation::full_backward(const Linear& l, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx,
                                 Tensor& dw, bool accumulate) {
  fp8_common::host::full_backward(plugin_, l.desc, x, w, dy, dx, dw, accumulate);
}

namespace {

// max |x| over a [rows, cols] view with row stride ld; NaN when one is NaN.
float rows_amax(const float* p, int64_t rows, int64_t cols, int64_t ld) {
  if (ld == cols) return fp8::amax(p, rows * cols);
  float m = 0.0f;
  for (int64_t r = 0; r < rows; ++r) {
    const float a = fp8::amax(p + r * ld, cols);
    if (fp8::is_nan(a)) return a;
    m = std::max(m, a);
  }
  return m;
}

// q(x) of a [rows, cols] view into a contiguous copy; returns amax(x).
float cast_rows(const float* p, int64_t rows, int64_t cols, int64_t ld, float scale, fp8::Format f, float* out) {
  if (ld == cols) return fp8::quantize_dequantize(p, rows * cols, scale, f, out);
  float m = 0.0f;
  bool nan = false;
  for (int64_t r = 0; r < rows; ++r) {
    const float a = fp8::quantize_dequantize(p + r * ld, cols, scale, f, out + r * cols);
    if (fp8::is_nan(a)) nan = true;
    else m = std::max(m, a);
  }
  return nan ? fp8::bits_float(0x7FC00000u) : m;
}

}  // namespace

Fp8Recipe::Fp8Recipe(const std::string& plugin, fp8::Scaling scaling, const PluginInit& init) {
  const ConfigTable& c = init.config;
  GpuOptions o;
  o.plugin = plugin;
  fp8::ScalingConfig sc;
  sc.scaling = scaling;
  sc.formats = fp8::parse_formats(c.get_choice("format", "hybrid", {"hybrid", "e4m3"}));
  if (scaling == fp8::Scaling::delayed) {
    sc.amax_history_len = static_cast<int>(c.get_int("amax_history_len", 1024, 1, 1 << 20));
    sc.amax_compute_algo =
        fp8::parse_amax_algo(c.get_choice("amax_compute_algo", "max", {"max", "most_recent"}));
    sc.margin = static_cast<int>(c.get_int("margin", 0, 0, 126));
    o.fused_casts = c.get_bool("fused_casts", true);
    fp8_options::refuse_producer_amax(c, plugin,
                                      "casts with the scale of past amaxes, which its fused layers' kernels write "
                                      "in FP8 directly (precision.fused_casts)");
    o.producer_amax = false;
    if (c.has("gathered_codes"))
      c.fail("gathered_codes",
             cat("precision.gathered_codes applies to FP8 weight gathers, and precision.plugin = \"", plugin,
                 "\" gathers no weights as FP8 codes (sharding.gather_dtype = \"fp8\" needs the scale of each "
                 "weight's own amax, which only fp8_current casts with): remove it, or use precision.plugin = "
                 "\"fp8_current\""));
    o.gathered_codes = false;
  } else {
    fp8_options::refuse_history_keys(c, plugin, "its tensor's own amax");
    fp8_options::refuse_fused_casts(c, plugin, "measures each tensor just before its cast");
    o.fused_casts = false;
    o.gathered_codes = c.get_bool("gathered_codes", true);
    o.producer_amax = c.get_bool("producer_amax", true);
  }
  o.gemm.fast_accum_fprop = c.get_bool("fast_accum_fprop", true);
  o.gemm.fast_accum_dgrad = c.get_bool("fast_accum_dgrad", false);
  o.gemm.fast_accum_wgrad = c.get_bool("fast_accum_wgrad", false);
  static_cast<fp8_options::Common&>(o) = fp8_options::read_common(c, init);
  fp8::validate(sc);
  o.scaling = sc;
  const bool gpu = init.device == Device::cuda;
  use(gpu ? make_gpu_recipe(o) : make_cpu_recipe(o), gpu);
}

Fp8Emulation::Fp8Emulation(const GpuOptions& o)
    : plugin_(o.plugin),
      scaling_(o.scaling.scaling),
      fp8_head_(o.fp8_head),
      gemm_(o.gemm),
      fused_casts_(o.fused_casts),
      weight_cache_(o.weight_cache),
      state_(std::make_unique<fp8::ScalingState>(o.scaling)) {}

std::unique_ptr<Precision> make_cpu_recipe(const GpuOptions& o) { return std::make_unique<Fp8Emulation>(o); }

#ifndef LOOM_FP8_RECIPE_GPU
std::unique_ptr<Precision> make_gpu_recipe(const GpuOptions& o) {
  throw Error(cat("precision.plugin = \"", o.plugin, "\" cannot run with run.device = \"cuda\": this build of Loom "
                  "has no CUDA backend. Run it with run.device = \"cpu\" (FP8 emulated on the CPU), or rebuild "
                  "with CUDA"));
}
#endif

PrecisionDTypes Fp8Emulation::dtypes() const {
  // CPU: fp32 parameters are the master copy; the FP8 casts happen inside the GEMMs.
  return {DType::f32, DType::f32, DType::f32, DType::f32, DType::f32, /*has_master=*/false};
}

int Fp8Emulation::register_linear(const LinearDesc& desc) {
  LOOM_CHECK(!set_up_, "precision ", plugin_, ": linear '", desc.name, "' registered after setup()");
  fp8_options::check_linear_shape(plugin_, desc);
  Linear l;
  l.desc = desc;
  l.fp8 = desc.role != LinearRole::lm_head || fp8_head_;
  if (l.fp8) {
    l.slot = state_->add_linear(desc.name);
    l.weight_offset = weight_floats_;
    weight_floats_ += desc.out * desc.in;
    max_weight_floats_ = std::max(max_weight_floats_, desc.out * desc.in);
    l.recast_x = desc.input_in_backward && !desc.variable_rows;
    if (l.recast_x) {
      x_scratch_floats_ = std::max(x_scratch_floats_, desc.max_rows * desc.in);
    } else {
      l.saved_offset = saved_floats_;
      saved_floats_ += desc.max_rows * desc.in;
    }
    gemm_floats_ = std::max(gemm_floats_, desc.max_rows * desc.out);  // the cast dy
  }
  linears_.push_back(l);
  return static_cast<int>(linears_.size()) - 1;
}

size_t Fp8Emulation::saved_activation_bytes(int id) const {
  LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision ", plugin_, ": linear id ", id,
             " was never registered");
  const Linear& l = linears_[static_cast<size_t>(id)];
  // The emulated cast of x is kept in fp32 (4 bytes per element; the GPU
  // keeps 1); none when the backward is handed x again (recast_x).
  return l.fp8 && !l.recast_x ? static_cast<size_t>(l.desc.max_rows * l.desc.in) * sizeof(float) : 0;
}

bool Fp8Emulation::keeps_wgrad_input(int id) const {
  LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision ", plugin_, ": linear id ", id,
             " was never registered");
  // The wgrad reads the cast x in the saved activations; a variable_rows
  // linear answers false like the GPU path's (whose calls of unaligned row
  // counts fall back to bf16 GEMMs reading x).
  const Linear& l = linears_[static_cast<size_t>(id)];
  return l.fp8 && !l.desc.variable_rows && !l.recast_x;
}

bool Fp8Emulation::weights_per_layer() const {
  return set_up_ ? per_layer_ : weight_cache_ == WeightCache::layer;
}

size_t Fp8Emulation::workspace_bytes() const {
  const int64_t weights = weights_per_layer() ? max_weight_floats_ : weight_floats_;
  return static_cast<size_t>(weights + gemm_floats_ + x_scratch_floats_) * sizeof(float);
}

void Fp8Emulation::setup(const PrecisionSetup& setup) {
  LOOM_CHECK(setup.data_parallel != nullptr, "precision ", plugin_, ": setup without a data-parallel communicator");
  LOOM_CHECK(!setup.data_parallel->device_tensors(), "precision ", plugin_,
             ": the data-parallel communicator carries device tensors, but this recipe keeps its amaxes on the host");
  dp_ = setup.data_parallel;
  per_layer_ = weight_cache_per_layer(weight_cache_, setup.grad_accum, setup.params_sharded);
  set_up_ = true;
  const auto [fp8_linears, full] = fp8_options::split_linears(linears_);
  const fp8::ScalingConfig& sc = state_->config();
  std::string how = scaling_ == fp8::Scaling::delayed
                        ? cat("delayed scaling (amax_history_len ", sc.amax_history_len, ", amax_compute_algo ",
                              fp8::name(sc.amax_compute_algo), ", margin ", sc.margin, ")")
                        : std::string("current scaling");
  log_info(cat("precision ", plugin_, ": ", fp8_linears, " linears in FP8 emulated on the CPU, format ",
               fp8::name(sc.formats),
               sc.formats == fp8::Formats::hybrid ? " (E4M3 x and w, E5M2 dy)" : " (E4M3 x, w and dy)", ", ", how,
               full.empty() ? std::string() : cat("; in fp32: ", full), "; ",
               fp8_options::weight_cache_summary(weight_cache_, per_layer_, setup.params_sharded),
               "; GPU GEMM options recorded: fast accumulation fprop ", gemm_.fast_accum_fprop ? "on" : "off",
               ", dgrad ", gemm_.fast_accum_dgrad ? "on" : "off", ", wgrad ", gemm_.fast_accum_wgrad ? "on" : "off"));
}

void Fp8Emulation::set_workspace(void* ptr, size_t bytes) {
  LOOM_CHECK(bytes >= workspace_bytes() && (ptr != nullptr || workspace_bytes() == 0), "precision ", plugin_,
             ": workspace of ", bytes, " bytes, ", workspace_bytes(), " needed");
  workspace_ = static_cast<float*>(ptr);
  workspace_bytes_ = bytes;
  for (Linear& l : linears_) l.weight_cast = l.w_scale_known = false;
}

void Fp8Emulation::set_saved_activations(void* ptr, size_t bytes) {
  LOOM_CHECK(bytes >= static_cast<size_t>(saved_floats_) * sizeof(float) && (ptr != nullptr || saved_floats_ == 0),
             "precision ", plugin_,
             ": saved activations of ", bytes, " bytes, ", saved_floats_ * 4, " needed");
  saved_ = static_cast<float*>(ptr);
}

Fp8Emulation::Linear& Fp8Emulation::lookup(const ExecContext& ctx, int id) {
  LOOM_CHECK(ctx.device == Device::cpu, "precision ", plugin_, ": called with a ", device_name(ctx.device),
             " context; this recipe runs on the CPU");
  LOOM_CHECK(id >= 0 && id < static_cast<int>(linears_.size()), "precision ", plugin_, ": linear id ", id,
             " was never registered (", linears_.size(), " linears registered)");
  Linear& l = linears_[static_cast<size_t>(id)];
  LOOM_CHECK(!l.fp8 || (set_up_ && (workspace_ != nullptr || workspace_bytes() == 0) &&
                         (saved_ != nullptr || l.recast_x)),
             "precision ", plugin_, ": ", l.desc.name, " called before setup() and the planned memory were given");
  return l;
}

const float* Fp8Emulation::cast_weight(Linear& l, const Tensor& w) {
  const int64_t n = l.desc.out * l.desc.in;
  const float* src = w.ptr<const float>();
  if (per_layer_) {
    // The shared scratch, cast again at every call; the scale and amax are
    // the step's, measured at the first cast (current scaling then counts a
    // skip once per step, as "step" does).
    float* qw = workspace_;
    if (!l.w_scale_known) {
      l.w_scale = scaling_ == fp8::Scaling::current ? state_->current_scale(l.slot, Role::w, fp8::amax(src, n))
                                                    : state_->scale(l.slot, Role::w);
      l.w_amax = fp8::quantize_dequantize(src, n, l.w_scale, state_->format(Role::w), qw);
      l.w_scale_known = true;
    } else {
      fp8::quantize_dequantize(src, n, l.w_scale, state_->format(Role::w), qw);
    }
    return qw;
  }
  float* qw = workspace_ + l.weight_offset;
  if (l.weight_cast) return qw;
  l.w_scale = scaling_ == fp8::Scaling::current ? state_->current_scale(l.slot, Role::w, fp8::amax(src, n))
                                                : state_->scale(l.slot, Role::w);
  l.w_amax = fp8::quantize_dequantize(src, n, l.w_scale, state_->format(Role::w), qw);
  l.weight_cast = true;
  return qw;
}

void Fp8Emulation::linear_forward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, Tensor& y,
                               const Tensor* residual) {
  Linear& l = lookup(ctx, id);
  if (!l.fp8) return full_forward(l, x, w, y, residual);
  const LinearDesc& d = l.desc;
  const auto [mx, my] = fp8_common::host::forward_operands(plugin_, d, x, w, y);
  const float* qw = cast_weight(l, w);
  // x, cast into its saved slot: the backward's wgrad reads this copy (or,
  // recast_x, into the x scratch: the backward casts x again).
  float* qx = l.recast_x ? x_scratch() : saved_ + l.saved_offset;
  const float* xs = x.ptr<const float>();
  const fp8::Format fx = state_->format(Role::x);
  l.x_scale = scaling_ == fp8::Scaling::current
                  ? state_->current_scale(l.slot, Role::x, rows_amax(xs, mx.rows, d.in, mx.ld))
                  : state_->scale(l.slot, Role::x);
  l.x_amax = cast_rows(xs, mx.rows, d.in, mx.ld, l.x_scale, fx, qx);
  l.saved_rows = mx.rows;
  place_residual(residual, y, my, plugin_, d);
  fp8::emulated_linear_forward(y.ptr<float>(), my.ld, {qx, d.in, l.x_scale, fx, true},
                               {qw, d.in, l.w_scale, state_->format(Role::w), true}, mx.rows, d.in, d.out,
                               residual != nullptr, workspace_ + weight_region_floats());
}

void Fp8Emulation::linear_backward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, const Tensor& dy,
                                Tensor* dx, Tensor& dw, bool accumulate) {
  Linear& l = lookup(ctx, id);
  if (!l.fp8) return full_backward(l, x, w, dy, dx, dw, accumulate);
  const LinearDesc& d = l.desc;
  // x is not read (the wgrad reads the cast copy saved by the forward); it
  // may be empty (keeps_wgrad_input), else it must match dy.
  const auto [mx, mdy] = fp8_common::host::backward_operands(plugin_, d, x, w, dy, dw);
  fp8_common::check_saved_rows(plugin_, d, l.saved_rows, mx.rows);
  const float* qw = cast_weight(l, w);
  // dy, cast once for both GEMMs into the GEMM scratch.
  float* qdy = workspace_ + weight_region_floats();
  const float* dys = dy.ptr<const float>();
  const fp8::Format fdy = state_->format(Role::dy);
  const float sdy = scaling_ == fp8::Scaling::current
                        ? state_->current_scale(l.slot, Role::dy, rows_amax(dys, mx.rows, d.out, mdy.ld))
                        : state_->scale(l.slot, Role::dy);
  const float dy_amax = cast_rows(dys, mx.rows, d.out, mdy.ld, sdy, fdy, qdy);
  if (scaling_ == fp8::Scaling::delayed) {
    // The forward's amaxes count now that it is part of a training step.
    state_->record_amax(l.slot, Role::x, l.x_amax);
    state_->record_amax(l.slot, Role::w, l.w_amax);
    state_->record_amax(l.slot, Role::dy, dy_amax);
  }
  const float* qx = saved_ + l.saved_offset;
  if (l.recast_x) {
    // The x of the forward, handed again: cast with the forward's scale, the
    // same codes the forward's GEMM read (its amax was recorded then).
    LOOM_CHECK(x.data != nullptr, "precision ", plugin_, ": ", d.name, ": the backward was given no x, but the linear "
               "was registered with input_in_backward (the block hands x again, and the recipe keeps no copy)");
    float* s = x_scratch();
    cast_rows(x.ptr<const float>(), mx.rows, d.in, mx.ld, l.x_scale, state_->format(Role::x), s);
    qx = s;
  }
  const fp8::Operand oq_dy{qdy, d.out, sdy, fdy, true};
  const fp8::Operand oq_w{qw, d.in, l.w_scale, state_->format(Role::w), true};
  const fp8::Operand oq_x{qx, d.in, l.x_scale, state_->format(Role::x), true};
  if (dx != nullptr) {
    const RowMatrix mdx = matrix(*dx, plugin_, d, "dx");
    check_shape(mdx, plugin_, d, d.in, mx.rows, "dx");
    fp8::emulated_linear_backward_input(dx->ptr<float>(), mdx.ld, oq_dy, oq_w, mx.rows, d.in, d.out, qdy);
  }
  fp8::emulated_linear_backward_weight(dw.ptr<float>(), oq_dy, oq_x, mx.rows, d.in, d.out, accumulate, qdy);
  l.saved_rows = -1;
}

void Fp8Emulation::end_step(const ExecContext& ctx) {
  LOOM_CHECK(set_up_, "precision ", plugin_, ": end_step before setup()");
  const int64_t T = state_->tensors();
  // The one all-reduce of the step: every rank's amaxes, max-reduced, so that
  // delayed scaling gives every rank the same scales (and the log line the
  // global amax under current scaling).
  if (T > 0 && dp_->size() > 1) {
    Tensor amaxes(state_->step_amax(), DType::f32, Device::cpu, {T});
    dp_->all_reduce(ExecContext{}, amaxes, ReduceOp::max);
  }
  float m = 0.0f;
  for (int64_t t = 0; t < T; ++t) m = std::max(m, state_->step_amax()[t]);
  last_max_amax_ = m;
  state_->update_scales();
  // Since the last end_step: current scaling counts its skips as it casts.
  last_kept_ = state_->skipped_updates() - skipped_mark_;
  skipped_mark_ = state_->skipped_updates();
  if (last_kept_ > 0 && !warned_skip_) {
    warned_skip_ = true;
    log_warn(cat("precision ", plugin_, ": ", last_kept_, " FP8 scale update(s) skipped at step ", state_->steps(),
                 " because an amax was 0, inf or NaN; those tensors keep their previous scale. Later skips are "
                 "counted in the \"precision:\" part of the log line, not warned again"));
  }
  for (Linear& l : linears_) l.weight_cast = l.w_scale_known = false;  // the optimizer changed the weights
}

std::vector<StateTensor> Fp8Emulation::state_tensors() {
  const int64_t T = state_->tensors();
  if (T == 0) return {};
  const fp8::ScalingState::Counters c = state_->counters();
  counters_[0] = static_cast<double>(c.head);
  counters_[1] = static_cast<double>(c.steps);
  counters_[2] = static_cast<double>(c.skipped);
  counters_[3] = static_cast<double>(c.nonfinite);
  // Delayed scaling: equal on every rank after each step's all-reduce. Current
  // scaling: every rank's scales come from its own tensors.
  const bool replicated = scaling_ == fp8::Scaling::delayed;
  std::vector<StateTensor> out;
  out.push_back({"fp8.scale", Tensor(state_->scale_data(), DType::f32, Device::cpu, {T}), replicated});
  if (scaling_ == fp8::Scaling::delayed)
    out.push_back({"fp8.amax_history",
                   Tensor(state_->history_data(), DType::f32, Device::cpu,
                          {static_cast<int64_t>(state_->config().amax_history_len), T}),
                   true});
  out.push_back({"fp8.counters", Tensor(counters_, DType::f64, Device::cpu, {4}), replicated});
  // Equal on every rank (the [precision] table is the run's). A checkpoint
  // written before the record existed leaves this run's own record here.
  state_->options_record(options_);
  out.push_back({"fp8.options", Tensor(options_, DType::f64, Device::cpu, {fp8::ScalingState::kOptionsRecord}), true});
  return out;
}

void Fp8Emulation::state_loaded() {
  // Every restored value is checked before any is taken (throws naming the
  // tensor, the element and the value; the core names the checkpoint).
  const fp8::ScalingState::Counters c = fp8::ScalingState::counters_from(counters_);
  const std::vector<std::string> changed = state_->restore(c, options_);
  for (const std::string& line : changed) log_warn(cat("precision ", plugin_, ": ", line));
  log_info(cat("precision ", plugin_, ": ", changed.empty() ? "its FP8 state resumes" : "the rest of its FP8 state resumes",
               " (", state_->tensors(), " scales", scaling_ == fp8::Scaling::delayed ? ", the amax history" : "",
               ", counters after ", c.steps, " step(s))"));
  skipped_mark_ = state_->skipped_updates();
  for (Linear& l : linears_) {
    l.weight_cast = l.w_scale_known = false;
    l.saved_rows = -1;
  }
}

std::unique_ptr<GatherCodec> Fp8Emulation::gather_codec(const GatherCodecSetup& setup) {
  // Current scaling casts every FP8 weight from its own amax on every call;
  // delayed scaling's scales come from past amaxes, which a gather of FP8
  // codes cannot measure (the core's stand-in then says so).
  if (scaling_ != fp8::Scaling::current) return nullptr;
  const int margin = state_->config().margin;
  // Variable-row linears (MoE experts) are left out as on the GPU, where such
  // a call may run in bf16 and would then read the FP8-rounded weight.
  auto casts = [this, margin](int id, int* m) {
    if (id < 0 || static_cast<size_t>(id) >= linears_.size()) return false;
    const Linear& l = linears_[static_cast<size_t>(id)];
    if (!l.fp8 || l.desc.variable_rows) return false;
    *m = margin;
    return true;
  };
  return fp8_gather::make_codec(setup, casts, fp8_gather::host_ops(), plugin_);
}

std::string Fp8Emulation::log_summary() const {
  const int64_t T = state_->tensors();
  if (T == 0) return {};
  float lo = FLT_MAX, hi = 0.0f;
  for (int64_t t = 0; t < T; ++t) {
    lo = std::min(lo, state_->scales()[t]);
    hi = std::max(hi, state_->scales()[t]);
  }
  std::ostringstream os;
  os << plugin_ << " scales " << std::setprecision(4) << lo << ".." << hi << " over " << T << " tensors, max amax "
     << last_max_amax_ << ", skipped updates " << state_->skipped_updates() << " (" << last_kept_
     << " this step, non-finite amaxes " << state_->nonfinite_amaxes() << ")";
  return os.str();
}

}  // namespace loom::fp8_recipe
