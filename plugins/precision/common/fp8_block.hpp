// The fp8_block recipe: DeepSeek-V3's fine-grained FP8 scaling
// (loom/fp8_block.hpp). Free of CUDA: on the CPU every cast and GEMM is
// emulated exactly (the same tiles, scales and codes as the device casts);
// with run.device = "cuda" every call goes to the GPU path
// (fp8_block_gpu.cpp, built only with CUDA: block casts and cuBLASLt's
// block-scaled FP8 GEMMs).
//
// Per FP8 linear (all but the LM head unless fp8_head = true), E4M3 everywhere:
//   fprop  y  = x Wᵀ   x in 1x128 tiles along in, W in 128x128 blocks
//   dgrad  dx = dy W   dy in 1x128 tiles along out, Wᵀ with the same block scales
//   wgrad  dW = dyᵀ x  dyᵀ and xᵀ in 1x128 tiles along the tokens (a second
//                      quantisation of x and dy along the other axis)
// weight_cache = "step": W is cast once per optimizer step (the first forward
// after end_step) into the workspace (W and Wᵀ with their block scales on the
// GPU) and reused by every micro-batch; weight_cache = "layer": the forward
// casts W into one scratch shared by every linear (sized for the largest)
// just before fprop, and the backward casts Wᵀ into it again before dgrad.
// Every 128x128 block takes its scale from W itself, so both modes cast the
// same bits and give the same losses. "auto" (the default) is "layer" when
// train.grad_accum = 1 (each weight is then cast once per step either way)
// and "step" otherwise. x's token-axis cast is made by the forward and kept
// as the linear's saved activation for the wgrad, which never reads x: the
// FP8 linears of fixed rows answer keeps_wgrad_input = true (the blocks do
// not keep x for them). Each tile takes its
// own scale just before its cast (no amax history): the only state is a
// counter of steps and of tiles whose amax was inf or NaN (scale 1, warned
// once, counted in the log line).
//
// in, out and the rows (tokens per micro-batch) must be multiples of 128;
// register_linear refuses others. A variable_rows linear (MoE expert) called
// with a row count that is not runs that call in full precision (fp32 on the
// CPU, bf16 on CUDA), warned once.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "loom/gemm_algo.hpp"
#include "loom/precision.hpp"
#include "precision/common/fp8_options.hpp"

namespace loom::fp8_block {

// precision.weight_cache (fp8_options.hpp).
using fp8_options::WeightCache;
using fp8_options::weight_cache_per_layer;

struct Options {
  WeightCache weight_cache = WeightCache::automatic;
  bool fp8_head = false;
  bool master_bf16 = false;  // master = "bf16" (CUDA only)
  bool stochastic_rounding = false;
  GemmAlgo gemm_algo = GemmAlgo::heuristic;  // precision.gemm_algo, resolved (loom/gemm_algo.hpp)
};
// The recipe on CUDA (fp8_block_gpu.cpp); in a build without CUDA it throws
// a loom::Error saying so.
std::unique_ptr<Precision> make_gpu_recipe(const Options& options);

class Fp8BlockRecipe : public Precision {
 public:
  explicit Fp8BlockRecipe(const PluginInit& init);
  ~Fp8BlockRecipe() override;

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
  // 128 on the GPU (a 1x128 tile of every row; other counts split off a bf16
  // tail), 1 on the CPU (the emulation runs other counts whole in full precision).
  int64_t variable_row_multiple() const override;

  bool on_gpu() const { return gpu_ != nullptr; }
  int64_t nonfinite_tiles() const { return nonfinite_; }
  // The resolved weight_cache (after setup(); before it, "auto" reads as "step").
  bool weights_per_layer() const;

  // The message register_linear throws for a linear whose dims are not
  // multiples of 128 (shared with the GPU path).
  static std::string dims_message(const LinearDesc& d);

 private:
  struct Linear;
  Linear& lookup(const ExecContext& ctx, int id);
  void full_forward(const Linear& l, const Tensor& x, const Tensor& w, Tensor& y, const Tensor* residual);
  void full_backward(const Linear& l, const Tensor& x, const Tensor& w, const Tensor& dy, Tensor* dx, Tensor& dw,
                     bool accumulate);
  const float* cast_weight(Linear& l, const Tensor& w);
  void count(int64_t nonfinite);
  void unaligned_rows(const Linear& l, int64_t rows);

  Options o_;
  std::unique_ptr<Precision> gpu_;
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

}  // namespace loom::fp8_block
