// The fp8_block recipe: DeepSeek-V3's fine-grained FP8 scaling
// (loom/fp8_block.hpp). Free of CUDA: on the CPU every cast and GEMM is
// emulated exactly (the same tiles, scales and codes as the device casts);
// with run.device = "cuda" every call goes to the GPU path instead
// (fp8_block_gpu.cpp, built only with CUDA: block casts and cuBLASLt's
// block-scaled FP8 GEMMs); fp8_skeleton.hpp is what the two paths plug into.
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
#include "precision/common/fp8_skeleton.hpp"

namespace loom::fp8_block {

// precision.weight_cache (fp8_options.hpp).
using fp8_options::WeightCache;
using fp8_options::weight_cache_per_layer;

// What either path is built from: the keys every FP8 recipe takes (block
// scaling has no keys of its own beyond the ones it refuses).
struct Options : fp8_options::Common {};
// The recipe on CUDA (fp8_block_gpu.cpp); in a build without CUDA it throws
// a loom::Error saying so.
std::unique_ptr<Precision> make_gpu_recipe(const Options& options);
// The CPU emulation (fp8_block.cpp): every cast and GEMM emulated on the host.
std::unique_ptr<Precision> make_cpu_recipe(const Options& options);

// Both paths' warnings, each said once per recipe object (`said`): a call
// of `rows` rows that 1x128 tiles along the tokens cannot take runs in
// `fallback` ("full precision", "bf16"); `tiles` tiles were cast with scale 1
// for an inf or NaN amax (`when`: "at step 3", "by step 3").
void warn_unaligned_rows(bool& said, const LinearDesc& d, int64_t rows, const char* fallback);
void warn_nonfinite_tiles(bool& said, int64_t tiles, const std::string& when);

// fp8_block: the options, then the emulation or (device cuda) the GPU path.
class Fp8BlockRecipe : public fp8_common::Fp8Skeleton {
 public:
  explicit Fp8BlockRecipe(const PluginInit& init);

  // The message register_linear throws for a linear whose dims are not
  // multiples of 128 (both paths).
  static std::string dims_message(const LinearDesc& d);
};

}  // namespace loom::fp8_block
