// The Llama decoder as blocks (docs/ARCHITECTURE.md "The model as blocks"):
//
//   embedding -> L x [attention block + feed-forward block] -> final norm + head
//
// Units: 0 = the embedding, 1..L = decoder layers, L + 1 = the head. The model
// owns the residual stream between blocks (res[l] entering layer l, mid[l]
// between its attention and feed-forward blocks) and one gradient buffer for
// it; each block owns the rest of its activations. `layers` picks the
// attention variant of every decoder layer and `ffn` its feed-forward variant
// (blocks/block_table.cpp's table); the variants of one layout declare the same HF
// parameter names, shapes and order, so the units — and with them checkpoints
// and HF folders — are the same whichever computes. What is particular to a
// variant stays in its block: its extra losses (ExtraLoss), what it reads of
// the micro-batch (MicroBatch), its memory floor (AttentionVariant::floor).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "loom/block.hpp"
#include "model/model_blocks.hpp"

namespace loom {

class Model {
 public:
  // expert_parallel > 1 (a MoE spec): every layer's experts go into a unit of
  // their own, just before the layer's unit (UnitInfo::expert_group).
  // ffn: model.ffn ("dense": the feed-forward variant of `layers`' name).
  Model(const ModelSpec& spec, std::string layers, std::string ffn = "dense", int64_t expert_parallel = 1);
  // A model of the dense (or, for a spec with experts, MoE) feed-forward
  // variant: what a layout needs when only the spec and layers are known.
  Model(const ModelSpec& spec, std::string layers, int64_t expert_parallel)
      : Model(spec, std::move(layers), "dense", expert_parallel) {}
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelSpec& spec() const { return spec_; }
  const std::string& layers() const { return layers_; }
  // The parameter layout, derived from the blocks' declarations.
  const std::vector<UnitInfo>& units() const { return units_; }
  int num_units() const { return static_cast<int>(units_.size()); }

  // Registers every linear and plans every activation buffer (env fixed from here on).
  void plan(const BlockEnv& env, ArenaPlan& plan);
  void bind(const Arena& arena);
  const BlockEnv& env() const { return env_; }
  // The ids the precision recipe returned for every linear (after plan).
  const std::vector<int>& linear_ids() const { return linear_ids_; }
  // Where each decoder linear's weight sits in its unit (after plan()).
  const std::vector<LinearWeight>& linear_weights() const { return linear_weights_; }

  // The micro-batch's staged data on the backend, int32, one buffer that the
  // host fills with one copy (train/token_stager.hpp): inputs [N], targets
  // [N], and with document spans (BlockEnv::document_attention or
  // document_positions) their positions [N], cu_seqlens [N + 1] and lengths
  // [N] (loom/attention.hpp's DocumentSpans).
  Tensor tokens() const;
  int64_t staged_words() const { return documents_on() ? 5 * env_.N + 1 : 2 * env_.N; }
  Tensor inputs() const;   // [B, S]
  Tensor targets() const;  // [N]

  // training: keep what backward needs; the loss of a training micro-batch is
  // computed in the head's backward with gradient scale dloss_scale.
  void forward_unit(int unit, std::vector<UnitState>& units, bool training, float dloss_scale);
  // Under UnitState::grads_fresh the unit's backward writes its gradients
  // (or, when it also adds into another unit's, clears its buffer first).
  void backward_unit(int unit, std::vector<UnitState>& units);
  // Per-token losses ([N] fp32) of the last evaluation forward or training backward.
  Tensor losses() const { return head_->losses(); }
  // The blocks' extra losses (ExtraLoss: a mixture of experts' load-balancing
  // loss), each finished once the last layer's training forward has run;
  // empty when no block adds one.
  const ExtraLosses& extra_losses() const { return losses_; }
  // acc (f64 [1]) += the sum of the extra losses' values (unweighted): what
  // the step log reports beside the LM loss. Nothing without extra losses.
  void add_extra_losses(Tensor& acc) const;
  // A new training micro-batch: its random draws' seed (MicroBatch::seed).
  void begin_micro_batch(uint64_t seed) { micro_.seed = seed; }
  // The staged micro-batch's document spans (count and longest, host values
  // the stager found), before its forward: attention plugins size their
  // launches from them without a device read.
  void set_documents(int64_t count, int64_t longest);
  // Scales the LM loss's gradient of the next micro-batches: N / (tokens that
  // carry loss) under train.eod_mask_loss (each micro-batch's loss is the mean
  // over its tokens that carry loss), 1 otherwise. The MoE auxiliary loss is
  // not scaled.
  void set_loss_weight(float w) { loss_weight_ = w; }
  float loss_weight() const { return loss_weight_; }
  // True while the step's first micro-batch runs (BlockEnv::first_micro):
  // its backward writes the gradients. False (the default) accumulates.
  void set_first_micro(bool first) { first_micro_ = first; }
  HeadBlock& head() { return *head_; }

 private:
  Tensor stream(int id) const;  // a residual-stream buffer as [N, h]
  void backward_blocks(int unit, std::vector<UnitState>& units);
  // What a unit's backward does with a fresh gradient buffer: writes it (as
  // a first micro-batch); clears it and adds, as its backward also adds into
  // another unit's gradients (the tied head into the embedding's, a MoE layer
  // into its experts unit's); or refuses it, as another unit's backward has
  // written it already (the tied embedding, an experts unit).
  enum class FreshGrads { written, cleared, refused };
  FreshGrads fresh_grads(int unit) const;
  bool documents_on() const { return env_.document_attention || env_.document_positions; }

  ModelSpec spec_;
  std::string layers_, ffn_name_;
  EmbeddingBlock embedding_;
  std::vector<std::unique_ptr<AttentionBlock>> attention_;
  std::vector<std::unique_ptr<FfnBlock>> ffn_;
  std::unique_ptr<HeadBlock> head_;
  std::vector<UnitInfo> units_;
  std::vector<std::string> range_names_;
  std::vector<int> layer_of_;    // per unit: the layer it computes, or -1 (embedding, experts, head)
  std::vector<int> experts_of_;  // per layer: its experts unit, or -1  // "forward.layer.N", "backward.layer.N" per layer

  BlockEnv env_;
  std::vector<int> linear_ids_;
  std::vector<LinearWeight> linear_weights_;
  ActivationPlan acts_;
  std::vector<int> res_, mid_;
  MicroBatch micro_;
  ExtraLosses losses_;
  int d_res_ = -1, tokens_ = -1;
  float dloss_scale_ = 0.f;
  float loss_weight_ = 1.f;
  bool first_micro_ = false;
  DocumentSpans documents_;  // views into the staged buffer (bind), counts per micro-batch
};

// Tokens per LM-head chunk: the whole micro-batch for an attention variant
// without a chunked head (native); else `configured` when > 0, else as many
// tokens as 1 GiB of logits hold (a multiple of 128), at most the micro-batch.
int64_t head_chunk_tokens(const std::string& layers, int64_t configured, int64_t tokens, int64_t vocab, DType act);

// The memory floor of a model (train_state.hpp plan_floor), from the spec and
// the variants' floors alone, nothing built: every parameter and tensor the
// blocks declare; the activations (elements of the activation dtype) that
// every plan holds: the residual stream before and after each layer, the LM
// head's logits (of the whole micro-batch, or of one chunk), and the blocks'.
// head_chunk: model.head_chunk (0: as few as one row is a lower bound).
BlockFloor model_floor(const ModelSpec& spec, const std::string& layers, const std::string& ffn, const FloorEnv& env,
                       int64_t head_chunk);

}  // namespace loom
