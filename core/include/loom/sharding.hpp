// Sharding plugins decide where parameters, gradients and optimizer state live
// on each rank and run the collectives around each unit (docs/ARCHITECTURE.md
// "The step, without waiting for the host"). The core owns the buffers (one arena, sized from the plan
// the plugin returns) and the optimizer arithmetic; the plugin owns the
// communication and which range of each unit this rank updates.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "loom/arena.hpp"

#include "loom/comm.hpp"
#include "loom/context.hpp"
#include "loom/model.hpp"
#include "loom/plugin.hpp"
#include "loom/tensor.hpp"

namespace loom {

// Sizes (in elements) of one unit's buffers on this rank, as the plugin wants them.
// Flat indices below are positions in the unit's flat parameter vector
// (ParamInfo::offset); [info.numel, padded_numel) is zero padding.
struct UnitLayout {
  int64_t padded_numel = 0;  // flat size padded to divide the shard group
  int64_t param_numel = 0;   // resident compute-dtype params between steps
  bool params_sharded = false;  // resident params are the owned range only (zero3); else the whole padded unit
  int64_t grad_numel = 0;    // per-unit gradient buffer the core allocates (0: the plugin lends one from scratch)
  int64_t grad_shard_numel = 0;  // fp32 reduced-gradient shard, 0 if none
  int64_t optim_numel = 0;   // master / m / v elements (the owned range)
  int64_t optim_begin = 0;   // owned range start in the padded flat unit
  // Checkpoints: `replicas` ranks own this same range (ddp: every rank; hybrid
  // shard: one per shard group) and this rank is number `replica` of them; each
  // writes its share of the range so a checkpoint holds every element once.
  int replica = 0, replicas = 1;
};

// One unit's buffers on this rank (tensors are flat, 1-D).
struct UnitState {
  int index = 0;
  const UnitInfo* info = nullptr;
  UnitLayout layout;
  Tensor params;       // what forward/backward read: the whole unit (zero3: a gathered buffer, set by the plugin)
  Tensor param_shard;  // zero3: the resident owned range (empty otherwise)
  Tensor grads;        // what backward accumulates into (the whole unit; the plugin may point it at scratch)
  Tensor grad_shard;   // reduced fp32 gradient shard (empty when unused)
  Tensor master;       // fp32 master for the owned range (empty when the recipe has none)
  Tensor adam_m, adam_v;
  // ABI 10.1. Set by the strategy in before_backward (the core clears it just
  // before): true when `grads` now points at a buffer that this backward alone
  // fills and nothing reads before it (zero2 / zero3 / hybrid_shard lend one
  // per unit per micro-batch, then reduce it). The strategy then need not
  // clear it: the unit's backward writes every gradient (BlockEnv::
  // first_micro) where it can, and where it cannot (its layer also adds into
  // an experts unit that accumulates over the step) the core zeroes `grads`
  // first. The padding, [info->numel, padded), is the strategy's to zero. Not
  // for a unit whose gradients another unit's backward writes first (the
  // embedding when tied to the head): the core refuses it.
  bool grads_fresh = false;
};

// A buffer a strategy needs beyond the per-unit ones (gather pools, gradient
// scratch, reduce staging). The core allocates it in the arena after plan()
// and hands it to setup(), in the order asked for, so `loom check` accounts for it.
struct ShardingBuffer {
  std::string name;
  DType dtype = DType::f32;
  int64_t numel = 0;
  MemCategory category = MemCategory::comm;
};

struct AdamWHyper {
  float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;  // 1-based, for bias correction
};

// Arithmetic the core provides to sharding plugins (CPU or CUDA kernels, queued
// on ctx's stream). Nothing here waits for the device: the global gradient
// norm, the clipping coefficient and the skip decision for non-finite
// gradients stay on the device, where adamw() reads them, and the core reads
// them back only when it logs.
class OptimizerOps {
 public:
  virtual ~OptimizerOps() = default;
  // Adds the sum of squares of grads[begin, end) (fp32 or bf16, accumulated
  // in double in a fixed order) into this step's norm accumulator.
  virtual void norm_add(const ExecContext& ctx, const Tensor& grads, int64_t begin, int64_t end) = 0;
  // Completes the global norm: adds up the accumulators of `group` (the ranks
  // whose norm_add calls together cover every parameter exactly once; null or
  // a one-rank group when this rank covered everything), then derives the
  // clipping coefficient (torch's clip_grad_norm_: max_norm / (norm + 1e-6)
  // when below 1) and whether the step is skipped (a non-finite norm). Call
  // once per step, after every norm_add and before any adamw.
  virtual void norm_finish(const ExecContext& ctx, Communicator* group) = 0;
  // AdamW on the unit's owned range: grads_owned holds the (reduced) gradients
  // for [optim_begin, optim_begin + optim_numel), scaled by the step's
  // clipping coefficient before use; params for that range are written back
  // into params_out in the param dtype, whose element 0 is flat index
  // params_out_begin (0 for a whole-unit buffer, optim_begin for a shard).
  // Weight decay is applied only to parameters whose role decays. A skipped
  // step leaves everything unchanged. consume_grads: grads_owned is zeroed
  // once read (also on a skipped step), for a strategy that zeroes its
  // gradients this way (Sharding::zeroes_grads).
  virtual void adamw(const ExecContext& ctx, UnitState& unit, const Tensor& grads_owned, const AdamWHyper& h,
                     Tensor& params_out, int64_t params_out_begin, bool consume_grads = false) = 0;
  // Overlap. The optimizer may run on its own queue beside the compute queue
  // (CUDA: a second stream; CPU: the compute queue itself), so that
  // memory-bound AdamW overlaps compute-bound GEMMs. Work on the two queues is
  // ordered only through markers: mark(q) names a point in q's queued work,
  // wait(ctx, m) makes ctx's later work wait for it (on the device, never the
  // host). Every op above runs on the queue of the context it is given.
  virtual ExecContext optimizer_queue(const ExecContext& compute) = 0;
  virtual uint64_t mark(const ExecContext& ctx) = 0;
  virtual void wait(const ExecContext& ctx, uint64_t marker) = 0;
  virtual void zero(const ExecContext& ctx, Tensor& t) = 0;
  virtual void accumulate(const ExecContext& ctx, Tensor& dst, const Tensor& src) = 0;  // dst += src (fp32)
  virtual void convert(const ExecContext& ctx, Tensor& dst, const Tensor& src) = 0;     // fp32 <-> bf16 or copy
};

// A unit's parameters on the wire of a sharded gather in compact form
// (sharding.gather_dtype = "fp8", ABI 6.0). The precision recipe supplies it
// (Precision::gather_codec, ABI 10.0; the core's stand-in, for a recipe that
// supplies none, has no FP8 weight and says why): the weights the recipe
// casts to FP8 per tensor from their current amax travel as FP8 codes, one
// byte an element, with the scale the recipe will use; every other parameter
// (norm gains, the embedding, the LM head, weights under other casts) travels
// as it is. A unit gathered over `group` ranks is group chunks of `chunk`
// elements; on the wire each chunk takes wire_chunk_bytes(unit) bytes, so one
// all_gather of bytes moves it.
class GatherCodec {
 public:
  virtual ~GatherCodec() = default;
  // Linears whose weights can travel in FP8; 0: none can, and why_none() says
  // why in words naming the configuration (for the strategy's message).
  virtual int fp8_weights() const = 0;
  virtual std::string why_none() const = 0;
  // Once, in the strategy's plan(): the shard group's size, this rank's
  // position in it, and each unit's chunk in elements (0 for a unit that is
  // never gathered).
  virtual void plan(int group, int position, const std::vector<int64_t>& chunk) = 0;
  virtual int64_t wire_chunk_bytes(int unit) const = 0;
  // The codec's own state (amaxes, scales) where the model runs, in bytes:
  // asked by the core after the strategy's plan(), which it planned in the
  // arena as "sharding.fp8_gather.scales" (comm) when not 0. A codec no
  // strategy planned (plan() never called) answers 0. ABI 10.0.
  virtual size_t state_bytes() const { return 0; }
  // That memory (state_bytes() bytes, 256-byte aligned), once the arena is
  // allocated and before the first encode(); start-up, so it may wait for
  // the device. Not called when state_bytes() is 0. ABI 10.0.
  virtual void bind(void* /*ptr*/) {}
  // After the parameters changed (start, resume, every optimizer step): the
  // amax of every FP8 weight over the whole weight (this rank's ranges,
  // max-reduced over `group` with one all-reduce for all units), its scale,
  // and each gathered unit's own chunk encoded into wire[unit]. Queued on ctx,
  // the host does not wait.
  virtual void encode(const ExecContext& ctx, Communicator& group, const std::vector<UnitState>& units,
                      std::vector<Tensor>& wire) = 0;
  // The unit's params [padded] from its gathered wire [group * wire_chunk_bytes].
  virtual void decode(const ExecContext& ctx, int unit, const Tensor& wire, Tensor& params) = 0;
};

// ABI 10.3: an optional interface of a GatherCodec, which a strategy asks
// for with dynamic_cast (a codec without it is asked nothing). After plan():
// true when no weight of `unit` travels in FP8, so that the unit's wire
// would hold its parameters as they are. The strategy may then gather that
// unit as it would without the codec (its parameter shard straight into its
// parameters: no wire buffer, no copy out of it) and plan() the codec again
// with chunk 0 for it, so that encode() and decode() never see it.
class GatherCodecPlainUnits {
 public:
  virtual ~GatherCodecPlainUnits() = default;
  virtual bool gathers_as_params(int unit) const = 0;
};

struct ShardingEnv {
  ExecContext ctx;
  Communicator* world = nullptr;  // all ranks, tensors where the model runs (MPI on CPU, NCCL on CUDA)
  Communicator* host = nullptr;   // all ranks, host tensors (scalars such as norms); == world on CPU
  OptimizerOps* ops = nullptr;
  int local_world = 1;            // ranks on this node (hybrid_shard's default group)
  DType param_dtype = DType::f32; // the precision recipe's parameter and gradient dtypes
  DType grad_dtype = DType::f32;
  int64_t grad_accum = 1;         // micro-batches per step
  GatherCodec* codec = nullptr;   // ABI 6.0: never null when the core plans the strategy (the recipe's, ABI 10.0)
  // Gradients arrive already divided by the number of ranks (the core scales
  // the loss by 1 / (tokens * grad_accum * world)): strategies reduce with sum.
};

class Sharding : public Plugin {
 public:
  // Called once with every unit; returns one layout per unit.
  virtual std::vector<UnitLayout> plan(const ShardingEnv& env, const std::vector<UnitInfo>& units) = 0;
  // Extra buffers, asked for once after plan().
  virtual std::vector<ShardingBuffer> scratch(const ShardingEnv& /*env*/) { return {}; }
  // Called once after the core has allocated and initialised the buffers
  // (params / param_shard hold the initial weights on every rank); `scratch`
  // holds the buffers scratch() asked for.
  virtual void setup(ShardingEnv& /*env*/, std::vector<UnitState>& /*units*/, std::vector<Tensor>& /*scratch*/) {}
  // Called by the core before the first micro-batch of each step.
  virtual void begin_step(ShardingEnv& /*env*/, std::vector<UnitState>& /*units*/) {}
  virtual void before_forward(ShardingEnv& /*env*/, UnitState& /*unit*/) {}
  virtual void after_forward(ShardingEnv& /*env*/, UnitState& /*unit*/) {}
  virtual void before_backward(ShardingEnv& /*env*/, UnitState& /*unit*/) {}
  // last_micro: the last micro-batch of the step (communicate now where the strategy allows waiting).
  virtual void after_backward(ShardingEnv& /*env*/, UnitState& /*unit*/, bool /*last_micro*/) {}
  // The optimizer step: the global norm (env.ops->norm_add over the gradients
  // this rank owns, then norm_finish over the group that shares them out),
  // AdamW on owned ranges (env.ops->adamw), re-gathers where needed. Must not
  // wait for the device: clipping and skipping happen there. It may queue its
  // work on env.ops->optimizer_queue() if before_forward orders each unit's
  // next forward after that unit's update (markers).
  virtual void step(ShardingEnv& env, std::vector<UnitState>& units, const AdamWHyper& h) = 0;
  // True when this strategy needs no zeroed gradients at a step's start: the
  // first micro-batch's backward writes every parameter gradient of a unit
  // (the linears' wgrad with beta = 0, the other parameters zeroed just before
  // their accumulating kernels), so whatever the last step left there is
  // overwritten; the core then skips its zeroing pass. (A strategy may also
  // leave them at zero itself, adamw with consume_grads.) False: the core
  // zeroes every unit's gradients at each step's start.
  virtual bool zeroes_grads() const { return false; }
};

template <> struct PluginInterface<PluginKind::sharding> { using type = Sharding; };

}  // namespace loom
