// The memory of a run, planned once and allocated once (docs/ARCHITECTURE.md
// "Memory"): every unit's parameters, gradients and optimizer state laid
// out as the sharding plugin asks, the plugin's scratch, the model's
// activations, the precision recipe's workspace and the step's device
// scalars — one arena. Also the parameters by HF name (read, write), which
// initialisation, HF import and the tests use.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "config/run_config.hpp"
#include "loom/arena.hpp"
#include "loom/sharding.hpp"
#include "model/model.hpp"
#include "train/optimizer.hpp"
#include "train/runtime.hpp"

namespace loom {

// Refuses (loom::Error, with what to change) a config whose smallest
// possible plan cannot fit the memory available, from its numbers alone,
// before any layer or expert is built: the weights, gradients and optimizer
// state as an equal share of every rank, the activations every plan holds,
// and the host memory that describing the parameter tensors takes. A lower
// bound of TrainState::check_memory_fits' plan, so it never refuses a config
// that check would let through (but for that description, which is real
// memory the detailed plan does not count). make_runtime calls it once the
// precision plugin has said its dtypes.
void check_memory_can_fit(const Config& cfg, const ModelSpec& spec, const Runtime& rt);

// The numbers check_memory_can_fit compares, per rank of `world`: every one a
// lower bound of what the detailed plan holds, in long double (no sum or
// product of sizes can overflow it).
struct PlanFloor {
  long double params = 0, bytes_per_param = 0;  // the model's parameters, and the bytes of state each takes
  long double state = 0;                        // weights, gradients and optimizer state per rank
  long double activations = 0;                  // activations every plan holds
  long double plan = 0;                         // state + activations: at most the arena's total bytes
  int64_t tensors = 0;                          // parameter tensors the model declares
  long double description = 0;                  // host bytes that describing them takes
};
PlanFloor plan_floor(const Config& cfg, const ModelSpec& spec, const PrecisionDTypes& dtypes, int world);

class TrainState {
 public:
  // Plans everything (the sharding plugin's layouts, the model's activations);
  // allocates nothing.
  TrainState(const Config& cfg, Runtime& rt, Model& model);
  // Allocates the arena, binds the model and the plugins to it, zeroes the
  // buffers. Called once, before weights are initialised or loaded.
  void allocate();

  std::vector<UnitState>& units() { return units_; }
  const std::vector<UnitState>& units() const { return units_; }
  const std::vector<UnitInfo>& infos() const { return model_.units(); }
  const std::vector<UnitLayout>& layouts() const { return layouts_; }
  ShardingEnv& env() { return env_; }
  BackendOptimizerOps& ops() { return *ops_; }
  // The step's scalars (StepScalar in loom/ops/backend.hpp): f64[kStepScalars].
  // Two sets, one per step parity: a step's optimizer may still read its set
  // on the optimizer queue while the next step zeroes and fills the other.
  Tensor& scalars() { return scalars_[parity_]; }
  // Moves to the other set and points the optimizer ops at it; returns its index.
  int next_scalars();
  // A ring of `rows` copies of the step scalars, one per step since the last
  // read (train/step_log.hpp): f64[rows * kStepScalars].
  Tensor& scalar_log() { return scalar_log_; }
  int64_t scalar_log_rows() const { return scalar_log_rows_; }
  static constexpr int64_t kMaxStepLogRows = 1024;
  // An f64 accumulator for evaluation losses.
  Tensor& eval_sum() { return eval_sum_; }

  void zero_grads();
  // Hands the buffers to the sharding plugin, once the weights are in place.
  void setup_sharding() { rt_.sharding->setup(env_, units_, scratch_); }

  const ArenaPlan& plan() const { return plan_; }
  size_t arena_bytes() const { return arena_.bytes(); }
  // The ZeRO paper's per-rank bytes for this layout (params, grads, optimizer
  // state incl. master) from the unpadded parameter count, beside the plan.
  struct MemoryFormula { double params = 0, grads = 0, optimizer = 0; };
  MemoryFormula memory_formula() const;
  // What `loom check` prints: model size, plugins, batch, the plan per rank
  // (on CUDA with what the process holds beyond it, and for a planned GPU
  // whether it fits).
  std::string describe() const;
  // The plan's blocks part by part: every block's bytes, the blocks that
  // differ only in a layer's number summed into one row ("qkv.* x 32"),
  // largest first (`loom check --breakdown`).
  std::string plan_breakdown() const;
  // What the process holds on its GPU beyond the arena, estimated
  // (memory_budget.hpp outside_arena_estimate; 0 on the CPU), and the plan
  // with it: what the device memory in use should read during the steps.
  size_t outside_arena_bytes() const;
  size_t planned_device_bytes() const { return plan_.total_bytes() + outside_arena_bytes(); }
  // The plan beside what was allocated and what the process uses.
  std::string memory_report() const;
  // Throws loom::Error, with the plan and what to change, when the plan does
  // not fit the memory available (train/memory_budget.hpp). Before allocate().
  void check_memory_fits() const;

  // Parameters by HF name. read_param needs the whole tensor on this rank.
  const ParamInfo& find_param(const std::string& hf_name, int* unit) const;
  std::vector<float> read_param(const std::string& hf_name, bool grad = false) const;
  // Writes fp32 values into the param (and master) copies this rank holds.
  void write_param(const std::string& hf_name, const float* src);
  // Any backend tensor copied to host fp32 (fp32 or bf16 storage).
  std::vector<float> read_tensor(const Tensor& t) const;

 private:
  const Config& cfg_;
  Runtime& rt_;
  Model& model_;
  std::unique_ptr<BackendOptimizerOps> ops_;
  std::unique_ptr<Communicator> expert_group_;  // sharding.expert_parallel > 1: this rank's group
  ShardingEnv env_;
  std::unique_ptr<GatherCodec> codec_;  // env_.codec: the recipe's FP8 weight gathers, or the stand-in without any
  size_t codec_blk_ = 0, codec_bytes_ = 0;  // its state, planned only when a strategy gathers through it
  std::vector<UnitLayout> layouts_;
  std::vector<UnitState> units_;
  struct UnitBlocks { size_t params, grads, grad_shard, master, m, v; bool has_master; };
  std::vector<UnitBlocks> unit_blocks_;
  std::vector<ShardingBuffer> scratch_req_;
  std::vector<size_t> scratch_blocks_;
  std::vector<Tensor> scratch_;
  std::vector<Tensor> own_grads_;  // the per-unit grads the core allocated (zeroed each step)
  size_t precision_ws_ = 0, precision_ws_bytes_ = 0;
  size_t precision_saved_ = 0, precision_saved_bytes_ = 0;  // the recipe's saved activations (e.g. FP8 copies of x)
  size_t scalars_blk_ = 0, scalar_log_blk_ = 0, eval_sum_blk_ = 0;
  int64_t scalar_log_rows_ = 0;
  Tensor scalars_[2], scalar_log_, eval_sum_;
  int parity_ = 0;
  ArenaPlan plan_;
  Arena arena_;
};

// fp32 host values into / out of a backend tensor of any storage dtype (bf16 rounds to nearest even).
void upload_f32(Backend& be, Tensor& dst, const float* src);
std::vector<float> download_f32(Backend& be, const Tensor& src);

}  // namespace loom
