// A block is one part of the model: the token embedding, the attention or the
// feed-forward half of a decoder layer, or the final norm + LM head. A unit
// (what a sharding strategy moves with one collective) is the embedding, one
// decoder layer (an attention block then a feed-forward block), or the head.
//
// The SDK's block interface. The decoder layers' block variants live in the
// repository's blocks/ folder, one file each, built into libloom against the
// SDK alone (this header, loom/ops/backend.hpp for the ops, the precision and
// attention plugins' interfaces) and listed by one row of
// blocks/block_table.cpp each: adding one touches nothing under core/. The
// embedding and the head are the model's own (core/src/model/). A variant
// declares
//   - its parameters: canonical HF names, shapes and roles (declare), in the
//     order they sit in the unit's flat buffer;
//   - its linears (registered with the precision plugin) and its activation
//     buffers (plan);
//   - its forward and backward.
// The residual stream between blocks belongs to the model (core's
// model.hpp): a block reads `in` and writes `out` in forward, and turns
// dL/d(out) into dL/d(in) in place in backward. A fusion never crosses a
// block, so it never crosses a unit (zero3 gathers unit by unit).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "loom/arena.hpp"
#include "loom/attention.hpp"
#include "loom/model.hpp"
#include "loom/ops/backend.hpp"
#include "loom/precision.hpp"
#include "loom/sharding.hpp"
#include "loom/trace.hpp"

namespace loom {

// model.recompute: none keeps every activation a backward reads; selective
// recomputes the element-wise ops' outputs that only a GEMM's backward reads
// (the norms' outputs, SwiGLU's) from what is kept, and keeps every GEMM's
// output; attention recomputes the core attention; full keeps only the
// residual stream and runs each layer's forward again in its backward.
enum class Recompute { none, selective, attention, full };
Recompute parse_recompute(const std::string& s);

// The micro-batch a forward computes, as the model tells its blocks
// (BlockEnv::micro): the state a block may keep per micro-batch reads it.
struct MicroBatch {
  bool training = false;  // this forward trains: random draws (router jitter) apply, statistics are kept
  bool replay = false;    // a recompute forward inside backward (model.recompute = "full"): the same
                          // draws as the first forward, no statistics taken again
  uint64_t seed = 0;      // the micro-batch's random draws (Model::begin_micro_batch): a pure function
                          // of run.seed and the micro-batch's index, so a resume draws the same
};

struct BlockEnv;
class ActivationPlan;

// A term that blocks add to the training objective beside the LM loss (a
// mixture of experts' load-balancing loss). It may be over every layer's
// tokens together (HF Mixtral's is), so one instance, by name, is shared by
// every block that adds to it: a block gets it in plan() with
// ExtraLosses::get. The model starts it at each training micro-batch, finishes
// it once every block's forward has run (its value, and whatever gradient the
// blocks' backward then read), and reports its value beside the LM loss
// ("aux loss" in the log, aux_loss in metrics.jsonl).
class ExtraLoss {
 public:
  virtual ~ExtraLoss() = default;
  // Its buffers (activations: one per model, ActivationPlan::own).
  virtual void plan(const BlockEnv& env, ActivationPlan& acts) = 0;
  virtual void bind(const ActivationPlan& acts) = 0;
  // A training micro-batch's forward begins: statistics start from zero.
  virtual void begin(Backend& be) = 0;
  // Every block's training forward has run. dloss_scale: the LM loss's
  // gradient scale (1 / the step's tokens on every rank), which a gradient
  // the blocks read scales like.
  virtual void finish(Backend& be, float dloss_scale) = 0;
  // Its value ([1] fp32, unweighted: the objective's weight is the block's)
  // after the last training forward.
  virtual Tensor value() const = 0;
  // A profiler range name for finish ("moe.aux_loss").
  virtual const char* range() const = 0;
};

// The model's extra losses, in the order blocks first asked for them.
class ExtraLosses {
 public:
  // The one named `name`, made (and planned with env and acts) by `make` the
  // first time it is asked for.
  template <class T, class Make>
  T& get(const std::string& name, const BlockEnv& env, ActivationPlan& acts, Make make) {
    for (auto& [n, l] : losses_)
      if (n == name) return dynamic_cast<T&>(*l);
    std::unique_ptr<T> made = make();
    T& ref = *made;
    losses_.emplace_back(name, std::move(made));
    ref.plan(env, acts);
    return ref;
  }
  bool empty() const { return losses_.empty(); }
  size_t size() const { return losses_.size(); }
  ExtraLoss& at(size_t i) { return *losses_.at(i).second; }
  const ExtraLoss& at(size_t i) const { return *losses_.at(i).second; }
  void clear() { losses_.clear(); }

