// NCCL communicator (see nccl_communicator.hpp for the stream/event
// discipline, the failure model and byte counting). Built only with CUDA, MPI
// and NCCL (LOOM_HAVE_NCCL); a plain C++ file, no device code.
#include "comm/nccl_communicator.hpp"

#include <nvtx3/nvToolsExt.h>

#include "loom/trace.hpp"

#include <cuda_bf16.h>  // before nccl.h: older headers declare ncclBfloat16 only after it
#include <cuda_runtime_api.h>
#include <mpi.h>
#include <nccl.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <thread>

#include "comm/collective_checks.hpp"
#include "comm/launch.hpp"
#include "loom/error.hpp"
#include "loom/ops/cuda_check.hpp"

namespace loom {
namespace {

using Clock = std::chrono::steady_clock;

// Events per ring: tickets reuse slot t % kRing (see the header for why reuse is safe).
constexpr int kRing = 64;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Host-side polling: the first polls only yield (most waits are short), then
// sleep 100 µs so that oversubscribed ranks leave each other the cores.
void pause(int polls) {
  if (polls < 100) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

std::string nccl_err(ncclResult_t rc, ncclComm_t comm) {
  std::string s = cat(ncclGetErrorString(rc), " (ncclResult_t ", static_cast<int>(rc), ")");
  const char* last = ncclGetLastError(comm);
  if (last && *last) s += cat(", last NCCL error: ", last);
  return s;
}

std::string cuda_err(cudaError_t e) { return cat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"); }

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
  }
  return ncclSum;
}

// A non-blocking NCCL communicator may answer ncclInProgress while a helper
// thread finishes the call (init, split, the lazy connection set-up of a first
// collective, finalize); nothing else may be called on it until its state
// leaves ncclInProgress. Polls that state up to timeout_s.
struct Ready {
  bool ok = true;
  bool timed_out = false;
  std::string error;  // when !ok and !timed_out
};

Ready await_ready(ncclComm_t comm, double timeout_s) {
  const auto t0 = Clock::now();
  for (int polls = 0;; ++polls) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t rc = ncclCommGetAsyncError(comm, &state);
    if (rc != ncclSuccess) return {false, false, cat("ncclCommGetAsyncError failed: ", nccl_err(rc, comm))};
    if (state == ncclSuccess) return {};
    if (state != ncclInProgress) return {false, false, nccl_err(state, comm)};
    if (seconds_since(t0) >= timeout_s) return {false, true, ""};
    pause(polls);
  }
}

// Makes `device` current for a scope (constructor, split, destructor; the
// collectives themselves need no current device: events and streams carry
// theirs and NCCL sets its own). Never throws: status says whether it worked.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    status = cudaGetDevice(&prev_);
    if (status == cudaSuccess && prev_ != device) {
      status = cudaSetDevice(device);
      switched_ = status == cudaSuccess;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  cudaError_t status = cudaSuccess;

 private:
  int prev_ = 0;
  bool switched_ = false;
};

// What a ring slot last held, for timeout messages.
struct Slot {
  const char* name = "";
  uint64_t bytes = 0;
  CommTicket ticket = 0;
  bool after_ctx = false;  // waited on ctx.stream (false for barrier)
};

class NcclCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (ready, non-blocking); aborts it if the stream,
  // events or buffer cannot be made.
  NcclCommunicator(ncclComm_t comm, int device, double timeout_s, int world_rank)
      : comm_(comm), device_(device), world_rank_(world_rank), timeout_s_(timeout_s) {
    try {
      ncclResult_t rc = ncclCommCount(comm_, &size_);
      if (rc != ncclSuccess) throw Error(cat("ncclCommCount failed: ", nccl_err(rc, comm_)));
      rc = ncclCommUserRank(comm_, &rank_);
      if (rc != ncclSuccess) throw Error(cat("ncclCommUserRank failed: ", nccl_err(rc, comm_)));
      DeviceGuard guard(device_);
      LOOM_CUDA_CHECK(guard.status, "making device ", device_, " current for the NCCL communicator");
      // Highest priority: collectives overlap with compute, and the compute
      // waiting on them should not also wait behind queued compute blocks.
      int least = 0, greatest = 0;
      LOOM_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest), "device ", device_);
      LOOM_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest),
                      "NCCL communicator stream on device ", device_, ", priority ", greatest);
      for (int i = 0; i < kRing; ++i) {
        LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&start_[i], cudaEventDisableTiming), "start event ", i, " of ",
                        kRing, " on device ", device_);
        LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&done_[i], cudaEventDisableTiming), "done event ", i, " of ",
                        kRing, " on device ", device_);
      }
      LOOM_CUDA_CHECK(cudaMalloc(&barrier_buf_, sizeof(float)), "4-byte barrier buffer on device ", device_);
      LOOM_CUDA_CHECK(cudaMemset(barrier_buf_, 0, sizeof(float)), "barrier buffer on device ", device_);
    } catch (...) {
      abort_comm();
      release_cuda();
      throw;
    }
  }

  ~NcclCommunicator() override {
    DeviceGuard guard(device_);
    if (comm_ && std::uncaught_exceptions() > 0) {
      // Destroyed while an exception propagates: this rank is leaving the
      // sequence of collectives, and its peers may never finish theirs.
      // Waiting for them would only delay the error report by up to twice
      // the timeout, so abort at once.
      abort_comm();
    }
    if (comm_) {
      try {
        synchronize();
      } catch (...) {
        // synchronize() aborted the communicator; nothing is left to wait for.
      }
    }
    if (comm_) {
      // Finalize is collective within the node (NCCL waits for the other
      // local ranks before stopping its proxy threads): poll it with the
      // timeout, so a peer that never tears down costs timeout_s, not a hang.
      ncclResult_t rc = ncclCommFinalize(comm_);
      bool finalized = (rc == ncclSuccess || rc == ncclInProgress) && await_ready(comm_, timeout_s_).ok;
      if (finalized) {
        ncclCommDestroy(comm_);  // local only after a finalize
      } else {
        ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
    release_cuda();
  }

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool device_tensors() const override { return true; }

  CommTicket all_reduce(const ExecContext& ctx, Tensor& t, ReduceOp op) override {
    const char* name = "all_reduce";
    usable(name);
    cuda_context(name, ctx);
    collective::check_buffer(name, rank_, "tensor", t, Device::cuda);
    ncclDataType_t type = reduce_type(name, t.dtype, op);
    const uint64_t bytes = t.bytes();
    const size_t n = static_cast<size_t>(t.numel());
    CommTicket tk = issue(name, "ncclAllReduce", bytes, &ctx, [&](cudaStream_t s) {
      return ncclAllReduce(t.data, t.data, n, type, nccl_op(op), comm_, s);
    });
    count(CollectiveKind::all_reduce, 2 * collective::ring_share(size_, bytes));
    return tk;
  }

  CommTicket reduce_scatter(const ExecContext& ctx, const Tensor& in, Tensor& out, ReduceOp op) override {
    const char* name = "reduce_scatter";
    usable(name);
    cuda_context(name, ctx);
    collective::check_buffer(name, rank_, "input", in, Device::cuda);
    collective::check_buffer(name, rank_, "output", out, Device::cuda);
    collective::check_same_dtype(name, rank_, in, out);
    collective::check_shard_sizes(name, rank_, size_, in, out, true);
    ncclDataType_t type = reduce_type(name, in.dtype, op);
    // In place only as NCCL defines it: the output is this rank's chunk of the input.
    const char* own = static_cast<const char*>(in.data) + static_cast<size_t>(rank_) * out.bytes();
    if (overlaps(in, out) && out.data != own)
      throw Error(cat("collective reduce_scatter on rank ", rank_, " of ", size_,
                      ": the output overlaps the input but is not this rank's chunk of it (input + rank*n = element ",
                      static_cast<int64_t>(rank_) * out.numel(), "); NCCL reduces in place only there — pass that ",
                      "view or a separate output buffer"));
    const uint64_t full = in.bytes();
    const size_t n = static_cast<size_t>(out.numel());
    CommTicket tk = issue(name, "ncclReduceScatter", full, &ctx, [&](cudaStream_t s) {
      return ncclReduceScatter(in.data, out.data, n, type, nccl_op(op), comm_, s);
    });
    count(CollectiveKind::reduce_scatter, collective::ring_share(size_, full));
    return tk;
  }

  CommTicket all_gather(const ExecContext& ctx, const Tensor& in, Tensor& out) override {
    const char* name = "all_gather";
    usable(name);
    cuda_context(name, ctx);
    collective::check_buffer(name, rank_, "input", in, Device::cuda);
    collective::check_buffer(name, rank_, "output", out, Device::cuda);
    collective::check_same_dtype(name, rank_, in, out);
    collective::check_shard_sizes(name, rank_, size_, in, out, false);
    const char* own = static_cast<const char*>(out.data) + static_cast<size_t>(rank_) * in.bytes();
    if (overlaps(in, out) && in.data != own)
      throw Error(cat("collective all_gather on rank ", rank_, " of ", size_,
                      ": the input overlaps the output but is not this rank's chunk of it (output + rank*n = element ",
                      static_cast<int64_t>(rank_) * in.numel(), "); NCCL gathers in place only there — pass that ",
                      "view or a separate input buffer"));
    // Raw bytes: gathering moves data without arithmetic, so any dtype works.
    const uint64_t full = out.bytes();
    const size_t nb = in.bytes();
    CommTicket tk = issue(name, "ncclAllGather", full, &ctx, [&](cudaStream_t s) {
      return ncclAllGather(in.data, out.data, nb, ncclUint8, comm_, s);
    });
    count(CollectiveKind::all_gather, collective::ring_share(size_, full));
    return tk;
  }

  CommTicket broadcast(const ExecContext& ctx, Tensor& t, int root) override {
    const char* name = "broadcast";
    usable(name);
    cuda_context(name, ctx);
    collective::check_buffer(name, rank_, "tensor", t, Device::cuda);
    if (root < 0 || root >= size_)
      throw Error(cat("collective broadcast on rank ", rank_, " of ", size_, ": root ", root,
                      " is not a rank of this group (0..", size_ - 1, "); pass a rank of the group, not a world rank"));
    const uint64_t bytes = t.bytes();
    const size_t nb = t.bytes();
    CommTicket tk = issue(name, "ncclBroadcast", bytes, &ctx, [&](cudaStream_t s) {
      return ncclBroadcast(t.data, t.data, nb, ncclUint8, root, comm_, s);
    });
    count(CollectiveKind::broadcast, collective::ring_share(size_, bytes));
    return tk;
  }

  // One NCCL group of a ncclSend and a ncclRecv per peer with a non-zero
  // count, peers in rank order (this rank's own part included), on the comm
  // stream. A rank that sends and receives nothing issues no NCCL call: no
  // peer has a send or receive to match with it.
  CommTicket all_to_all(const ExecContext& ctx, const Tensor& send, std::span<const int64_t> send_counts, Tensor& recv,
                        std::span<const int64_t> recv_counts) override {
    const char* name = "all_to_all";
    usable(name);
    cuda_context(name, ctx);
    collective::check_buffer(name, rank_, "input", send, Device::cuda);
    collective::check_buffer(name, rank_, "output", recv, Device::cuda);
    const collective::AllToAllCounts c =
        collective::check_all_to_all(name, rank_, size_, send, send_counts, recv, recv_counts);
    const size_t elt = dtype_size(send.dtype);
    uint64_t total = 0, to_others = 0;
    for (int q = 0; q < size_; ++q) {
      const uint64_t sb = static_cast<uint64_t>(c.send_count(q)) * elt;
      total += sb + static_cast<uint64_t>(c.recv_count(q)) * elt;
      if (q != rank_) to_others += sb;
    }
    const char* sbase = static_cast<const char*>(send.data);
    char* rbase = static_cast<char*>(recv.data);
    CommTicket tk = issue(name, "ncclGroupStart/ncclSend/ncclRecv/ncclGroupEnd", total, &ctx, [&](cudaStream_t s) {
      ncclResult_t rc = ncclGroupStart();
      if (rc != ncclSuccess) return rc;
      size_t soff = 0, roff = 0;
      for (int q = 0; q < size_ && (rc == ncclSuccess || rc == ncclInProgress); ++q) {
        const size_t sb = static_cast<size_t>(c.send_count(q)) * elt, rb = static_cast<size_t>(c.recv_count(q)) * elt;
        if (sb > 0) rc = ncclSend(sbase + soff, sb, ncclUint8, q, comm_, s);
        if (rb > 0 && (rc == ncclSuccess || rc == ncclInProgress)) rc = ncclRecv(rbase + roff, rb, ncclUint8, q, comm_, s);
        soff += sb;
        roff += rb;
      }
      const ncclResult_t end = ncclGroupEnd();  // closes the group even after a failed call in it
      return rc == ncclSuccess || rc == ncclInProgress ? end : rc;
    });
    count(CollectiveKind::all_to_all, to_others);
    return tk;
  }

  void wait(const ExecContext& ctx, CommTicket t) override {
    if (t == 0) return;  // no collective
    usable("wait");
    cuda_context("wait", ctx);
    if (t > tickets_)
      throw Error(cat("wait on rank ", rank_, " of ", size_, ": ticket ", t, " was not issued by this communicator ",
                      "(its last ticket is ", tickets_, "); pass a ticket that a collective of this communicator ",
                      "returned (split() children have their own tickets)"));
    cudaError_t e = cudaStreamWaitEvent(stream_of(ctx), done_[t % kRing], 0);
    if (e != cudaSuccess)
      throw Error(cat("wait on rank ", rank_, " of ", size_, " for collective ", slots_[t % kRing].name, " #", t,
                      ": cudaStreamWaitEvent(ctx.stream, done event) failed: ", cuda_err(e),
                      "; is ctx.stream a live stream of device ", device_, "?"));
  }

  void synchronize() override {
    usable("synchronize");
    if (tickets_ == 0) return;
    const CommTicket last = tickets_;
    cudaEvent_t ev = done_[last % kRing];
    const auto t0 = Clock::now();
    for (int polls = 0;; ++polls) {
      cudaError_t q = cudaEventQuery(ev);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) {
        const Slot& s = slots_[last % kRing];
        fail(cat("synchronize failed: ", cudaGetErrorName(q)),
             cat("collective ", s.name, " #", s.ticket, " of ", s.bytes, " bytes on rank ", rank_, " of ", size_,
                 " (world rank ", world_rank_, ", device ", device_, ") failed: cudaEventQuery: ", cuda_err(q),
                 "; a kernel on this device has faulted (run compute-sanitizer to find it)"));
      }
      (void)cudaGetLastError();  // cudaErrorNotReady is not an error: keep it out of later launch checks
      ncclResult_t async = ncclSuccess;
      ncclResult_t rc = ncclCommGetAsyncError(comm_, &async);
      if (rc != ncclSuccess) async = rc;
      if (async != ncclSuccess && async != ncclInProgress) {
        const Slot& s = slots_[last % kRing];
        std::string err = nccl_err(async, comm_);
        fail(cat("NCCL error ", ncclGetErrorString(async)),
             cat("collective ", s.name, " #", s.ticket, " of ", s.bytes, " bytes on rank ", rank_, " of ", size_,
                 " (world rank ", world_rank_, ", device ", device_, ") failed: NCCL reported ", err,
                 "; another rank has likely failed — check its log, then restart the run"));
      }
      if (seconds_since(t0) >= timeout_s_) {
        Stuck st = stuck_collective(last);
        // A collective that never started waits on ctx work that never ends;
        // ncclCommAbort would wait for that work too, so the communicator is
        // then left as it is (the process is expected to abort_all()).
        fail(cat("timed out after ", timeout_s_, " s"), st.message, /*abort=*/!st.before_start);
      }
      pause(polls);
    }
  }

  // A 1-element fp32 all_reduce on the comm stream, then synchronize(): every
  // rank has issued everything before its barrier. Counts no bytes.
  void barrier() override {
    usable("barrier");
    issue("barrier", "ncclAllReduce", sizeof(float), nullptr, [&](cudaStream_t s) {
      return ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat32, ncclSum, comm_, s);
    });
    synchronize();
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    usable("split");
    if (color < 0)
      throw Error(cat("split on rank ", rank_, " of ", size_, ": color ", color,
                      " is negative; every rank must pass a color >= 0 (ranks with equal color form a group)"));
    DeviceGuard guard(device_);
    LOOM_CUDA_CHECK(guard.status, "making device ", device_, " current for split");
    ncclComm_t child = nullptr;
    // config = NULL: the child inherits the parent's (non-blocking) configuration.
    ncclResult_t rc = ncclCommSplit(comm_, color, key, &child, nullptr);
    Ready r;
    if (rc != ncclSuccess && rc != ncclInProgress) {
      r = {false, false, cat("ncclCommSplit: ", nccl_err(rc, comm_))};
    } else {
      // Non-blocking: the child handle may only be filled in once the
      // parent's split has completed, so wait for the parent first.
      r = await_ready(comm_, timeout_s_);
      if (r.ok && child == nullptr) r = {false, false, "ncclCommSplit returned no communicator"};
      if (r.ok) r = await_ready(child, timeout_s_);
    }
    if (!r.ok) {
      if (child) ncclCommAbort(child);
      std::string where = cat("split (color ", color, ", key ", key, ") on rank ", rank_, " of ", size_,
                              " (world rank ", world_rank_, ", device ", device_, ")");
      if (r.timed_out)
        fail("split timed out",
             cat(where, " did not finish within ", timeout_s_, " s: a rank may have died or not called split; ",
                 "raise run.collective_timeout if creating groups legitimately takes longer"));
      fail("split failed", cat(where, " failed: ", r.error, "; another rank has likely failed — check its log"));
    }
    return adopt(std::make_unique<NcclCommunicator>(child, device_, timeout_s_, world_rank_));
  }

 private:
  // Records start on ctx's stream (when ctx is given), makes the comm stream
  // wait on it, enqueues `op` on the comm stream, waits for a non-blocking
  // NCCL to have really enqueued it, records done, and returns the ticket.
  template <typename Op>
  CommTicket issue(const char* name, const char* call, uint64_t bytes, const ExecContext* ctx, Op&& op) {
    const CommTicket t = tickets_ + 1;
    const size_t s = static_cast<size_t>(t % kRing);
    slots_[s] = {name, bytes, t, ctx != nullptr};
    if (ctx) {
      check_cuda(cudaEventRecord(start_[s], stream_of(*ctx)), "cudaEventRecord(start, ctx.stream)", name, bytes);
      check_cuda(cudaStreamWaitEvent(stream_, start_[s], 0), "cudaStreamWaitEvent(comm stream, start)", name, bytes);
    }
    if (bytes > 0) {
      // NVTX names the collective for nsys; the tracer times it on the comm stream.
      nvtxRangePushA(name);
      trace::Scope traced(trace::Track::comm, name, stream_);
      ncclResult_t rc = op(stream_);
      nvtxRangePop();
      if (rc != ncclSuccess && rc != ncclInProgress) {
        std::string err = nccl_err(rc, comm_);
        fail(cat(call, " failed"), cat("collective ", name, " of ", bytes, " bytes on ", size_, " ranks failed on rank ",
                                       rank_, " (world rank ", world_rank_, ", device ", device_, "): ", call, ": ",
                                       err, "; another rank has likely failed — check its log, then restart the run"));
      }
      Ready r = await_ready(comm_, timeout_s_);
      if (!r.ok) {
        if (r.timed_out)
          fail(cat(call, " timed out"),
               cat("collective ", name, " of ", bytes, " bytes on rank ", rank_, " of ", size_, " (world rank ",
                   world_rank_, ", device ", device_, ") could not be started within ", timeout_s_,
                   " s (NCCL was still connecting to its peers): a rank may have died or skipped it; raise ",
                   "run.collective_timeout if a first collective legitimately takes longer"));
        fail(cat(call, " failed"), cat("collective ", name, " of ", bytes, " bytes on ", size_,
                                       " ranks failed on rank ", rank_, " (world rank ", world_rank_, ", device ",
                                       device_, "): ", call, ": ", r.error,
                                       "; another rank has likely failed — check its log, then restart the run"));
      }
    }
    check_cuda(cudaEventRecord(done_[s], stream_), "cudaEventRecord(done, comm stream)", name, bytes);
    return next_ticket();
  }

  struct Stuck {
    std::string message;
    bool before_start = false;  // still waiting for the work queued on ctx before it
  };

  // The collective that holds up `last`: the oldest one still in the ring
  // whose done event has not fired (the comm stream completes in order).
  Stuck stuck_collective(CommTicket last) const {
    CommTicket first = last >= static_cast<CommTicket>(kRing) ? last - kRing + 1 : 1;
    const Slot* stuck = &slots_[last % kRing];
    for (CommTicket t = first; t <= last; ++t) {
      if (cudaEventQuery(done_[t % kRing]) != cudaSuccess) {
        stuck = &slots_[t % kRing];
        break;
      }
    }
    (void)cudaGetLastError();
    const Slot& tail = slots_[last % kRing];
    bool before = stuck->after_ctx && cudaEventQuery(start_[stuck->ticket % kRing]) != cudaSuccess;
    (void)cudaGetLastError();
    std::string msg = cat("collective ", stuck->name, " #", stuck->ticket, " of ", stuck->bytes, " bytes on rank ",
                          rank_, " of ", size_, " (world rank ", world_rank_, ", device ", device_,
                          ") did not finish within ", timeout_s_, " s");
    if (stuck != &tail)
      msg += cat(" (the last collective issued is ", tail.name, " #", tail.ticket, " of ", tail.bytes, " bytes)");
    if (before) {
      msg += ": it has not even started, because the work queued on ctx.stream before it has not finished; a "
             "kernel of this rank is hanging or far slower than the limit";
    } else {
      msg += ": a rank may have died or skipped it, or the ranks issued different collectives";
    }
    msg += "; raise run.collective_timeout if collectives legitimately take longer";
    return {msg, before};
  }

  void usable(const char* name) const {
    if (!failure_.empty())
      throw Error(cat("collective ", name, " on rank ", rank_, " of ", size_,
                      " refused: this communicator failed earlier (", failure_,
                      "); the ranks no longer agree on the sequence of collectives — report the first error and "
                      "call abort_all()"));
  }

  // Aborts the NCCL communicator (which also stops NCCL kernels still waiting
  // for a peer; abort = false leaves it as it is, leaked), remembers why, and
  // throws `msg`. Every later call is refused.
  [[noreturn]] void fail(const std::string& why, const std::string& msg, bool abort = true) {
    failure_ = why;
    if (abort) abort_comm();
    comm_ = nullptr;
    throw Error(msg);
  }

  void abort_comm() noexcept {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  void release_cuda() noexcept {
    for (auto& e : start_)
      if (e) cudaEventDestroy(e), e = nullptr;
    for (auto& e : done_)
      if (e) cudaEventDestroy(e), e = nullptr;
    if (stream_) cudaStreamDestroy(stream_), stream_ = nullptr;
    if (barrier_buf_) cudaFree(barrier_buf_), barrier_buf_ = nullptr;
  }

  void check_cuda(cudaError_t e, const char* call, const char* name, uint64_t bytes) {
    if (e == cudaSuccess) return;
    fail(cat(call, " failed"), cat("collective ", name, " of ", bytes, " bytes on rank ", rank_, " of ", size_,
                                   " (world rank ", world_rank_, ", device ", device_, "): CUDA call ", call,
                                   " failed: ", cuda_err(e), "; is ctx.stream a live stream of device ", device_,
                                   "?"));
  }

  void cuda_context(const char* name, const ExecContext& ctx) const {
    if (ctx.device != Device::cuda)
      throw Error(cat("collective ", name, " on rank ", rank_, ": ctx is a ", device_name(ctx.device),
                      " context, but the NCCL communicator orders collectives after ctx.stream; pass the CUDA ",
                      "ExecContext the surrounding work runs on"));
  }

  static cudaStream_t stream_of(const ExecContext& ctx) { return static_cast<cudaStream_t>(ctx.stream); }

  ncclDataType_t reduce_type(const char* name, DType t, ReduceOp op) const {
    collective::check_reducible(name, rank_, t, op, "");
    switch (t) {
      case DType::bf16: return ncclBfloat16;
      case DType::f16: return ncclFloat16;
      case DType::f64: return ncclFloat64;
      case DType::i32: return ncclInt32;
      default: return ncclFloat32;  // f32, the only other reducible dtype
    }
  }

  static bool overlaps(const Tensor& a, const Tensor& b) {
    auto pa = reinterpret_cast<uintptr_t>(a.data), pb = reinterpret_cast<uintptr_t>(b.data);
    return a.bytes() > 0 && b.bytes() > 0 && pa < pb + b.bytes() && pb < pa + a.bytes();
  }

  // (p-1)/p of `bytes`, rounded down: one ring pass per rank.
  ncclComm_t comm_ = nullptr;
  int device_ = 0;
  int rank_ = 0, size_ = 1, world_rank_ = 0;
  double timeout_s_;
  cudaStream_t stream_ = nullptr;
  std::array<cudaEvent_t, kRing> start_{};
  std::array<cudaEvent_t, kRing> done_{};
  std::array<Slot, kRing> slots_{};
  float* barrier_buf_ = nullptr;
  std::string failure_;  // non-empty once a collective failed or timed out
};

