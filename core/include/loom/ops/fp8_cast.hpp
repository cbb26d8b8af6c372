// FP8 device kernels (fp8_cast.cu): the casts, amaxes and scale updates of
// the FP8 recipes on the GPU, sharing loom::fp8::encode, decode and
// compute_scale with the host code (loom/fp8.hpp), so that a device cast is
// bitwise the host `loom::fp8::quantize` and a device scale update bitwise
// the FP8 recipes' ScalingState's (plugins/precision/common/fp8_scaling.hpp).
// Plain C++: tests, the benchmark and the plan cache include it
// without nvcc.
//
// Conventions (the slot layout of loom/ops/fp8_slots.hpp):
// - A cast computes q = encode(x * scale) in fp32 (round to nearest even,
//   saturating to ±max, NaN to NaN), `scale` read from a device float.
// - An amax slot is a device float holding max |x| so far (>= 0); a cast or
//   amax kernel max-accumulates into it (atomicMax on the float's bits, which
//   order like the values for non-negative floats), so one slot can take every
//   micro-batch of a step and is zeroed once per step by the caller. A NaN in
//   the input is recorded as +inf (max over NaN is unspecified in MPI and NCCL
//   reductions; both make the update keep the scale).
// - Scales, inverse scales and amaxes are ScalingState's layout: one
//   contiguous float array each, slot = 3 * linear + role (x, w, dy), the
//   role's format from Formats ("hybrid": dy in E5M2).
//
// Every entry point checks its arguments (devices, dtypes, shapes, alignment)
// and throws one loom::Error naming the values before anything is launched,
// then launches on `stream`, checked. Nothing allocates or formats on the
// success path.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "loom/ops/fp8_slots.hpp"
#include "loom/tensor.hpp"

namespace loom::gpu {

// Cast x [rows, cols] (fp32 or bf16; a row view is fine: fold_rows, leading
// dims fold into rows) to FP8 with the scale at `scale`:
//   q   [rows, cols]  row-major, contiguous (may be null),
//   q_t [cols, rows]  the transposed copy, contiguous (may be null),
// in one pass over x (q and q_t have one dtype, e4m3 or e5m2: the format).
// amax (may be null): max |x| max-accumulated into *amax (see above).
// At least one of q and q_t must be given (fp8_amax measures alone).
void fp8_cast(const Tensor& x, Tensor* q, Tensor* q_t, const float* scale, float* amax, cudaStream_t stream);

// *amax = max(*amax, max |x|) for x [rows, cols] fp32 or bf16 (NaN -> +inf).
// What current scaling measures before it casts.
void fp8_amax(const Tensor& x, float* amax, cudaStream_t stream);

// For every slot t in [first, first + count): scale[t] = compute_scale(amax[t],
// fp8_max of the slot's role under `formats`, margin, scale[t]).scale and
// scale_inv[t] = 1 / scale[t] (correctly rounded): bitwise ScalingState's
// set_scale. An amax of 0 or not finite keeps the scale (skipped). `skipped`
// (may be null): a device counter, incremented once per skipped slot.
// amax is whatever the recipe decides the scale from: the window amax of a
// history, or this step's / this tensor's amax (current scaling).
void fp8_update_scales(const float* amax, float* scale, float* scale_inv, int64_t first, int64_t count,
                       fp8::Formats formats, int margin, uint32_t* skipped, cudaStream_t stream);

// Delayed scaling's once-per-step update on the device, bitwise
// ScalingState::update_scales for `tensors` slots: history is
// [history_len][tensors] floats, a ring whose newest row (after this step's
// roll, which the caller tracks as ScalingState does: head = (head + 1) %
// history_len) is `head`. For each slot: this step's amax enters row `head`
// (0 when it is not finite or negative); a non-finite one keeps the scale
// (counted in `nonfinite` and `kept`); otherwise the window amax ("max" over
// the history or "most_recent") gives the scale through compute_scale (kept
// counted when it skips). step_amax is cleared. kept/nonfinite may be null.
void fp8_delayed_update(float* step_amax, float* history, int history_len, int head, int64_t tensors,
                        fp8::AmaxAlgo algo, fp8::Formats formats, int margin, float* scale, float* scale_inv,
                        uint32_t* kept, uint32_t* nonfinite, cudaStream_t stream);

// y = decode(q) / scale, elementwise over contiguous tensors of equal numel:
// q e4m3 or e5m2, y fp32 or bf16 (bitwise loom::fp8::dequantize for fp32).
void fp8_dequantize(Tensor& y, const Tensor& q, const float* scale, cudaStream_t stream);

// qt [cols, rows] = transpose of q [rows, cols], codes moved as they are
// (q and qt contiguous, one FP8 dtype). For Wᵀ from W's codes where the
// codes arrive already cast (the FP8 weight gathers).
void fp8_transpose(Tensor& qt, const Tensor& q, cudaStream_t stream);

// The hardware conversion the tile kernels encode with (fp8_tile.cuh's
// encode4: PTX cvt.rn.satfinite, NaN made kNaNCode) against
// loom::fp8::encode_fast, which test_fp8 checks against the host's encode
// over every input, here over every one of the 2^32 fp32 bit patterns in
// format f: returns how many give different codes, and the smallest such
// bit pattern in *first_bad (0xFFFFFFFF when none). A self-check for tests:
// it allocates and waits for the device.
uint64_t fp8_encode_mismatches(fp8::Format f, uint32_t* first_bad, cudaStream_t stream);

}  // namespace loom::gpu
