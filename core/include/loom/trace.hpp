// Hooks for the step tracer (train/profiler.hpp). Every op and block range
// (loom/block.hpp Range), every collective (comm/) and the host phases of the
// step call these; while no profiling window is open the sink is null and a
// hook costs one relaxed atomic load and a branch, with no host
// synchronisation. C++17-clean: CUDA translation units may include it.
#pragma once
#include <atomic>

namespace loom::trace {

// The tracks of a rank's trace: the compute stream, the communicator's stream
// (host thread for MPI), the host's phases of the step, and the optimizer's
// queue (CUDA: the second stream beside compute, where AdamW overlaps the
// next step's forward; on the CPU it is the compute queue and its ops land
// on the compute track).
enum class Track : int { compute = 0, comm = 1, host = 2, optimizer = 3 };
inline constexpr int kTracks = 4;

class Sink {
 public:
  virtual ~Sink() = default;
  // `stream`: the CUDA stream the range's work is queued on, or null for host
  // work (the CPU backend, MPI, host phases), which is timed by the host clock.
  // `name` must outlive the window (string literals do).
  virtual void begin(Track track, const char* name, void* stream) = 0;
  virtual void end(Track track, void* stream) = 0;
};

extern std::atomic<Sink*> g_sink;
inline Sink* sink() { return g_sink.load(std::memory_order_relaxed); }

// A range for one scope; inert unless a window was open when it began.
class Scope {
 public:
  Scope(Track track, const char* name, void* stream = nullptr) : track_(track), stream_(stream), sink_(sink()) {
    if (sink_) sink_->begin(track_, name, stream_);
  }
  ~Scope() {
    if (sink_) sink_->end(track_, stream_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Track track_;
  void* stream_;
  Sink* sink_;
};

}  // namespace loom::trace
