// Precision plugins own storage dtypes and every GEMM (docs/PLUGINS.md).
//
// Linear layers follow HF: weight W is [out, in] row-major, y = x W^T.
// The core registers every linear once at start-up (register_linear) and then
// calls forward/backward with the returned id, so a recipe can keep per-GEMM
// state (cached descriptors, fp8 scales and amax history).
//
// Life of a recipe object (plugin ABI 10):
//   constructor(PluginInit)        reads and checks its [precision] table
//   variable_row_multiple()        asked by blocks that pad variable rows (MoE), ABI 7.0
//   register_linear(desc) ...      every linear, before anything is planned
//                                  (keeps_wgrad_input(id) is known from here on)
//   gather_codec(GatherCodecSetup) once, before the sharding strategy plans: the recipe's
//                                  FP8 weight gathers, or null (ABI 10.0)
//   setup(PrecisionSetup)          communicator, determinism, device, the strategy's
//                                  layout (params_sharded: after its plan since ABI 8.2)
//   saved_activation_bytes(id), workspace_bytes()   planned by the core (memory plan, `loom check`)
//   set_workspace / set_saved_activations           the planned memory
//   state_tensors()                what a checkpoint saves and restores by name
//   linear_forward / linear_backward ... end_step()   every step
//   fp8_operand(id, role, rows)    asked in a step before a block's kernel makes x or dy (ABI 8.0)
//   operand_amax(id, role, rows)   the same, for its amax only (Fp8OperandAmax below, ABI 10.2)
//   recast_operand(id, rows)       asked in a backward before a block's kernel recomputes x: its xᵀ
//                                  in FP8 (Fp8RecastOperand below, ABI 10.2)
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm.hpp"
#include "loom/context.hpp"
#include "loom/model.hpp"
#include "loom/plugin.hpp"
#include "loom/sharding.hpp"
#include "loom/tensor.hpp"

