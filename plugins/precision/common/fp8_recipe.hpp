// The FP8 recipes (fp8_delayed, fp8_current): one class, the scaling told
// apart by the plugin that builds it. This file and fp8_recipe.cpp are free of
// CUDA: on the CPU every FP8 GEMM is emulated (loom/fp8_emulated.hpp) and the
// state is precision/common/fp8_scaling.hpp's ScalingState on the host. With run.device =
// "cuda" every call goes to the GPU path instead (fp8_recipe_gpu.cpp, built
// only with CUDA: device casts, cuBLASLt FP8 GEMMs, the state on the device);
// fp8_skeleton.hpp is what the two paths plug into.
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
#include "precision/common/fp8_skeleton.hpp"

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

// What either path is built from (the checked [precision] table): the keys
// every FP8 recipe takes (fp8_options::Common) and the per-tensor ones.
struct GpuOptions : fp8_options::Common {
  std::string plugin;
  fp8::ScalingConfig scaling;
  GemmOptions gemm;
  // precision.fused_casts (delayed scaling): offer x and dy to blocks that
  // write them in FP8 themselves (Precision::fp8_operand).
  bool fused_casts = true;
  // precision.gathered_codes (fp8_current): under sharding.gather_dtype =
  // "fp8" with weight_cache "layer", the FP8 GEMMs read the gathered codes
  // themselves (fp8_gather.hpp's DirectCodes) instead of the weight decoded
  // to bf16 and cast again: the same codes and scale, bitwise.
  bool gathered_codes = true;
  // precision.producer_amax (fp8_current): the fused layers' RMSNorm and
  // SwiGLU measure the amax of the x or dy they write (loom::Fp8OperandAmax),
  // and the cast of that tensor reads it once instead of twice.
  bool producer_amax = true;
};
// The recipe on CUDA (fp8_recipe_gpu.cpp); in a build without CUDA it throws
// a loom::Error saying so.
std::unique_ptr<Precision> make_gpu_recipe(const GpuOptions& options);

// The CPU emulation (fp8_recipe.cpp): every FP8 GEMM emulated, the state on the host.
std::unique_ptr<Precision> make_cpu_recipe(const GpuOptions& options);

// fp8_delayed or fp8_current: the options, then the emulation or (device cuda) the GPU path.
class Fp8Recipe : public fp8_common::Fp8Skeleton {
 public:
  // `plugin` is "fp8_delayed" or "fp8_current"; reads and checks the table.
  Fp8Recipe(const std::string& plugin, fp8::Scaling scaling, const PluginInit& init);
};

}  // namespace loom::fp8_recipe