// What rank 0 broadcasts: the NCCL id, or why it could not make one (so the
// other ranks fail with rank 0's reason instead of a timeout).
struct IdMessage {
  int32_t ok = 0;
  char error[480] = {};
  ncclUniqueId id{};
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(int device, double timeout_s) {
  if (!(timeout_s > 0) || !std::isfinite(timeout_s))
    throw Error(cat("collective timeout ", timeout_s, " s is not a positive number of seconds; set ",
                    "run.collective_timeout to e.g. 600"));
  ensure_mpi_initialized();
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const std::string where = cat("NCCL communicator on rank ", rank, " of ", size, " (device ", device, ")");

  int ndev = 0;
  cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess)
    throw Error(cat(where, ": cudaGetDeviceCount failed: ", cuda_err(e),
                    "; the NCCL communicator needs a CUDA GPU per rank (is the driver loaded?)"));
  if (device < 0 || device >= ndev)
    throw Error(cat(where, ": device ", device, " does not exist, this process sees ", ndev,
                    " CUDA device(s); run one process per GPU and pick the device from the node-local rank ",
                    "(check CUDA_VISIBLE_DEVICES)"));
  LOOM_CUDA_CHECK(cudaSetDevice(device), where);

  // Rank 0 makes the id; MPI carries it to the others. Non-blocking and polled,
  // so a rank that never gets here turns into an error instead of a hang. The
  // message is leaked if the broadcast times out: MPI may still write into it.
  auto* msg = new IdMessage{};
  if (rank == 0) {
    ncclResult_t rc = ncclGetUniqueId(&msg->id);
    if (rc == ncclSuccess) {
      msg->ok = 1;
    } else {
      std::string err = cat("ncclGetUniqueId failed on rank 0: ", nccl_err(rc, nullptr));
      std::strncpy(msg->error, err.c_str(), sizeof(msg->error) - 1);
    }
  }
  MPI_Request req = MPI_REQUEST_NULL;
  int mrc = MPI_Ibcast(msg, static_cast<int>(sizeof(IdMessage)), MPI_BYTE, 0, MPI_COMM_WORLD, &req);
  if (mrc != MPI_SUCCESS) {
    delete msg;
    throw Error(cat(where, ": MPI_Ibcast of the NCCL id failed (MPI error ", mrc, ")"));
  }
  const auto t0 = Clock::now();
  for (int polls = 0;; ++polls) {
    int flag = 0;
    mrc = MPI_Test(&req, &flag, MPI_STATUS_IGNORE);
    if (mrc != MPI_SUCCESS) throw Error(cat(where, ": MPI_Test on the NCCL id broadcast failed (MPI error ", mrc, ")"));
    if (flag) break;
    if (seconds_since(t0) >= timeout_s)
      throw Error(cat(where, ": the NCCL id broadcast from rank 0 did not complete within ", timeout_s,
                      " s: a rank may have failed before creating its communicator — check the other ranks' logs; ",
                      "raise run.collective_timeout if start-up legitimately takes longer"));
    pause(polls);
  }
  IdMessage m = *msg;
  delete msg;
  if (!m.ok) {
    m.error[sizeof(m.error) - 1] = '\0';
    throw Error(cat(where, ": ", m.error, "; check NCCL's network set-up (NCCL_SOCKET_IFNAME, NCCL_DEBUG=WARN)"));
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every host call is polled with the timeout (see the header)
  ncclComm_t comm = nullptr;
  ncclResult_t rc = ncclCommInitRankConfig(&comm, size, m.id, rank, &config);
  Ready r;
  if (rc != ncclSuccess && rc != ncclInProgress) {
    r = {false, false, cat("ncclCommInitRankConfig: ", nccl_err(rc, comm))};
  } else if (comm == nullptr) {
    r = {false, false, "ncclCommInitRankConfig returned no communicator"};
  } else {
    r = await_ready(comm, timeout_s);
  }
  if (!r.ok) {
    if (comm) ncclCommAbort(comm);
    if (r.timed_out)
      throw Error(cat(where, ": NCCL initialisation did not finish within ", timeout_s,
                      " s: a rank may have died or not created its communicator; raise run.collective_timeout if "
                      "start-up legitimately takes longer"));
    throw Error(cat(where, ": NCCL initialisation failed: ", r.error,
                    "; NCCL_DEBUG=WARN shows NCCL's own account"));
  }
  return std::make_unique<NcclCommunicator>(comm, device, timeout_s, rank);
}

}  // namespace loom
