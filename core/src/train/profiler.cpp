#include "train/profiler.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "checkpoint/file_util.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"

#ifdef LOOM_HAVE_CUDA
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>
#endif

namespace fs = std::filesystem;

namespace loom {
namespace {
// Events in the ring: two per range. A llama-1b step has about 30 ranges a
// layer; 64K events cover a few steps of a 32-layer model. When they run out
// the rest of the window is not traced (with a warning), rather than allocating mid-step.
constexpr int kEvents = 1 << 16;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

#ifdef LOOM_HAVE_CUDA
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw Error(cat("profiler: ", what, " failed: ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}
#endif

double resident_gib() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  long pages = 0, resident = 0;
  const int n = std::fscanf(f, "%ld %ld", &pages, &resident);
  std::fclose(f);
  return n == 2 ? static_cast<double>(resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) / kGiB : 0;
}
}  // namespace

struct Profiler::Events {
#ifdef LOOM_HAVE_CUDA
  std::vector<cudaEvent_t> ring;
  cudaEvent_t ref = nullptr;
  ~Events() {
    for (cudaEvent_t e : ring) cudaEventDestroy(e);
    if (ref) cudaEventDestroy(ref);
  }
#endif
  int next = 0;
};

Profiler::Profiler(const ProfileSection& cfg, Backend& backend, int rank, int world, std::string out_dir,
                   size_t arena_bytes)
    : cfg_(cfg), be_(backend), rank_(rank), world_(world), out_dir_(std::move(out_dir)), arena_bytes_(arena_bytes) {
  if (!cfg_.enabled()) return;
  if (cfg_.trace) {
    recs_.reserve(4096);
    counters_.reserve(static_cast<size_t>(cfg_.stop - cfg_.start + 2));
#ifdef LOOM_HAVE_CUDA
    if (be_.device() == Device::cuda) {
      // Created now, at start-up: recording an event in the step allocates nothing.
      ev_ = std::make_unique<Events>();
      ev_->ring.resize(kEvents);
      for (auto& e : ev_->ring) check(cudaEventCreate(&e), "cudaEventCreate (trace ring)");
      check(cudaEventCreate(&ev_->ref), "cudaEventCreate (trace reference)");
    }
#endif
  }
  log_info(cat("profile: steps ", cfg_.start, "..", cfg_.stop,
               be_.device() == Device::cuda ? " between cudaProfilerStart/Stop (nsys --capture-range=cudaProfilerApi)" : "",
               cfg_.trace ? cat("; trace to ", trace_path()) : std::string()));
}

Profiler::~Profiler() {
  Sink* self = this;
  trace::g_sink.compare_exchange_strong(self, nullptr);
}

std::string Profiler::trace_path() const { return (fs::path(out_dir_) / "trace" / cat("rank_", rank_, ".json")).string(); }

int64_t Profiler::now_ns() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_).count();
}

Profiler::Mark Profiler::mark(void* stream) {
  Mark m;
  m.host_ns = now_ns();
#ifdef LOOM_HAVE_CUDA
  if (ev_ && stream) {
    if (ev_->next >= kEvents) {
      if (!dropped_) log_warn(cat("profile: the trace's ", kEvents, " CUDA events are used up; the rest of the window is not traced"));
      dropped_ = true;
      return m;
    }
    m.event = ev_->next++;
    check(cudaEventRecord(ev_->ring[static_cast<size_t>(m.event)], static_cast<cudaStream_t>(stream)), "cudaEventRecord");
  }
#else
  (void)stream;
#endif
  return m;
}

void Profiler::begin(trace::Track track, const char* name, void* stream) {
  auto& st = stack_[static_cast<int>(track)];
  recs_.push_back({name, track, step_, mark(stream), Mark{}, static_cast<int>(st.size())});
  st.push_back(recs_.size() - 1);
}

void Profiler::end(trace::Track track, void* stream) {
  auto& st = stack_[static_cast<int>(track)];
  if (st.empty()) return;  // a range that began before the window opened
  recs_[st.back()].e = mark(stream);
  st.pop_back();
}

void Profiler::sample_memory() {
  const double in_use = be_.device() == Device::cuda ? static_cast<double>(be_.device_memory_used()) / kGiB : resident_gib();
  counters_.push_back({now_ns(), in_use, static_cast<double>(arena_bytes_) / kGiB});
}

void Profiler::open_window(int64_t step) {
  open_ = true;
  if (cfg_.trace) {
    be_.synchronize();  // the device is idle: its reference event and the host clock start together
    t0_ = std::chrono::steady_clock::now();
#ifdef LOOM_HAVE_CUDA
    if (ev_) check(cudaEventRecord(ev_->ref, static_cast<cudaStream_t>(be_.ctx().stream)), "cudaEventRecord (reference)");
#endif
    sample_memory();
    trace::g_sink.store(this, std::memory_order_relaxed);
  }
#ifdef LOOM_HAVE_CUDA
  if (be_.device() == Device::cuda) check(cudaProfilerStart(), "cudaProfilerStart");
#endif
  log_info(cat("profile: window opens before step ", step));
}

