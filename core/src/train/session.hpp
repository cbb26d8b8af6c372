// A training session: one run, put together from parts with one job each —
//
//   runtime.hpp        launch, backend, communicators, the four plugins
//   model/model.hpp    the model as blocks (the variants of model.layers and model.ffn)
//   train_state.hpp    the memory plan and arena: parameters, gradients,
//                      optimizer state, activations, the step's device scalars
//   weights.hpp        random or HF initial weights
//   checkpointing.hpp  save and resume (by parameter name)
//   token_stager.hpp   tokens to the device without waiting
//   session_log_ring.hpp  the step log on the device, read at log steps
//   progress.hpp       log lines, metrics.jsonl, the progress bar
//
// — and the step loop, which reads top to bottom in train_step(). The step
// never makes the host wait for the device: the loss, the gradient norm, the
// clipping decision and the step's timing stay on the device until a log step
// reads them all at once (read_step_logs).
//
// Used by `loom train`, `check`, `compare` and `bench`. The tests and `loom
// bench`, which drive forward and backward on batches of their own and look
// at the state, do so through SessionProbe (session_probe.hpp).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/run_config.hpp"
#include "model/model.hpp"
#include "train/outputs.hpp"
#include "train/profiler.hpp"
#include "train/progress.hpp"
#include "train/runtime.hpp"
#include "train/session_log_ring.hpp"
#include "train/token_stager.hpp"
#include "train/train_state.hpp"

namespace loom {

struct RunSummary {
  std::vector<StepLog> steps;                          // the steps this process ran
  std::vector<std::pair<int64_t, double>> val_losses;  // (step, loss), including the evaluation before step 1
  int64_t first_step = 0;                              // 0, or the resumed step
  int64_t last_step = 0;
  double wall_s = 0;
  // The signal that stopped the run early (SIGTERM, ...; 0: it ran to its end).
  // The checkpoint of last_step was written (unless no step ran).
  int stop_signal = 0;
};

struct SessionOptions {
  // Train alone even when started by a launcher (the single-process reference
  // that tests compare the strategies with).
  bool single_process = false;
  // loom check --world N [--gpus-per-node G]: plan the run as rank 0 of N
  // ranks (G per node) without starting them; nothing may be exchanged.
  int plan_world = 0, plan_local_world = 0;
  // loom check --gpu / --device-memory: the GPU a CUDA run is planned for,
  // without one (train/plan_device.hpp). Plan only: initialise() refuses.
  std::optional<PlannedDevice> plan_device;
};

// The architecture a run of `cfg` builds: its [model] table, or with
// model.init = "hf:DIR" the folder's config.json (read and checked; no weights).
ModelSpec run_model_spec(const Config& cfg);

class SessionProbe;

class Session {
 public:
  // Loads plugins, validates every table, opens the data and plans memory. No allocation yet.
  explicit Session(Config cfg, SessionOptions opts = {});
  ~Session();

  const Config& config() const { return cfg_; }
  const ModelSpec& spec() const { return model_->spec(); }
  std::string describe() const { return state_->describe(); }
  std::string memory_report() const { return state_->memory_report(); }
  // The plan part by part (`loom check --breakdown`; TrainState::plan_breakdown).
  std::string plan_breakdown() const { return state_->plan_breakdown(); }
  // Throws loom::Error with the plan and what to change when it does not fit
  // the memory available (initialise() calls it before allocating).
  void check_memory_fits() const { state_->check_memory_fits(); }
  // Every token the data plugin could give the run, read and checked against
  // the vocabulary (loom/data.hpp TokenScan; `loom check`): throws loom::Error
  // naming the file and the first bad token. Empty when the plugin cannot
  // scan ahead (it checks its tokens only as they are read).
  std::optional<TokenScanReport> scan_data_tokens() const;
  // The checkpoint checkpoint.resume names (nullopt: a fresh start), checked
  // as initialise() checks it before reading tensor data, its data position
  // given to this run's data plugin as resuming gives it (`loom check`; see
  // train/checkpointing.hpp check_resume_checkpoint). Before initialise().
  std::optional<std::string> check_resume_checkpoint();

  // Allocates the arena and initialises weights (random, HF, or from a checkpoint when resuming).
  void initialise();

  // The step loop: trains until train.steps, logging, evaluating and checkpointing.
  // stop_at > 0 stops after that step instead (e.g. a job's time slice), writing
  // a checkpoint there when checkpoint.every > 0 so the next job resumes exactly.
  // Before step 1 it locks and checks the output folders (train/outputs.hpp);
  // a stop signal (train/stop_signal.hpp) ends it after the current step with
  // a checkpoint and RunSummary::stop_signal set; too many skipped steps or an
  // overflowed optimizer state end it with loom::Error (train/run_health.hpp).
  RunSummary train(int64_t stop_at = -1);

