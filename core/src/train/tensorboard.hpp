// TensorBoard event files without TensorFlow: a TFRecord file of Event
// protocol buffers, written by hand (the format is small and stable):
//   record = uint64 length | uint32 masked CRC-32C of length | payload | uint32 masked CRC-32C of payload
//   mask(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5;
//             SessionLog session_log = 7; }
//   Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
//   SessionLog { SessionStatus status = 1; }   (START = 1)
// The first record holds file_version "brain.Event:2", as TensorBoard expects.
// The second is a SessionLog START at the step the run continues from: with
// file version 2 TensorBoard drops, on reading it, every point of the earlier
// event files in the directory at or after that step, so a run resumed from
// an older checkpoint (or restarted with resume = "none") shows one curve, not
// the abandoned steps beside the repeated ones.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "train/progress.hpp"

namespace loom {

uint32_t crc32c(const void* data, std::size_t n);

class TensorBoardWriter {
 public:
  // Creates `dir` and a new event file in it
  // (events.out.tfevents.<unix seconds>.<host>.<pid>.loom, with ".<n>" added
  // when that name exists: a file is never overwritten). `resume_step`: the
  // last step already done (0 for a fresh run); the START marker goes at the
  // step after it (at 0 for a fresh run).
  explicit TensorBoardWriter(const std::string& dir, int64_t resume_step = 0);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One Event with these scalars at `step` (wall time: now).
  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  // The scalars of a step's log line: train/loss, train/lr, train/grad_norm,
  // perf/tokens_per_s, perf/samples_per_s, perf/step_ms, perf/memory_gib,
  // perf/mfu (GPU), val/loss (when evaluated), extra/<name> for each extra.
  void step(const StepLog& s);
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& payload);
  std::string path_;
  std::FILE* f_ = nullptr;
};

}  // namespace loom
