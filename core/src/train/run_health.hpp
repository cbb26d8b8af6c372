// What the step loop checks at each log step, where the step scalars reach
// the host anyway (docs/RELIABILITY.md "Non-finite values"):
//
//  - skipped steps: a step whose gradient norm is not finite changes nothing.
//    train.max_skipped_steps consecutive ones stop the run with an error (a
//    run that only skips would otherwise "succeed" without learning), and so
//    does a run whose every step was skipped. Ranks agree: the norm is global.
//  - optimizer-state overflow: AdamW's second moment is a running mean of g^2
//    in fp32 (or bf16); once an update applies an element |g| above
//    sqrt(FLT_MAX) ~ 1.8e19 it becomes +inf for good and that weight stops
//    moving. The applied gradient's L2 norm bounds every element, and the log
//    read already has it, so the state is scanned only after a step applied a
//    gradient of norm above kOverflowRiskNorm — never on an ordinary step, so
//    the check costs nothing there and adds no host synchronisation. A scan
//    that finds non-finite state stops the run, naming the tensors.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "config/run_config.hpp"
#include "train/progress.hpp"
#include "train/runtime.hpp"
#include "train/train_state.hpp"

namespace loom {

// Below this applied-gradient norm no element's g^2 can overflow fp32/bf16
// (sqrt(FLT_MAX) ~ 1.84e19, with margin for the fp32 rounding of the update).
inline constexpr double kOverflowRiskNorm = 1e19;

class RunHealth {
 public:
  explicit RunHealth(const TrainSection& t) : t_(t) {}
  // The steps of one log read, in order. Throws loom::Error when
  // max_skipped_steps consecutive steps were skipped.
  void observe(const std::vector<StepLog>& logs);
  // After the loop: throws when every step this process ran was skipped.
  void finish() const;
  // The largest gradient norm an update applied among `logs` (after clipping; 0 for skipped steps).
  double max_applied_norm(const std::vector<StepLog>& logs) const;
  int64_t skipped_total() const { return skipped_total_; }

 private:
  TrainSection t_;
  int64_t run_ = 0, run_first_ = 0;  // the current run of consecutive skipped steps
  int64_t steps_ = 0, skipped_total_ = 0;
};

// Scans this rank's weights, master copy and AdamW moments (host copies, one
// unit at a time) and, summed over ranks, throws loom::Error naming the
// tensors when any value is not finite. `step` and `applied_norm` go into
// the message. Synchronises (it is meant for the rare step that needs it).
void check_optimizer_state(TrainState& state, Runtime& rt, int64_t step, double applied_norm, double grad_clip);

}  // namespace loom