 private:
  std::vector<std::pair<std::string, std::unique_ptr<ExtraLoss>>> losses_;
};

// What every block computes with, fixed at start-up.
struct BlockEnv {
  const ModelSpec* spec = nullptr;
  int64_t B = 0, S = 0, N = 0;  // micro-batch, sequence, tokens (B * S)
  Recompute recompute = Recompute::none;
  DType act = DType::f32;       // the recipe's activation dtype
  Precision* precision = nullptr;
  Attention* attention = nullptr;
  Backend* backend = nullptr;
  int64_t head_chunk = 0;       // tokens per LM-head chunk (the head block's)
  // Per-micro-batch state (MicroBatch) and the extra losses (ExtraLoss):
  // the model's, set by Model::plan.
  const MicroBatch* micro = nullptr;
  ExtraLosses* losses = nullptr;
  std::vector<int>* linear_ids = nullptr;  // every id the recipe returned, in order (Model::plan sets it)
  // Where each decoder linear's weight sits (loom::LinearWeight, Model::plan):
  // the recipe's FP8 weight gathers are built from it (Precision::gather_codec).
  std::vector<LinearWeight>* linear_weights = nullptr;
  // sharding.expert_parallel > 1: the ranks that split each MoE layer's
  // experts between them (blocks/expert_parallel.hpp); null otherwise.
  Communicator* expert_group = nullptr;
  // The model's flag (Model::set_first_micro): true during the first
  // micro-batch of an optimizer step, when a unit's gradients hold the
  // previous step's values (nothing zeroes them between steps). The backward
  // then writes every parameter gradient instead of adding to it: the
  // linears with accumulate = false (a GEMM with beta = 0, no read of dW),
  // the other parameters (norm gains, embedding rows, router) zeroed just
  // before their accumulating kernels. Null or false: accumulate.
  const bool* first_micro = nullptr;
  bool writes_grads() const { return first_micro != nullptr && *first_micro; }
  // Packed documents (the [train] switches; the spans are the model's,
  // staged with each micro-batch's tokens, Model::plan points here):
  bool document_attention = false;  // reset_attention_mask: attention within document spans
  bool document_positions = false;  // reset_position_ids: RoPE positions restart at span starts
  const DocumentSpans* documents = nullptr;
  // The attention call's shape; with document_attention it carries the spans.
  AttentionShape attention_shape() const;
  // RoPE of q/k heads [B, S, nh, D] (backward: the inverse, on their
  // gradients), at the positions the run uses: s, or the spans' positions.
  void rope(Tensor& x, double theta, bool backward) const;
  // precision->register_linear, recording the id (the memory plan asks the
  // recipe for each linear's saved activations).
  int register_linear(const LinearDesc& desc) const;
  // A decoder linear of the micro-batch's tokens; under model.recompute =
  // "selective" its block hands x again to the backward (kept or recomputed:
  // LinearDesc::input_in_backward), so a recipe need keep no copy of it.
  LinearDesc layer_linear(std::string name, int64_t in, int64_t out) const;
  // What a block does with a linear input x that only the linear reads
  // (its forward, and its wgrad in the backward):
  //   kept_by_recipe: the recipe keeps its own copy (keeps_wgrad_input): x is
  //     a transient scratch, the backward passes an empty x;
  //   recomputed: model.recompute = "selective" and the recipe keeps none: x
  //     is a transient scratch, and the backward computes it again (the same
  //     op on what is kept) just before the linear's backward;
  //   otherwise x is kept per layer until the backward.
  struct InputPlan {
    bool kept_by_recipe = false, recomputed = false;
    bool transient() const { return kept_by_recipe || recomputed; }
  };
  InputPlan input_plan(std::initializer_list<int> ids) const;
  // True when the recipe keeps its own copy of x for the wgrad of every one
  // of `ids` (Precision::keeps_wgrad_input): a bf16/fp32 x read by nothing
  // but those linears' backward then need not be kept until the backward.
  bool keeps_wgrad_input(std::initializer_list<int> ids) const;
};

// Activation buffers of every block, planned once. A buffer is either a
// block's own (one per layer) or shared by name (gradient scratch, and every
// layer buffer under recompute = full): shared requests of one name get one
// arena block of the largest size asked for.
class ActivationPlan {
 public:
  int own(const std::string& name, size_t bytes);
  int shared(const std::string& name, size_t bytes);
  // own() for per-layer activations, shared() when the whole layer is recomputed.
  int kept(const std::string& name, int64_t layer, size_t bytes, bool recompute_full);
  // A linear's input that only its forward reads (the recipe keeps its own
  // copy for the wgrad, BlockEnv::keeps_wgrad_input): one scratch shared by
  // every block and layer, live from the op that writes it to the linear
  // forwards that read it, within one block's forward.
  int transient_input(size_t bytes) { return shared("scratch.linear_input", bytes); }
  void add_to(ArenaPlan& plan);    // after every block planned
  void bind(const Arena& arena);
  void* ptr(int id) const { return ptrs_.at(static_cast<size_t>(id)); }

