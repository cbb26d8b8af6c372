// A training session: everything one run needs, built in the order DESIGN.md
// asks for — plugins loaded and configs validated, data opened and the memory
// plan made before any memory is touched — then the step loop.
//
// Used by `loom train` and `loom check`, and directly by the tests (goldens,
// end-to-end), which drive forward/backward on batches of their own.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "config/run_config.hpp"
#include "loom/arena.hpp"
#include "loom/attention.hpp"
#include "loom/comm.hpp"
#include "loom/data.hpp"
#include "loom/precision.hpp"
#include "loom/registry.hpp"
#include "loom/sharding.hpp"
#include "model/backend.hpp"
#include "model/llama.hpp"
#include "train/optimizer.hpp"

namespace loom {

struct StepLog {
  int64_t step = 0;  // 1-based: the number of optimizer steps done after this one
  double loss = 0, lr = 0, grad_norm = 0, step_ms = 0, tokens_per_s = 0, samples_per_s = 0;
  bool skipped = false;
  double mfu = 0;              // GPU only: model flops utilisation against 989 TFLOP/s
  size_t peak_mem_bytes = 0;   // GPU only: device memory in use (cudaMemGetInfo)
  bool has_val = false;
  double val_loss = 0;
};

struct RunSummary {
  std::vector<StepLog> steps;                          // the steps this process ran
  std::vector<std::pair<int64_t, double>> val_losses;  // (step, loss), including the evaluation before step 1
  int64_t first_step = 0;                              // 0, or the resumed step
  int64_t last_step = 0;
  double wall_s = 0;
};

struct SessionOptions {
  // Train alone even when started by a launcher (the single-process reference
  // that tests compare the strategies with).
  bool single_process = false;
};

class Session {
 public:
  // Loads plugins, validates every table, opens the data and plans memory. No allocation yet.
  explicit Session(Config cfg, SessionOptions opts = {});
  ~Session();

  const Config& config() const { return cfg_; }
  const ModelSpec& spec() const { return spec_; }
  // Human-readable model size and memory plan (what `loom check` prints).
  std::string describe() const;
  // The plan per rank beside what was allocated (arena) and what the process uses (device memory or RSS).
  std::string memory_report() const;

  // Allocates the arena and initialises weights (random, HF, or from a checkpoint when resuming).
  void initialise();

  // The step loop: trains until train.steps, logging, evaluating and checkpointing.
  // stop_at > 0 stops after that step instead (e.g. a job's time slice), writing
  // a checkpoint there when checkpoint.every > 0 so the next job resumes exactly.
  RunSummary train(int64_t stop_at = -1);

  // One optimizer step (grad_accum micro-batches), timed on the backend.
  StepLog train_step();
  size_t arena_bytes() const { return arena_.bytes(); }
  const ArenaPlan& memory_plan() const { return plan_; }
  // The ZeRO paper's per-rank bytes for this strategy (params, grads, optimizer
  // state incl. master) from the unpadded parameter count, beside the plan.
  struct MemoryFormula { double params = 0, grads = 0, optimizer = 0; };
  MemoryFormula memory_formula() const;
  int rank() const { return comm_->rank(); }
  int world() const { return comm_->size(); }
  Communicator& comm() { return *comm_; }       // the data communicator (MPI on CPU, NCCL on CUDA)
  Communicator& host_comm() { return *host_; }  // host scalars and barriers

  // Building blocks, public for tests.
  void load_batch(const int32_t* inputs, const int32_t* targets);  // host [B*S] each
  double forward(bool training, float dloss_scale);                 // mean token loss of the batch
  // One unit at a time, with the sharding hooks around it (what forward()/backward() loop over).
  void forward_unit(int unit, bool training, float dloss_scale);
  void backward_unit(int unit);
  double batch_loss();  // mean token loss of the last forward
  void backward();
  void zero_grads();
  StepResult optimizer_step(int64_t step_index);  // step_index 0-based; lr from the schedule
  double evaluate();                              // mean validation loss over validation_batches
  void save_checkpoint(int64_t step);
  int64_t step() const { return step_; }
  std::vector<UnitState>& units() { return units_; }
  LlamaModel& model() { return *model_; }
  Backend& backend() { return *backend_; }
  Tensor logits() const;  // [B*S, V] after a forward with training = false
  // Any backend tensor copied to host fp32 (fp32 or bf16 storage).
  std::vector<float> read_tensor(const Tensor& t) const;
  // A parameter (or its gradient) by HF name, copied to host fp32.
  std::vector<float> read_param(const std::string& hf_name, bool grad = false) const;
  void write_param(const std::string& hf_name, const float* src);

 private:
  void create_plugins();
  void plan_memory();
  void init_random();
  void init_from_hf(const std::string& dir);
  bool try_resume();
  void load_checkpoint_tensors(const std::string& dir, const std::string& meta_text);
  double mean_over_ranks(double v);
  // LOOM_FAULT_STALL="RANK:STEP": that rank stops responding before STEP (to test collective timeouts);
  // "RANK:STEP:kill": it dies (SIGKILL) there instead.
  void fault_point();
  void next_batch(Split split);
  const ParamInfo& find_param(const std::string& hf_name, int* unit) const;

  Config cfg_;
  ModelSpec spec_;
  std::unique_ptr<PluginRegistry> registry_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<Communicator> host_owned_;  // the MPI communicator beside NCCL
  Communicator* host_ = nullptr;
  int local_rank_ = 0, local_world_ = 1;
  std::string launcher_;
  std::unique_ptr<Precision> precision_;
  std::unique_ptr<Attention> attention_;
  std::unique_ptr<Sharding> sharding_;
  std::unique_ptr<DataSource> data_;
  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<BackendOptimizerOps> ops_;
  ShardingEnv env_;
  std::vector<UnitInfo> unit_infos_;
  std::vector<UnitLayout> layouts_;
  std::vector<UnitState> units_;
  ArenaPlan plan_;
  size_t precision_ws_ = 0, precision_ws_bytes_ = 0;
  struct UnitBlocks { size_t params, grads, grad_shard, master, m, v; bool has_master; };
  std::vector<UnitBlocks> unit_blocks_;
  std::vector<ShardingBuffer> scratch_req_;
  std::vector<size_t> scratch_blocks_;
  std::vector<Tensor> scratch_;
  std::vector<Tensor> own_grads_;  // the per-unit grads the core allocated (zeroed each step)
  Arena arena_;
  PrecisionDTypes dtypes_{};
  std::vector<int32_t> host_tokens_, host_inputs_, host_targets_;
  int64_t step_ = 0;  // optimizer steps done
  bool last_micro_ = true;  // the current micro-batch is the step's last (sharding may communicate)
  bool initialised_ = false;
};

}  // namespace loom
