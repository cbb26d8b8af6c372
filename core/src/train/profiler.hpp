// The [profile] window (config/run_config.hpp ProfileSection): for nsys,
// cudaProfilerStart before the window's first step and cudaProfilerStop after
// its last, so `nsys profile --capture-range=cudaProfilerApi` records only
// those steps; with trace = true, a Chrome/Perfetto trace per rank
// (<out_dir>/trace/rank_<R>.json) of the window:
//   * the compute stream: every op and block range (loom/block.hpp Range)
//     and the step, timed by CUDA events from a ring created at start-up
//     (by the host clock on CPU, where ops run synchronously);
//   * the comm stream: every collective (NCCL: events on its stream; MPI: the
//     host clock around the call);
//   * the host: the phases of each step (data, forward, backward, optimizer);
//   * counters: memory in use (device memory on CUDA, resident set on CPU) and the arena.
// While the window is open the profiler is the trace sink (loom/trace.hpp);
// outside it the sink is null, so the ordinary step records nothing and never
// waits. Opening the window waits for the device once (aligning the host and
// device clocks); closing it waits once to read the events.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "config/run_config.hpp"
#include "loom/ops/backend.hpp"
#include "loom/trace.hpp"

namespace loom {

class Profiler final : public trace::Sink {
 public:
  Profiler(const ProfileSection& cfg, Backend& backend, int rank, int world, std::string out_dir, size_t arena_bytes);
  ~Profiler() override;
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  // Around each step of the loop; `step` is the 1-based number of the step.
  void before_step(int64_t step);
  void after_step(int64_t step);
  // The loop ended (stop_at, or no more steps) with the window open: close it.
  void finish();
  bool window_open() const { return open_; }
  // The trace file of this rank (written when the window closes with trace = true).
  std::string trace_path() const;

  void begin(trace::Track track, const char* name, void* stream) override;
  void end(trace::Track track, void* stream) override;

 private:
  struct Mark {
    int64_t host_ns = -1;  // host clock, ns since the window opened
    int event = -1;        // index into the CUDA event ring, or -1
  };
  struct Rec {
    const char* name;
    trace::Track track;
    int64_t step;
    Mark b, e;
    int depth;
  };
  struct Counter {
    int64_t host_ns;
    double in_use_gib, arena_gib;
  };
  Mark mark(void* stream);
  void open_window(int64_t step);
  void close_window();
  void sample_memory();
  void write_trace();
  int64_t now_ns() const;

  ProfileSection cfg_;
  Backend& be_;
  int rank_, world_;
  std::string out_dir_;
  size_t arena_bytes_;
  bool open_ = false, done_ = false;
  int64_t step_ = 0;
  std::chrono::steady_clock::time_point t0_;
  std::vector<Rec> recs_;
  std::vector<size_t> stack_[trace::kTracks];  // open records per track
  std::vector<Counter> counters_;
  size_t host_step_rec_ = 0;
  // CUDA: the event ring and the window's reference event (opaque here so
  // that this header stays free of CUDA).
  struct Events;
  std::unique_ptr<Events> ev_;
  bool dropped_ = false;
};

}  // namespace loom