 private:
  struct Entry {
    std::string name;
    size_t bytes = 0;
    MemCategory category = MemCategory::activations;
  };
  std::vector<Entry> entries_;
  std::map<std::string, int> shared_index_;
  std::vector<size_t> blocks_;   // arena block per entry
  std::vector<void*> ptrs_;
};

// What a block variant holds at least, from the spec alone: the memory
// floor a config is checked against before any block is built (a model of
// thousands of layers of hundreds of experts takes gigabytes to declare).
// Every number is a lower bound of what the built blocks declare and plan.
struct FloorEnv {
  const ModelSpec* spec = nullptr;
  long double tokens = 0;       // of a micro-batch (train.micro_batch x train.seq_len)
  int64_t expert_parallel = 1;  // sharding.expert_parallel
};
struct BlockFloor {
  long double params = 0;       // parameters one layer's block declares
  int64_t tensors = 0;          // parameter tensors it declares
  // Activation elements (of the recipe's activation dtype) that every plan
  // of a model of these blocks holds for them, once for the whole model
  // (the residual stream, the head and the tokens are the model's own).
  long double activations = 0;
};

class Block {
 public:
  virtual ~Block() = default;
  // "attention.native": names the block in profiler ranges and messages.
  virtual const char* kind() const = 0;
  // Appends this block's parameters to its unit (offsets follow the unit's numel).
  virtual void declare(UnitInfo& unit) = 0;
  virtual void plan(const BlockEnv& env, ActivationPlan& acts) = 0;
  virtual void bind(const ActivationPlan& acts) { acts_ = &acts; }