namespace loom {

// Model flops utilisation is measured against one peak for every recipe: the
// dense bf16 rate of an H100/H200 (docs/ARCHITECTURE.md "MFU"), 989 TFLOP/s. An FP8
// recipe is not measured against the FP8 peak, so MFU compares across recipes.
constexpr double kMfuPeakFlops = 989e12;

struct PrecisionDTypes {
  DType param;        // parameters as the GEMMs read them
  DType master;       // master copy updated by the optimizer (== param when has_master is false)
  DType grad;         // gradient buffers
  DType optim_state;  // AdamW m and v
  DType activation;   // activations between ops
  bool has_master;    // a separate master copy exists
  bool stochastic_rounding = false;  // round updated params stochastically (recipes without a master)
};

// What a linear is in the model, so that a recipe can treat some differently
// (the FP8 recipes keep the LM head in full precision by default).
enum class LinearRole : uint8_t {
  hidden = 0,   // a projection inside a decoder layer (attention, feed-forward)
  lm_head = 1,  // the output projection to the vocabulary (the tied embedding when tied)
};
const char* linear_role_name(LinearRole r);

struct LinearDesc {
  std::string name;   // "layer.3.q_proj"
  int64_t in = 0;     // k
  int64_t out = 0;    // n
  int64_t max_rows = 0;  // m: tokens per micro-batch (rows of x)
  LinearRole role = LinearRole::hidden;
  // The row count changes from call to call, up to max_rows (a MoE expert gets
  // the rows its router sends it): a recipe should not build a GEMM plan per
  // row count (the cuBLASLt recipes plan once, for max_rows, and check that
  // plan's algorithm for each new count).
  bool variable_rows = false;
  // ABI 8.2: the block hands linear_backward this linear's x again, bitwise
  // the x of the forward (kept by the block, or recomputed from what it
  // kept: model.recompute = "selective"). A recipe may then keep nothing of x
  // between the forward and the backward — no saved activations for it,
  // keeps_wgrad_input false — and cast x again in the backward with the
  // scale its forward used (the same codes). A recipe that keeps its copy
  // anyway stays correct: the block then neither keeps nor recomputes x.
  bool input_in_backward = false;
};

// Handed to the recipe once, after every linear is registered and before the
// memory is planned.
struct PrecisionSetup {
  // The data-parallel group: every rank of it computes the same linears on
  // other data, so a recipe's per-tensor statistics (FP8 amaxes) are reduced
  // over it. Never null (a one-rank communicator when training alone). Host
  // tensors when device_tensors() is false (self, MPI), device tensors for NCCL.
  Communicator* data_parallel = nullptr;
  bool deterministic = false;  // run.deterministic
  Device device = Device::cpu;
  // train.grad_accum: micro-batches per optimizer step (ABI 5.0). A recipe
  // that caches cast weights decides from it whether a per-step cache saves
  // work (the FP8 recipes' weight_cache = "auto").
  int grad_accum = 1;
  // ABI 8.2: the sharding strategy keeps each unit's parameters sharded and
  // gathers them for every use (zero3, full_shard, hybrid_shard): a copy of
  // cast weights kept for a whole step would be of the whole, unsharded
  // model on every rank (the FP8 recipes' weight_cache = "auto" then casts
  // per GEMM). setup() comes after the strategy's plan for this.
  bool params_sharded = false;
};

// One tensor of recipe state (scales, amax history, counters) that a
// checkpoint saves as a tensor and gives back, matched by name, on resume.
// The recipe owns the memory (host or device, as `tensor` says) for its
// lifetime. Replicated state is equal on every rank and written once (by rank
// 0); sharded state differs per rank and is written by each rank, resumed only
// with the same world size.
struct StateTensor {
  std::string name;  // unique within the recipe, e.g. "fp8.scale"
  Tensor tensor;     // any dtype, contiguous
  bool replicated = true;
};

// Where a linear's weight sits: a range of one unit's flat parameters
// (UnitInfo; the fused blocks' [q; k; v] and [gate; up] span several
// parameters, one range). The blocks record one for the linears of the
// decoder layers as they register them (not the LM head). ABI 10.0.
struct LinearWeight {
  int id = -1;           // the recipe's id (register_linear)
  std::string unit;      // UnitInfo::name
  int64_t offset = 0;    // elements from the start of the unit's flat parameters
  int64_t numel = 0;     // out * in
};

// What a recipe's FP8 weight gathers are built from (Precision::gather_codec,
// ABI 10.0): the model's units, where each linear's weight sits in them, and
// how the parameters are stored. Valid during the call only (copy what the
// codec keeps).
struct GatherCodecSetup {
  std::vector<UnitInfo> units;         // every unit, in the order the strategy's plan sees them
  std::vector<LinearWeight> weights;   // the decoder layers' linears, in registration order
  DType param_dtype = DType::f32;      // dtypes().param: what the strategy gathers
  Device device = Device::cpu;         // where the parameters live (host memory on the CPU)
};

// A linear's FP8 operand that a block's own kernel writes in place of the
// bf16 tensor the recipe would otherwise cast (ABI 8.0): the kernel that
// makes x (or dy) writes its codes directly, and the bf16 write and the
// cast's read of that tensor never happen. For every element v of the operand,
// rounded to the activation dtype first (the value the block would have
// handed over), the kernel writes q = encode(v * *scale) in q's format (E4M3
// or E5M2, round to nearest even, saturating; loom/fp8.hpp) into q and into
// its transposed copy q_t, and max-accumulates |v| into *amax (a NaN as +inf;
// atomicMax on the float's bits). Then the block hands q itself to the
// recipe: as x to linear_forward or as dy to linear_backward.
enum class Fp8OperandRole : uint8_t {
  x = 0,   // the input of linear_forward
  dy = 1,  // the output gradient of linear_backward
};
struct Fp8Operand {
  Tensor q;                      // [rows, cols] contiguous, e4m3 or e5m2 (cols: in for x, out for dy)
  Tensor q_t;                    // [cols, rows] contiguous, q's dtype
  const float* scale = nullptr;  // device float
  float* amax = nullptr;         // device float, max-accumulated (never cleared by the writer)
};

class Precision : public Plugin {
 public:
  virtual PrecisionDTypes dtypes() const = 0;
  // Called once per linear before the first step; returns its id.
  virtual int register_linear(const LinearDesc& desc) = 0;
  // Bytes the recipe keeps per call of linear_forward for linear `id` until
  // the matching backward (e.g. FP8 copies of x): the core plans them as
  // activations, once per linear (the sum over linears is what
  // set_saved_activations hands over). Known after register_linear.
  virtual size_t saved_activation_bytes(int /*id*/) const { return 0; }
  // True when the recipe keeps its own copy of x from linear `id`'s forward
  // (in its saved activations) for the wgrad and so never reads the `x`
  // handed to linear_backward for that linear: the block then need not keep
  // x until the backward (it may plan x as a transient scratch shared by every
  // layer, and pass an empty Tensor as x to linear_backward). Must hold for
  // every call of the linear (a recipe that sometimes falls back to a GEMM
  // reading x, e.g. for variable_rows linears, answers false). Known after
  // register_linear(id); ABI 5.0.
  virtual bool keeps_wgrad_input(int /*id*/) const { return false; }
  // Workspace the recipe needs on the device (bytes), known after all linears are registered.
  virtual size_t workspace_bytes() const { return 0; }
  // Once, after every register_linear and before the memory is planned.
  virtual void setup(const PrecisionSetup& /*setup*/) {}
  virtual void set_workspace(void* /*ptr*/, size_t /*bytes*/) {}
  // The memory for the saved activations: the sum of saved_activation_bytes
  // over every registered id, laid out by the recipe (not called when 0).
  virtual void set_saved_activations(void* /*ptr*/, size_t /*bytes*/) {}
  // y[m, out] = x[m, in] * W[out, in]^T (+ residual[m, out] when residual is not null).
  // The residual is the GEMM's C input with beta = 1 (cuBLASLt epilogue), so a
  // fused layer adds the residual stream in the same pass that writes y; it has
  // y's dtype and shape, may be a row view, and may be y itself.
  virtual void linear_forward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, Tensor& y,
                              const Tensor* residual) = 0;
  // dx[m, in] = dy[m, out] * W   (skipped when dx is null)
  // dW[out, in] = dy^T x, added to dW when accumulate is true (micro-batches), else written.
  // When keeps_wgrad_input(id) is true, x may be an empty Tensor (no data):
  // the rows come from dy.
  virtual void linear_backward(const ExecContext& ctx, int id, const Tensor& x, const Tensor& w, const Tensor& dy,
                               Tensor* dx, Tensor& dw, bool accumulate) = 0;
  // Once per optimizer step, after the update (scale/amax bookkeeping). The
  // parameters have their new values: a recipe that caches cast weights
  // drops them here.
  virtual void end_step(const ExecContext& /*ctx*/) {}
  // The recipe state a checkpoint saves (after setup; the same names, shapes
  // and dtypes for the object's lifetime). On resume the core fills these
  // tensors from a checkpoint written by a recipe of the same name (one the
  // checkpoint lacks keeps the recipe's value), then calls state_loaded(),
  // which checks every restored value and throws loom::Error naming the
  // tensor, element and value for one it refuses (the core adds the
  // checkpoint, the rank file and the way back); a checkpoint of another
  // recipe leaves them as they are (the state starts fresh, and the log says so).
  virtual std::vector<StateTensor> state_tensors() { return {}; }
  virtual void state_loaded() {}
  // A short description of the recipe's state for log steps (e.g. FP8 scales
  // and skipped updates), "" for nothing; the core prints it after the step's
  // log line as "precision: <text>".
  virtual std::string log_summary() const { return {}; }
  // The recipe's FP8 weight gathers (sharding.gather_dtype = "fp8", as
  // torchtitan's float8 all-gather): a GatherCodec (loom/sharding.hpp) that
  // moves the weights the recipe casts to FP8 in the very codes its own cast
  // would make, and every other parameter as it is. Only a weight cast per
  // tensor with a scale from its own current amax on every call can travel
  // so (the codec measures the same amax over the shards, encodes the same
  // codes, and the recipe, casting the decoded weight again, gets them
  // back); delayed scaling's scales from past amaxes, block scales and
  // full-precision linears cannot. Null (the default): the recipe offers
  // none, and a strategy asked for FP8 gathers refuses the run saying so.
  // Asked once, after every register_linear and before setup() (the strategy
  // plans with the codec); the codec must touch no device memory before its
  // bind(). plugins/precision/common/fp8_gather.{hpp,cpp} is fp8_current's.
  // ABI 10.0.
  virtual std::unique_ptr<GatherCodec> gather_codec(const GatherCodecSetup& /*setup*/) { return nullptr; }
  // The row multiple the recipe runs a variable-row linear's call in whole
  // (LinearDesc::variable_rows, the MoE experts): a call whose row count is a
  // multiple of it takes the recipe's fast path in one piece, any other count
  // is split or falls back. 1 for recipes that take any count (bf16); the GPU
  // FP8 recipes answer 16 (per-tensor) and 128 (fp8_block). A block that lays
  // out such rows itself pads each call to it (the MoE block on a device,
  // MoeRouting::row_align), so it should stay small (at most 1024). Asked
  // before the linears are registered, as the padded row counts set their
  // max_rows. ABI 7.0.
  virtual int64_t variable_row_multiple() const { return 1; }
  // Offers linear `id`'s next operand of `role` (`rows` rows) in FP8, written
  // by the block's own kernel (Fp8Operand): true and `op` filled when the
  // recipe takes it so, false to be handed bf16 as usual. Only a recipe whose
  // scale for that tensor is known before the tensor exists can say true
  // (delayed scaling; current scaling measures the tensor first). Asked on
  // the compute stream just before the block makes the operand (the recipe
  // may queue work there, e.g. clear a pending amax); the next
  // linear_forward (x) or linear_backward (dy) call of `id` must then pass
  // op.q. An x may be offered only for a linear whose wgrad input the recipe
  // keeps itself (keeps_wgrad_input(id)): the block then writes no bf16 x.
  // A block asks only where it has a kernel that writes FP8 (on CUDA, the
  // fused blocks' RMSNorm and SwiGLU). ABI 8.0.
  virtual bool fp8_operand(const ExecContext& /*ctx*/, int /*id*/, Fp8OperandRole /*role*/, int64_t /*rows*/,
                           Fp8Operand* /*op*/) {
    return false;
  }
};

