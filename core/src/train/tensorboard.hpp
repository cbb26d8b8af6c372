// TensorBoard event files without TensorFlow: a TFRecord file of Event
// protocol buffers, written by hand (the format is small and stable):
//   record = uint64 length | uint32 masked CRC-32C of length | payload | uint32 masked CRC-32C of payload
//   mask(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
// The first record holds file_version "brain.Event:2", as TensorBoard expects.
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
  // (events.out.tfevents.<unix seconds>.<host>.<pid>.loom).
  explicit TensorBoardWriter(const std::string& dir);
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