 protected:
  // A view of this block's parameter (or its gradient) number `index` among
  // the ones it declared, from the unit's flat buffer.
  Tensor param(const UnitState& u, int index, bool grad = false) const;
  // Several consecutive parameters of equal row width seen as one matrix: the
  // fused blocks' [q; k; v] and [gate; up] weights.
  Tensor param_rows(const UnitState& u, int first, int count, bool grad = false) const;
  // Half `which` (0: the first f columns, gate; 1: the last f, up) of a
  // packed [rows, 2f] matrix view, as a [rows, f] view with its row stride:
  // what SwiGLU reads of a [gate; up] GEMM's output and writes of its gradient.
  static Tensor column_half(const Tensor& packed, int which);
  // Linear `linear`'s next x (this micro-batch's rows) as an FP8 operand,
  // when the recipe offers it (Precision::fp8_operand): the block's kernel
  // then writes *op instead of a bf16 x. x_kept_by_recipe: the block planned
  // no bf16 x for the linear's wgrad (BlockEnv::keeps_wgrad_input), which an
  // FP8 x requires; a recipe that offers one otherwise is refused.
  bool fp8_input(int linear, bool x_kept_by_recipe, Fp8Operand* op) const;
  // Where the block's kernel that makes linear `linear`'s next operand of
  // `role` (this micro-batch's rows) max-accumulates its amax for the recipe
  // (Fp8OperandAmax, loom/precision.hpp), or null: the recipe measures it.
  float* operand_amax(int linear, Fp8OperandRole role) const;
  // Linear `linear`'s xᵀ for its backward (this micro-batch's rows), to be
  // written in FP8 by the block's kernel that recomputes x there, when the
  // recipe offers it (Fp8RecastOperand, loom/precision.hpp): pass op->q_t
  // as the linear_backward's x then.
  bool recast_input(int linear, Fp8Operand* op) const;
  // The RMSNorm of x (gain w) that makes linear `linear`'s x, and rstd: in
  // FP8 where the recipe takes x so (fp8_input; x_kept_by_recipe as there),
  // else into `ln` (the activation dtype), measured for the recipe where it
  // asks (operand_amax). Returns what that linear_forward takes as x.
  Tensor rmsnorm_for(int linear, bool x_kept_by_recipe, const Tensor& ln, Tensor& rstd, const Tensor& x,
                     const Tensor& w, float eps) const;
  // Selective recompute: the RMSNorm of x (gain w) computed again for linear
  // `linear`'s backward, rstd rewritten with the values it holds; into `ln`
  // (the activation dtype), or as the linear's xᵀ in FP8 where the recipe
  // offers it (recast_input). Returns what that linear_backward takes as x.
  Tensor recompute_rmsnorm_for(int linear, const Tensor& ln, Tensor& rstd, const Tensor& x, const Tensor& w,
                               float eps) const;
  void* buf(int id) const { return acts_->ptr(id); }
  Device dev() const { return env_.backend->device(); }
  // An activation buffer seen as a tensor of the recipe's activation dtype, or of fp32.
  Tensor act(int id, std::initializer_list<int64_t> dims) const {
    return Tensor(buf(id), env_.act, env_.backend->device(), dims);
  }
  Tensor f32(int id, std::initializer_list<int64_t> dims) const {
    return Tensor(buf(id), DType::f32, env_.backend->device(), dims);
  }
  int add_param(UnitInfo& unit, std::string name, std::vector<int64_t> shape, ParamRole role);
  // env.register_linear for a linear whose weight is this block's parameters
  // first .. first + count - 1 (consecutive, one matrix), recording where the
  // weight sits (BlockEnv::linear_weights).
  int register_weight_linear(const BlockEnv& env, const LinearDesc& desc, int first, int count = 1) const;

  BlockEnv env_;
  const ActivationPlan* acts_ = nullptr;
  std::vector<int> params_;  // indices into the unit's params, in declaration order
  std::string unit_name_;    // the unit the parameters were declared into
  std::vector<std::pair<int64_t, int64_t>> spans_;  // offset and numel of each, in declaration order
};

// The attention half of decoder layer `layer`: x -> x + attention(rmsnorm(x)).
class AttentionBlock : public Block {
 public:
  // HF LlamaAttention's parameters of `layer`, in the order of its state
  // dict: input_layernorm, q, k, v, o — the layout every variant keeps (q, k
  // and v consecutive: together they are the fused block's [q; k; v] weight).
  enum Param { kLn1 = 0, kWq, kWk, kWv, kWo };
  AttentionBlock(const ModelSpec& spec, int64_t layer) : spec_(spec), layer_(layer) {}
  void declare(UnitInfo& unit) override;
  // The floor of a variant that declares these parameters (declare) and
  // plans nothing every plan must hold (AttentionVariant::floor).
  static BlockFloor hf_floor(const FloorEnv& env);
  // in: the residual stream entering the layer; out: after the attention residual.
  virtual void forward(const UnitState& u, const Tensor& in, Tensor& out) = 0;
  // d: dL/d(out) on entry, dL/d(in) on return. `in` is the forward's input.
  virtual void backward(UnitState& u, const Tensor& in, Tensor& d) = 0;

