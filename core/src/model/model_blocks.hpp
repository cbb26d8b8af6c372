// The two blocks every model has, which are the model's own: the token
// embedding and the final norm + LM head. The variants of the decoder layers'
// blocks are not core's: they are one file each in blocks/, built against the
// SDK (loom/block.hpp), each defining its descriptor (AttentionVariant,
// FfnVariant) that blocks/block_table.cpp's table lists.
#pragma once
#include <memory>

#include "loom/block.hpp"

namespace loom {

// x0 = wte[tokens] (embedding_block.cpp).
class EmbeddingBlock final : public Block {
 public:
  explicit EmbeddingBlock(const ModelSpec& spec) : spec_(spec) {}
  const char* kind() const override { return "embedding"; }
  void declare(UnitInfo& unit) override;
  void plan(const BlockEnv& env, ActivationPlan& acts) override;
  void forward(const UnitState& u, const Tensor& tokens, Tensor& out);
  // dwte += scatter of d by token (d is the gradient of the block's output).
  void backward(UnitState& u, const Tensor& tokens, const Tensor& d);

 private:
  const ModelSpec& spec_;
};

// The final RMSNorm, the LM head and the cross-entropy (head_block.cpp).
// The logits are computed in chunks of `head_chunk` tokens: one chunk of the
// whole micro-batch for native layers (HF's materialised logits), a few
// thousand tokens for fused layers, so that the [N, V] logits never exist at
// once (the largest activation of a 128K-vocabulary model otherwise). In
// training the loss, the logits gradient (written over the chunk's logits),
// its dgrad and wgrad run chunk by chunk in backward; an evaluation forward
// computes the per-token losses chunk by chunk.
class HeadBlock final : public Block {
 public:
  explicit HeadBlock(const ModelSpec& spec) : spec_(spec) {}
  const char* kind() const override { return "head"; }
  void declare(UnitInfo& unit) override;  // a tied head declares no matrix and reads unit 0's
  void plan(const BlockEnv& env, ActivationPlan& acts) override;
  // units: every unit's state (a tied head reads the embedding's); self: the head's unit.
  void forward(std::vector<UnitState>& units, int self, const Tensor& x, const Tensor& targets, bool training);
  // d: written with dL/dx (x is the final residual stream).
  void backward(std::vector<UnitState>& units, int self, const Tensor& x, const Tensor& targets, float dloss_scale,
                Tensor& d);
  // Per-token losses of the last evaluation forward or training backward: [N] fp32.
  Tensor losses() const;
  int64_t chunk() const { return env_.head_chunk; }
  // The logits of tokens [c * chunk, ...) after a forward: computed into the
  // chunk buffer and returned as [rows, V] (tests and tools; not the step).
  Tensor logits_of_chunk(std::vector<UnitState>& units, int self, int64_t c);

 private:
  Tensor weight(std::vector<UnitState>& units, int self, bool grad) const;
  Tensor chunk_logits(std::vector<UnitState>& units, int self, int64_t first, int64_t rows);
  const ModelSpec& spec_;
  int lnf_ = -1, rstd_ = -1, logits_ = -1, losses_ = -1, d_ln_ = -1;
  int lm_head_ = -1;
};

}  // namespace loom