// Optional interface of a recipe object (since ABI 10.2), found with
// dynamic_cast on the Precision: the amax of a linear's next operand measured
// by the block's kernel that makes it, for a recipe that scales each tensor
// from its own current amax and so cannot take the operand in FP8
// (fp8_operand) but would otherwise read the whole tensor once just to
// measure it before casting it. Asked on the compute stream just before the
// block's kernel makes the operand (`rows` rows of linear `id`'s x or dy):
// the recipe returns a device float, cleared on that stream, or null to
// measure the tensor itself. Given a float, the kernel writes the operand in
// the activation dtype as usual and max-accumulates |v| of every value as
// stored into it (a NaN as +inf; atomicMax on the float's bits: the
// Backend's *_amax kernels, loom/ops/backend.hpp); the next linear_forward
// (x) or linear_backward (dy) call of `id`, with those rows, then takes that
// amax as the tensor's. A block asks only where it has such a kernel (on
// CUDA, the fused blocks' RMSNorm and SwiGLU) and only when fp8_operand
// declined.
class Fp8OperandAmax {
 public:
  virtual ~Fp8OperandAmax();
  virtual float* operand_amax(const ExecContext& ctx, int id, Fp8OperandRole role, int64_t rows) = 0;
};

// Optional interface of a recipe object (since ABI 10.2), found with
// dynamic_cast on the Precision: the xᵀ that linear `id`'s backward needs,
// written by the block's kernel that recomputes x there (model.recompute =
// "selective": the linear was registered with input_in_backward, and the
// recipe keeps no FP8 copy of x but casts the x it is handed again, with the
// scale its forward used). Asked on the compute stream just before the
// block's kernel recomputes x (`rows` rows): true and `op` filled when the
// recipe takes it so — op.q empty (the kernel writes op.q_t [in, rows]
// alone), op.scale the forward's scale of x, op.amax null (the forward
// measured x) — or false to be handed x in bf16 as usual. The next
// linear_backward of `id` must then pass op.q_t itself as its x. A block
// asks only where it has a kernel that writes FP8 (on CUDA, the fused
// blocks' RMSNorm and SwiGLU).
class Fp8RecastOperand {
 public:
  virtual ~Fp8RecastOperand();
  virtual bool recast_operand(const ExecContext& ctx, int id, int64_t rows, Fp8Operand* op) = 0;
};

template <> struct PluginInterface<PluginKind::precision> { using type = Precision; };

}  // namespace loom