void Profiler::close_window() {
  open_ = false;
  done_ = true;
  trace::g_sink.store(nullptr, std::memory_order_relaxed);
#ifdef LOOM_HAVE_CUDA
  if (be_.device() == Device::cuda) check(cudaProfilerStop(), "cudaProfilerStop");
#endif
  if (cfg_.trace) {
    be_.synchronize();  // every event of the window has completed
    write_trace();
  }
  log_info(cat("profile: window closed after step ", step_, cfg_.trace ? cat("; trace: ", trace_path()) : std::string()));
}

void Profiler::before_step(int64_t step) {
  if (!cfg_.enabled() || done_) return;
  step_ = step;
  if (!open_ && step >= cfg_.start && step <= cfg_.stop) open_window(step);
  if (open_ && cfg_.trace) begin(trace::Track::host, "step", nullptr);
}

void Profiler::after_step(int64_t step) {
  if (!open_) return;
  if (cfg_.trace) {
    end(trace::Track::host, nullptr);
    sample_memory();
  }
  if (step >= cfg_.stop) close_window();
}

void Profiler::finish() {
  if (open_) close_window();
}

void Profiler::write_trace() {
  // Device marks become microseconds since the reference event, host marks
  // microseconds since the host clock's start (both taken at the same moment).
  auto us = [&](const Mark& m) -> double {
#ifdef LOOM_HAVE_CUDA
    if (ev_ && m.event >= 0) {
      float ms = 0;
      check(cudaEventElapsedTime(&ms, ev_->ref, ev_->ring[static_cast<size_t>(m.event)]), "cudaEventElapsedTime");
      return static_cast<double>(ms) * 1000.0;
    }
#endif
    return static_cast<double>(m.host_ns) / 1000.0;
  };
  const bool cuda = be_.device() == Device::cuda;
  const char* track_names[trace::kTracks] = {cuda ? "compute stream" : "compute (CPU)",
                                             cuda && world_ > 1 ? "comm stream (NCCL)" : "comm (MPI, host)", "host",
                                             "optimizer stream"};
  const char* cats[trace::kTracks] = {"compute", "comm", "host", "optimizer"};
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"ph", "M"}, {"pid", rank_}, {"name", "process_name"}, {"args", {{"name", cat("rank ", rank_)}}}});
  for (int t = 0; t < trace::kTracks; ++t) {
    events.push_back({{"ph", "M"}, {"pid", rank_}, {"tid", t + 1}, {"name", "thread_name"}, {"args", {{"name", track_names[t]}}}});
    events.push_back({{"ph", "M"}, {"pid", rank_}, {"tid", t + 1}, {"name", "thread_sort_index"}, {"args", {{"sort_index", t}}}});
  }
  struct Out {
    double ts, dur;
    size_t rec;
  };
  std::vector<Out> outs;
  for (size_t i = 0; i < recs_.size(); ++i) {
    const Rec& r = recs_[i];
    if (r.e.host_ns < 0) continue;  // never ended (the window closed inside it)
    const bool device_timed = r.b.event >= 0 && r.e.event >= 0;
    const bool host_timed = r.b.event < 0 && r.e.event < 0;
    if (!device_timed && !host_timed) continue;  // the ring ran out between its two marks
    const double b = us(r.b), e = us(r.e);
    outs.push_back({b, std::max(0.0, e - b), i});
  }
  // Parents before children at equal start (Perfetto and the checks nest by order).
  std::stable_sort(outs.begin(), outs.end(), [&](const Out& a, const Out& b) {
    const int ta = static_cast<int>(recs_[a.rec].track), tb = static_cast<int>(recs_[b.rec].track);
    if (ta != tb) return ta < tb;
    if (a.ts != b.ts) return a.ts < b.ts;
    return recs_[a.rec].depth < recs_[b.rec].depth;
  });
  for (const Out& o : outs) {
    const Rec& r = recs_[o.rec];
    const int t = static_cast<int>(r.track);
    events.push_back({{"name", r.name}, {"cat", cats[t]}, {"ph", "X"}, {"ts", o.ts}, {"dur", o.dur}, {"pid", rank_},
                      {"tid", t + 1}, {"args", {{"step", r.step}}}});
  }
  for (const Counter& c : counters_)
    events.push_back({{"name", cuda ? "device memory (GiB)" : "resident memory (GiB)"}, {"ph", "C"},
                      {"ts", static_cast<double>(c.host_ns) / 1000.0}, {"pid", rank_},
                      {"args", {{"in_use", c.in_use_gib}, {"arena", c.arena_gib}}}});
  nlohmann::json doc = {{"traceEvents", events},
                        {"displayTimeUnit", "ms"},
                        {"otherData",
                         {{"loom_rank", rank_}, {"loom_world", world_}, {"loom_steps", {cfg_.start, cfg_.stop}},
                          {"loom_device", cuda ? "cuda" : "cpu"},
                          {"loom_clock", cuda ? "CUDA events (compute, comm); host clock (host, counters)" : "host clock"},
                          {"loom_truncated", dropped_}}}};
  const fs::path path = trace_path();
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  if (ec) throw Error(cat("cannot create the trace directory '", path.parent_path().string(), "': ", ec.message()));
  // tmp + fsync + rename, never writing through a link planted under the tmp name.
  ckpt::write_file_atomic(path.string(), doc.dump() + "\n");
  recs_.clear();
}

}  // namespace loom