  // One optimizer step (grad_accum micro-batches), queued on the device; the
  // host does not wait for it.
  void train_step();
  // The steps queued since the last call, read back from the device (one host
  // synchronisation): loss (averaged over ranks), grad norm, skipped, time.
  // A driver that queues more steps than the ring holds (TrainState::
  // scalar_log_rows; the train loop never does) makes train_step read early.
  std::vector<StepLog> read_step_logs() { return ring_->read(step_, false); }
  // The same for every queued step but the newest, which stays for the next
  // read: the device need not finish the newest step's optimizer (AdamW on
  // its own queue, overlapping the next forward) before the host reads, so a
  // log step costs the compute queue no idle time. One host synchronisation
  // when there is a finished step to read, none otherwise.
  std::vector<StepLog> read_step_logs_but_newest() { return ring_->read(step_, true); }
  double evaluate();  // mean validation loss over validation_batches (synchronises once)
  void save_checkpoint(int64_t step);
  int64_t step() const { return step_; }

  size_t arena_bytes() const { return state_->arena_bytes(); }
  // The plan with what the process holds beyond the arena (TrainState::planned_device_bytes).
  size_t planned_device_bytes() const { return state_->planned_device_bytes(); }
  // The device memory in use on a GPU; the arena on the CPU.
  size_t memory_in_use() const;
  std::string device_name() const { return rt_.backend->device_name(); }
  int rank() const { return rt_.rank(); }
  int world() const { return rt_.world(); }
  Communicator& comm() { return *rt_.comm; }       // the data communicator (MPI on CPU, NCCL on CUDA)
  Communicator& host_comm() { return *rt_.host; }  // host scalars and barriers

 private:
  friend class SessionProbe;  // the tests' and `loom bench`'s view inside (session_probe.hpp)

  // Host [B*S] each; with the [train] document switches also the document
  // starts, [B * (S + 1)] as loom::DocumentStarts writes them (SessionProbe::load_batch).
  void load_batch(const int32_t* inputs, const int32_t* targets, const uint8_t* starts = nullptr);
  // Stages the next micro-batch and tells the model what the host learnt of it.
  StagedBatch next_batch(Split split);
  void use_batch(const StagedBatch& b);
  // Every unit forward, with the sharding hooks around each. Training keeps
  // what backward needs; its loss comes in the head's backward.
  void forward(bool training, float dloss_scale);
  void forward_unit(int unit, bool training, float dloss_scale);
  void backward();
  void backward_unit(int unit);
  // Reduce, clip, update: the sharding strategy's step (the gradients'
  // collectives, the global norm and clipping decision, AdamW) and the recipe's end of step.
  void queue_optimizer_step(int64_t step_index);
  std::vector<UnitState>& units() { return state_->units(); }
  double mean_over_ranks(double v) { return all_reduce_scalar(*rt_.host, v, ReduceOp::avg); }
  // The stop signal any rank received (0: none); the same on every rank.
  int agreed_stop_signal();
  // Before step 1: out_dir locked and prepared (rank 0), checkpoint.dir writable from every rank.
  void claim_outputs();

  Config cfg_;
  Runtime rt_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<TrainState> state_;
  std::unique_ptr<TokenStager> stager_;
  std::unique_ptr<StepLogRing> ring_;
  std::unique_ptr<Profiler> profiler_;  // the [profile] window
  int64_t step_ = 0;        // optimizer steps done (queued)
  bool log_due_ = false;    // an ordinary log step waits to be read after the next step is queued
  bool last_micro_ = true;  // the current micro-batch is the step's last (sharding may communicate)
  int64_t loss_tokens_ = 0;  // targets that carry loss in the micro-batch staged last
  bool initialised_ = false;
  bool resumed_ = false;    // initialise() loaded a checkpoint
  std::shared_ptr<OutputLock> output_lock_;
  bool outputs_claimed_ = false;  // claim_outputs() ran (once per session)
  // run.overwrite = true on a fresh start: the previous run, removed just
  // before the first checkpoint (or at the end), put back if this run fails
  // first (outputs.hpp). Declared after the lock: it is restored while the
  // folder is still locked. On every rank (the same on all): whether the
  // first save waits for rank 0 to remove it.
  std::unique_ptr<ReplacedRun> replaced_run_;
  bool replace_before_save_ = false;
};

}  // namespace loom
