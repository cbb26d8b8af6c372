// The FP8 recipes (fp8_delayed, fp8_current): one class, the scaling told
// apart by the plugin that builds it. This file and fp8_recipe.cpp are free of
// CUDA: on the CPU every FP8 GEMM is emulated (loom/fp8_emulated.hpp) and the
// state is precision/common/fp8_scaling.hpp's ScalingState on the host. With run.device =
// "cuda" the object hands every call to the GPU path (fp8_recipe_gpu.cpp, built
// only with CUDA: device casts, cuBLASLt FP8 GEMMs, the state on the device).
//
// Per step, for every linear that runs in FP8 (all but the LM head unless
// fp8_head = true):
//   - weight_cache = "step": the weight is cast once (the first forward after
//     end_step) into the workspace and that copy is read by every
//     micro-batch's forward and dgrad (one cast copy per linear, the whole
//     step); weight_cache = "layer": the forward casts it into one scratch
//     shared by every linear (sized for the largest) just before its GEMM,
//     and the backward casts it again before dgrad. The scale is the step's
//     in both modes (delayed: fixed within the step; current: measured once
//     per step, the same bf16/fp32 weight giving the same amax), so the cast
//     bits and the losses are the same. "auto" (the default) is "layer" when
//     train.grad_accum = 1 (each weight is then cast once per step either
//     way) and "step" otherwise;
//   - x is cast in the forward into the linear's saved-activation slot, which
//     the wgrad of the matching backward reads (no second cast); for a linear
//     registered with input_in_backward (model.recompute = "selective") into
//     a scratch instead, and the backward casts the x it is handed again with
//     the forward's scale (the same codes, nothing kept in between);
//   - dy is cast in the backward, once for dgrad and wgrad.
// Delayed scaling casts with the scales of the steps before; the forward's
// amaxes count once the backward runs (a validation forward, which has none,
// leaves the scales alone); end_step all-reduces the one amax buffer (max)
// over the data-parallel group and updates every scale. Current scaling takes
// each cast's scale from its own amax.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "precision/common/fp8_scaling.hpp"
#include "loom/gemm_algo.hpp"
#include "loom/precision.hpp"
#include "precision/common/fp8_options.hpp"

namespace loom::fp8_recipe {

// The cuBLASLt options the GPU GEMMs will take (recorded; the CPU emulation
// accumulates in fp32 whatever they say). TE's defaults: fast accumulation for
// the forward GEMM only.
struct GemmOptions {
  bool fast_accum_fprop = true;
  bool fast_accum_dgrad = false;
  bool fast_accum_wgrad = false;
};

// precision.weight_cache (fp8_options.hpp).
using fp8_options::WeightCache;
using fp8_options::weight_cache_per_layer;

// What the GPU path is built from (the checked [precision] table).
struct GpuOptions {
  WeightCache weight_cache = WeightCache::automatic;
  std::string plugin;
  fp8::ScalingConfig scaling;
  bool fp8_head = false;
  GemmOptions gemm;
  bool master_bf16 = false;  // master = "bf16": bf16 parameters, gradients and AdamW state, no fp32 copy
  bool stochastic_rounding = false;
  GemmAlgo gemm_algo = GemmAlgo::heuristic;  // precision.gemm_algo, resolved (loom/gemm_algo.hpp)
  // precision.fused_casts (delayed scaling): offer x and dy to blocks that
  // write them in FP8 themselves (Precision::fp8_operand).
  bool fused_casts = true;
};
// The recipe on CUDA (fp8_recipe_gpu.cpp); in a build without CUDA it throws
// a loom::Error saying so.
std::unique_ptr<Precision> make_gpu_recipe(const GpuOptions& options);

class Fp8Recipe : public Precision {
 public:
  // `plugin` is "fp8_delayed" or "fp8_current"; reads and checks the table;
  // on device cuda builds the GPU path and hands every call to it.
  Fp8Recipe(const std::string& plugin, fp8::Scaling scaling, const PluginInit& init);
  ~Fp8Recipe() override;

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
  bool current_fp8_weight(int id, Fp8WeightCast* cast) const override;
  // The GPU path's answer (fused_casts, delayed scaling); false on the CPU,
  // whose backend writes no FP8 operands.
  bool fp8_operand(const ExecContext& ctx, int id, Fp8OperandRole role, int64_t rows, Fp8Operand* op) override;
  // 16 on the GPU (the FP8 GEMMs' row multiple; other counts split off a bf16
  // tail), 1 on the CPU (the emulation casts any count).
  int64_t variable_row_multiple() const override { return gpu_ ? 16 : 1; }

  // For tests and the log line (the CPU path's state; the GPU path keeps its
  // own on the device, read through state_tensors()).
  const fp8::ScalingState& scaling() const { return *state_; }
  bool on_gpu() const { return gpu_ != nullptr; }
  const GemmOptions& gemm_options() const { return gemm_; }
  // The resolved weight_cache (after setup(); before it, "auto" reads as "step").
  bool weights_per_layer() const;

 private:
  struct Linear;
  // Checks the context, the id and that the memory was given; the linear.
  Linear& lookup(const ExecContext& ctx, int id);
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
  std::unique_ptr<Precision> gpu_;  // device cuda: the GPU path, which every call goes to
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

}  // namespace loom::fp8_recipe
