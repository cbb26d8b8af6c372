// The step log on the device: each step's scalars (loss sum, gradient norm,
// clip decision, timestamps; StepScalar in model/backend.hpp) are copied into
// a ring of rows indexed by step number when the step closes, and a log step
// reads every row queued since the last read in one download. The step never
// makes the host wait: nothing here synchronises but read().
//
// Two scalar sets alternate (TrainState::next_scalars): the previous step's
// optimizer may still be reading its set on the optimizer queue while the
// next step fills the other, so open() waits (on the device) only for the set
// of two steps ago.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "config/run_config.hpp"
#include "model/model.hpp"
#include "train/progress.hpp"
#include "train/runtime.hpp"
#include "train/train_state.hpp"

namespace loom {

// Model flops utilisation (docs/ARCHITECTURE.md "MFU"): flops per token times
// tokens/s per GPU over the one peak of loom/precision.hpp (kMfuPeakFlops,
// dense bf16), whatever the recipe. The step log and `loom bench` both use this.
inline double mfu(double flops_per_token, double tokens_per_s_per_gpu) {
  return flops_per_token * tokens_per_s_per_gpu / kMfuPeakFlops;
}

class StepLogRing {
 public:
  // caught_up: called after each download (the device has caught up with the host: TokenStager).
  StepLogRing(const Config& cfg, Runtime& rt, TrainState& state, const Model& model, std::function<void()> caught_up);

  // Before a step: a full ring is read early, its rows kept on the host for
  // the next read (a driver that queues more steps than the ring holds; the
  // train loop never does).
  void make_room();
  // Opens step `step` (1-based) on the compute queue: the step's scalar
  // set is zeroed once its last reader is done, and its start time goes into
  // the set and straight into its row (so that a read leaving this step for
  // later still has the end of the step before it). Returns the set.
  Tensor& open(int64_t step);
  // Closes it where its last work runs (the optimizer queue, after the
  // compute queue's): its end time, and a copy of its scalars into its row.
  void close(int64_t step);

  // The steps queued since the last read, read back from the device (one
  // host synchronisation): loss (averaged over ranks), extra loss, grad
  // norm, skipped, time. keep_newest: every one but the newest, which stays
  // for the next read; the device need not finish the newest step's
  // optimizer (on its own queue, overlapping the next forward) first.
  std::vector<StepLog> read(int64_t last_step, bool keep_newest);

 private:
  std::vector<StepLog> read_rows(int64_t last_step, bool keep_newest);
  // The ring's row of a step (1-based): rows go round by step number.
  int64_t row(int64_t step) const { return (step - 1) % state_.scalar_log_rows(); }

  const Config& cfg_;
  Runtime& rt_;
  TrainState& state_;
  const Model& model_;
  std::function<void()> caught_up_;
  int64_t pending_ = 0;          // steps queued since the last read
  int64_t last_opened_ = 0;      // the newest step opened
  std::vector<StepLog> unread_;  // read early because the ring was full, not yet handed out
  static constexpr uint64_t kNoMarker = ~uint64_t{0};
  uint64_t closed_[2] = {kNoMarker, kNoMarker};  // per scalar set: the marker after its step's last use
  uint64_t closed_prev_ = kNoMarker;             // the previous step's closing marker (its row written)
  int parity_ = 0;                               // the open step's scalar set
};

}  // namespace loom
