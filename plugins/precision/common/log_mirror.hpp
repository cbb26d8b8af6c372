// Pinned host copies of a recipe's device state for its log line, queued on
// the compute stream once per optimizer step (end_step) and read by
// log_summary() without waiting for the device: the newest copy whose event
// has completed (cudaEventQuery, which never blocks). When the core reads a
// step's log row, that step's end_step copy is complete (it was queued on
// the compute stream before the row was closed), so the line shows that step's
// state or a newer one; a copy still running is skipped, never read half-written.
// A ring of kSlots copies: the host is at most a step or two ahead of the device.
// Built only with CUDA.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string_view>
#include <vector>

#include "loom/error.hpp"
#include "loom/ops/cuda_check.hpp"

namespace loom::precision_common {

class LogMirror {
 public:
  static constexpr int kSlots = 4;

  LogMirror() = default;
  LogMirror(const LogMirror&) = delete;
  LogMirror& operator=(const LogMirror&) = delete;
  ~LogMirror() {
    for (Slot& s : slots_) {
      if (s.done) cudaEventDestroy(s.done);
      if (s.host) cudaFreeHost(s.host);
    }
  }

  // Once, with the device at hand (never in planning): the byte sizes of the
  // device ranges each copy takes, in order. `who` names the recipe (its plugin) in messages.
  void allocate(std::vector<size_t> ranges, std::string_view who) {
    if (allocated_) return;
    ranges_ = std::move(ranges);
    bytes_ = 0;
    for (size_t r : ranges_) bytes_ += (r + 15) / 16 * 16;
    for (Slot& s : slots_) {
      LOOM_CUDA_CHECK(cudaMallocHost(&s.host, bytes_ > 0 ? bytes_ : 16), "precision ", who, ": pinned log copy of ", bytes_, " bytes");
      LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming), "precision ", who, ": log copy event");
    }
    allocated_ = true;
  }
  bool allocated() const { return allocated_; }

  // Queues copies of the ranges at `srcs` (device pointers, as allocate() said)
  // into the next slot, after the work queued on `stream` so far. Called in
  // the step: it allocates nothing (the sources come as an initializer list,
  // the name as a view; messages are built only when a check fails).
  void queue(cudaStream_t stream, std::initializer_list<const void*> srcs, int64_t step, std::string_view who) {
    if (!allocated_) return;
    LOOM_CHECK(srcs.size() == ranges_.size(), "precision ", who, ": log copy of ", srcs.size(), " ranges, ", ranges_.size(),
               " allocated");
    Slot& s = slots_[static_cast<size_t>(next_ % kSlots)];
    char* dst = static_cast<char*>(s.host);
    size_t i = 0;
    for (const void* src : srcs) {
      LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, ranges_[i], cudaMemcpyDeviceToHost, stream), "precision ", who,
                      ": queueing the log copy of ", ranges_[i], " bytes");
      dst += (ranges_[i] + 15) / 16 * 16;
      ++i;
    }
    LOOM_CUDA_CHECK(cudaEventRecord(s.done, stream), "precision ", who, ": recording the log copy");
    s.step = step;
    s.queued = true;
    ++next_;
  }

  // The newest completed copy (range i at range(i)), or null when none has
  // completed yet; *step is the step it was queued at. Never waits.
  const char* newest(int64_t* step) const {
    const Slot* best = nullptr;
    for (const Slot& s : slots_) {
      if (!s.queued || (best != nullptr && s.step <= best->step)) continue;
      const cudaError_t e = cudaEventQuery(s.done);
      if (e == cudaSuccess) best = &s;
      else if (e != cudaErrorNotReady)
        throw Error(cat("log copy: cudaEventQuery failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
    }
    if (best == nullptr) return nullptr;
    if (step != nullptr) *step = best->step;
    return static_cast<const char*>(best->host);
  }
  // Offset of range i within a slot.
  size_t offset(size_t i) const {
    size_t o = 0;
    for (size_t j = 0; j < i; ++j) o += (ranges_[j] + 15) / 16 * 16;
    return o;
  }

 private:
  struct Slot {
    void* host = nullptr;
    cudaEvent_t done = nullptr;
    int64_t step = -1;
    bool queued = false;
  };
  std::array<Slot, kSlots> slots_{};
  std::vector<size_t> ranges_;
  size_t bytes_ = 0;
  int64_t next_ = 0;
  bool allocated_ = false;
};

}  // namespace loom::precision_common
