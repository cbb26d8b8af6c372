// FP8 weight gathers: the GatherCodec (loom/sharding.hpp) that the per-tensor
// recipes return from Precision::gather_codec for sharding.gather_dtype =
// "fp8", torchtitan's float8 all-gather in Loom.
//
// Which weights: those of the decoder linears (GatherCodecSetup::weights)
// that the recipe casts to E4M3 per tensor from their current amax on every
// call (fp8_current; the recipe says which through `casts`). For them the
// gather is exact:
//   - the amax is the same: this rank's ranges of the weight, max-reduced over
//     the shard group (one all-reduce for every weight of the model);
//   - so is the scale (compute_scale, the recipe's margin) and so are the
//     codes the recipe's own cast would write;
//   - the recipe casts the decoded weight (code / scale, in the parameter
//     dtype) again and gets the same codes back: a decoded value is within
//     2^-8 (bf16 rounding) of code / scale, far inside half an E4M3 step;
//   - or, on CUDA (DirectCodes below, precision.gathered_codes), its GEMMs
//     read the gathered codes themselves, with the codec's scale.
// Everything else (norm gains, the LM head, embedding, router, padding) moves
// in the parameter dtype.
//
// Wire layout of one unit, c = its chunk in elements. A unit of FP8 weights
// whose other elements are few (norm gains, a router: at most 1/256 of it,
// kOthersShare in fp8_gather.cpp), as every decoder layer: chunk r is c
// bytes, byte j the code of element r c + j when that element belongs to an
// FP8 weight (other bytes unused), so the gathered wire of the unit holds
// each FP8 weight's codes whole and in place, at byte (its offset in the
// unit); the GEMMs can read them there (DirectCodes). Its other elements
// travel once per encode instead, in the parameter dtype: every rank's own
// ones of every such unit, in one all-gather into a buffer of the codec's
// state that each decode copies them from. Any other unit (the embedding,
// the head, a unit of many other elements): chunk r holds the elements
// [r c, (r + 1) c), first its other parameters' elements in the parameter
// dtype, in flat order, then its FP8 weights' codes, one byte each, in flat
// order, padded to 16 bytes and to the largest rank's; padding is not sent.
// A bf16 unit of FP8 weights moves half its bytes; fp32 (the CPU path) a
// quarter.
//
// When: encode() runs once after the parameters change (the strategy calls it
// at the first gather after an optimizer step), so each rank casts its own
// shard once per step, and decode() at every gather.
//
// The arithmetic goes through Ops: on the CPU (fp32 parameters in host
// memory) loom/fp8.hpp's host casts, here; on CUDA (bf16 parameters) the
// device casts of loom/ops/fp8_cast.hpp on the context's stream
// (fp8_gather_gpu.cpp, built only with CUDA). Both are the casts the recipe
// itself makes, bit for bit.
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "loom/context.hpp"
#include "loom/precision.hpp"
#include "loom/sharding.hpp"
#include "loom/tensor.hpp"

namespace loom::fp8_gather {

// The casts of loom/fp8.hpp over contiguous tensors of any shape and
// alignment, E4M3 only, where the parameters live (queued on ctx's stream on
// CUDA; done at once on the CPU):
//   fill: every element of the fp32 tensor t = v (start-up; may wait)
//   zero: t = 0 (fp32)
//   copy: dst = src, the same bytes
//   amax: amax[0] = max(amax[0], max |x|), x fp32 or bf16 (NaN -> +inf)
//   scales: for every i, scale[i] = compute_scale(amax[i], 448, margin,
//     scale[i]).scale and scale_inv[i] = 1 / scale[i] (fp32 [n] each)
//   encode: q = encode(x * scale[0]), saturating (q e4m3, same numel)
//   decode: y = decode(q) / scale[0], y fp32 or bf16
class Ops {
 public:
  virtual ~Ops() = default;
  virtual void fill(Tensor& t, float v) = 0;
  virtual void zero(const ExecContext& ctx, Tensor& t) = 0;
  virtual void copy(const ExecContext& ctx, Tensor& dst, const Tensor& src) = 0;
  virtual void amax(const ExecContext& ctx, Tensor& amax, const Tensor& x) = 0;
  virtual void scales(const ExecContext& ctx, Tensor& scale, Tensor& scale_inv, const Tensor& amax, int margin) = 0;
  virtual void encode(const ExecContext& ctx, Tensor& q, const Tensor& x, const Tensor& scale) = 0;
  virtual void decode(const ExecContext& ctx, Tensor& y, const Tensor& q, const Tensor& scale) = 0;
};

// Host tensors, fp32 (fp8_gather.cpp).
std::unique_ptr<Ops> host_ops();
// Device tensors, fp32 or bf16 (fp8_gather_gpu.cpp; only in CUDA builds).
std::unique_ptr<Ops> device_ops();

// True, and *margin set, when the recipe casts linear `id`'s weight to E4M3
// per tensor with the scale compute_scale(amax(W), 448, *margin) of that
// weight's own amax on every call: the only casts a gather of FP8 codes
// reproduces exactly.
using CastsFromCurrentAmax = std::function<bool(int id, int* margin)>;

// The recipe's side of a codec it made: the FP8 GEMMs may read the gathered
// codes themselves instead of a decoded weight cast again (the same codes
// and the same scale: see above), which saves the decode (1 byte read, 2
// written an element) and the cast (2 read, 1 written) at every gather.
// With set_direct(true), decode() does not write an FP8 weight's values in
// the unit's params: the weight's codes (row-major, as the weight) stay in
// the gathered wire where its 256-byte-aligned place there allows (no copy
// at all), else they are copied into the first numel bytes of the weight's
// own place in the params. Only the recipe that asked may read that weight,
// through codes() and the codec's scale of it.
class DirectCodes {
 public:
  virtual ~DirectCodes() = default;
  virtual void set_direct(bool on) = 0;
  // True when gathers leave linear `id`'s weight as codes: direct is on, a
  // strategy planned gathers through the codec, and the weight is one it
  // moves in FP8 and can leave so.
  virtual bool holds_codes(int id) const = 0;
  // Where the codes of linear `id`'s weight are after the last decode of its
  // unit, given `place`, the weight's place in the params that decode
  // wrote (its parameter view's data): in the gathered wire, or `place`
  // itself. Valid until the unit's next gather overwrites that wire.
  virtual const void* codes(int id, const void* place) const = 0;
  // The weight's amax, scale and 1 / scale (device floats on CUDA), as the
  // last encode() set them: the codes are encode(W * scale).
  virtual const float* amax(int id) const = 0;
  virtual const float* scale(int id) const = 0;
  virtual const float* scale_inv(int id) const = 0;
};

// The codec for the weights among setup.weights that `casts` names (one
// margin for all of them), on `ops`. `plugin` names the recipe in messages
// (why_none() when no weight qualifies). Touches no memory until bind().
// `direct` (may be null): set to the codec's DirectCodes, which lives as long
// as the codec.
std::unique_ptr<GatherCodec> make_codec(const GatherCodecSetup& setup, const CastsFromCurrentAmax& casts,
                                        std::unique_ptr<Ops> ops, const std::string& plugin,
                                        DirectCodes** direct = nullptr);

}  // namespace loom::fp8_gather