 protected:
  const ModelSpec& spec_;
  int64_t layer_;
};

// The feed-forward half: x -> x + ffn(rmsnorm(x)).
class FfnBlock : public Block {
 public:
  // HF LlamaMLP's parameters of `layer`: post_attention_layernorm, gate, up,
  // down (gate and up consecutive: the fused block's [gate; up] weight).
  enum Param { kLn2 = 0, kWgate, kWup, kWdown };
  FfnBlock(const ModelSpec& spec, int64_t layer) : spec_(spec), layer_(layer) {}
  // Expert parallelism: declares the block's experts into a unit of their own
  // (before declare(), which then leaves them out); false when the block has
  // no experts.
  virtual bool declare_experts(UnitInfo& /*unit*/) { return false; }
  // That unit's state, set before each forward and backward.
  virtual void set_experts(const UnitState* /*experts*/) {}
  void declare(UnitInfo& unit) override;
  // The floor of a variant that declares these parameters (declare) and
  // keeps a [tokens, ffn_hidden] gate and up (FfnVariant::floor).
  static BlockFloor hf_floor(const FloorEnv& env);
  virtual void forward(const UnitState& u, const Tensor& in, Tensor& out) = 0;
  virtual void backward(UnitState& u, const Tensor& in, Tensor& d) = 0;

 protected:
  const ModelSpec& spec_;
  int64_t layer_;
};

// A block variant, as its file defines it (blocks/<variant>.cpp) and the
// factory's table lists it (blocks/block_table.cpp): adding a variant is its file
// and one row of that table.
struct AttentionVariant {
  const char* name;  // model.layers = name
  std::unique_ptr<AttentionBlock> (*make)(const ModelSpec& spec, int64_t layer);
  BlockFloor (*floor)(const FloorEnv& env);
  // The LM head computes its logits in chunks of tokens (model.head_chunk)
  // rather than the whole micro-batch's at once (HF's materialised logits).
  bool chunked_head;
};
struct FfnVariant {
  const char* name;  // model.ffn = name
  std::unique_ptr<FfnBlock> (*make)(const ModelSpec& spec, int64_t layer);
  BlockFloor (*floor)(const FloorEnv& env);
};

// The variants by name (blocks/block_table.cpp). model.layers names an attention
// variant; model.ffn = "dense" is the feed-forward variant of model.layers'
// name (a spec with experts, spec.moe(), that of "moe": the config reader
// makes model.ffn = "moe" for one), any other value a feed-forward variant by
// name. An unknown name is refused with the key, the registered variants and
// the nearest one.
const AttentionVariant& attention_variant(const std::string& layers);
const FfnVariant& ffn_variant(const std::string& ffn, const std::string& layers, const ModelSpec& spec);
// The registered names, in table order ("native", "fused").
std::vector<std::string> attention_variant_names();
// model.ffn's accepted values: "dense", then the feed-forward variants.
std::vector<std::string> ffn_variant_names();
// The variants make_*_block knows, for messages ("native, fused").
std::string layer_variants();
// Whether model.layers = `variant` names one of them.
bool is_layer_variant(const std::string& variant);

// A profiler range (NVTX on CUDA) for the scope of one op or block; also a
// range of the step tracer while a profiling window is open (loom/trace.hpp).
class Range {
 public:
  Range(Backend& b, const char* name) : b_(b), trace_(trace::Track::compute, name, b.ctx().stream) {
    b_.range_push(name);
  }
  ~Range() { b_.range_pop(); }
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  Backend& b_;
  trace::Scope trace_;  // ends after range_pop: the tracer's range encloses the NVTX one
};

}  // namespace loom
