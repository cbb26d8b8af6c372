// FP8 weight gathers: the core's GatherCodec (loom/sharding.hpp) for
// sharding.gather_dtype = "fp8", torchtitan's float8 all-gather in Loom.
//
// Which weights: those of the decoder linears (Model::linear_weights) that the
// precision recipe casts to E4M3 per tensor from their current amax
// (Precision::current_fp8_weight, fp8_current). For them the gather is exact:
//   - the amax is the same: this rank's ranges of the weight, max-reduced over
//     the shard group (one all-reduce for every weight of the model);
//   - so is the scale (compute_scale, the recipe's margin) and so are the
//     codes the recipe's own cast would write;
//   - the recipe casts the decoded weight (code / scale, in the parameter
//     dtype) again and gets the same codes back: a decoded value is within
//     2^-8 (bf16 rounding) of code / scale, far inside half an E4M3 step.
// Everything else (norm gains, the LM head, embedding, router, padding) moves
// in the parameter dtype.
//
// Wire layout of one unit: group chunks of wire_chunk_bytes(unit) bytes, chunk
// r holding the elements [r c, (r + 1) c) of the flat unit (c = the chunk in
// elements): first its other parameters' elements in the parameter dtype, in
// flat order, then its FP8 weights' codes, one byte each, in flat order;
// padding is not sent. A bf16 unit of FP8 weights moves half its bytes; fp32
// (the CPU path) a quarter.
//
// When: encode() runs once after the parameters change (the strategy calls it
// at the first gather after an optimizer step), so each rank casts its own
// shard once per step, and decode() at every gather.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "loom/precision.hpp"
#include "loom/sharding.hpp"
#include "kernels/backend.hpp"
#include "model/block.hpp"

namespace loom {

class Fp8GatherCodec final : public GatherCodec {
 public:
  // `why_none`: what to say when no weight qualifies (names the recipe).
  Fp8GatherCodec(Backend& be, const std::vector<UnitInfo>& units, const std::vector<LinearWeight>& weights,
                 const Precision& precision, DType param_dtype, std::string why_none);

  // Whether a strategy planned gathers through this codec (plan() was called):
  // only then does it need its memory.
  bool planned() const { return !segments_.empty(); }
  // Device (or host) memory for the amaxes and scales: 3 fp32 per FP8 weight.
  size_t state_bytes() const { return static_cast<size_t>(weights_.size()) * 3 * sizeof(float); }
  // Binds that memory (state_bytes() of it) and sets every scale to 1.
  void bind(void* ptr);

  int fp8_weights() const override { return static_cast<int>(weights_.size()); }
  std::string why_none() const override { return why_none_; }
  void plan(int group, int position, const std::vector<int64_t>& chunk) override;
  int64_t wire_chunk_bytes(int unit) const override;
  void encode(const ExecContext& ctx, Communicator& group, const std::vector<UnitState>& units,
              std::vector<Tensor>& wire) override;
  void decode(const ExecContext& ctx, int unit, const Tensor& wire, Tensor& params) override;

 private:
  struct Weight {
    int unit = 0;
    int64_t offset = 0, numel = 0;
  };
  // [lo, hi) of the flat unit; weight: index into weights_ or -1 (moved as it
  // is); wire: byte offset inside its chunk.
  struct Segment {
    int64_t lo = 0, hi = 0;
    int weight = -1;
    int64_t wire = 0;
  };
  Tensor wire_view(const Tensor& wire, int64_t byte, int64_t n, DType dt) const;
  Tensor f32_slot(const Tensor& t, int i) const;

  Backend& be_;
  DType param_dtype_;
  std::string why_none_;
  int margin_ = 0;
  std::vector<int64_t> numel_;  // per unit
  std::vector<Weight> weights_;
  int group_ = 1, position_ = 0;
  std::vector<int64_t> chunk_, wire_bytes_;
  std::vector<std::vector<std::vector<Segment>>> segments_;  // [unit][rank]
  Tensor amax_, scale_, scale_inv_;
};

}  // namespace loom
