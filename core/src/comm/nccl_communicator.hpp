// The NCCL communicator: collectives over device tensors, one process per GPU,
// started by mpirun / srun (MPI hands the NCCL id from rank 0 to the others).
//
// Streams and events. Each communicator (and each split() child) owns a
// non-blocking CUDA stream of the device's highest priority, and two rings of
// kRing CUDA events (timing disabled) made once in the constructor, so that a
// collective allocates nothing. A collective with ticket t, slot s = t % kRing:
//   1. records start[s] on ctx.stream and makes the comm stream wait on it, so
//      the collective sees everything queued on ctx before the call;
//   2. enqueues the NCCL operation on the comm stream;
//   3. records done[s] on the comm stream and returns t.
// The host never blocks. wait(ctx, t) makes ctx.stream wait on done[t % kRing]
// (cudaStreamWaitEvent): ctx's later work then sees the outputs. Reusing slots
// is safe: a stream wait binds to the event's record at the time of the wait
// call, so re-recording start[s] or done[s] later does not touch earlier
// waits; and if done[s] has already been re-recorded for a later ticket
// t + m*kRing when wait(ctx, t) is called, waiting on that later record still
// covers t, because the comm stream runs its collectives in issue order (it
// merely waits a little longer than needed).
//
// Until wait(ctx, t), ctx's work must neither read the outputs nor write the
// inputs of collective t (the comm stream may still be using them), and the
// buffers must stay allocated until the collective has finished (wait() plus
// ctx work after it, or synchronize()).
//
// Timeouts. The NCCL communicator is created non-blocking (ncclConfig_t
// blocking = 0), so that no host call waits on another rank without a limit:
// init, split, the lazy connection set-up of a first collective, and the final
// teardown are polled with ncclCommGetAsyncError up to timeout_s. Device-side
// completion is bounded by synchronize(), which polls the last ticket's done
// event (and NCCL's async error) up to timeout_s. On a timeout or an NCCL error
// the communicator calls ncclCommAbort (which also stops NCCL kernels still
// waiting for a peer), throws loom::Error naming the collective, and refuses
// every later collective: the ranks no longer agree on the sequence, and the
// caller is expected to report the error and call abort_all(). (One exception:
// when the collective that timed out has not even started because the work
// queued on ctx before it never finished, the message says so and the NCCL
// communicator is left alone, since ncclCommAbort would wait for that work.)
//
// Types and checks mirror the MPI communicator (same messages): reductions of
// fp32, bf16, fp16, fp64 and int32 (sum, avg, max; avg of int32 is refused;
// bf16/fp16 reduce natively in NCCL, not through fp32), all_gather and
// broadcast of any dtype (raw bytes). Tensors must be contiguous device memory.
// In-place all_gather (input == output + rank*n) and reduce_scatter (output ==
// input + rank*n) are allowed; any other overlap of input and output is refused.
//
// Byte counters: the ring volume per rank in bytes of the tensor's dtype, as
// for the MPI communicator: with p ranks, all_reduce of B bytes counts
// 2(p-1)/p*B, reduce_scatter and all_gather (p-1)/p of the full (size*n)
// buffer, broadcast (p-1)/p*B; all_to_all the bytes this rank sends to the
// other ranks (no ring: each byte crosses once). barrier() counts nothing.
//
// all_to_all is one NCCL group (ncclGroupStart, then per peer in rank order a
// ncclSend and a ncclRecv of raw bytes where its count is non-zero, this
// rank's own part included, ncclGroupEnd) on the comm stream, ordered after
// ctx like every collective; a rank with nothing to send or receive enqueues
// no NCCL call but still takes a ticket. The receive counts must match the
// peers' send counts (exchange them first, see loom/comm.hpp): NCCL cannot
// check it, and a mismatch ends in the timeout.
//
// Callers must know:
//  - One process per GPU; `device` is the CUDA device of this rank (usually
//    the node-local rank). make_nccl_communicator makes it the current device;
//    keep it current on the calling thread while using the communicator.
//  - ExecContext must be the CUDA one (ctx.device == Device::cuda) and
//    ctx.stream the cudaStream_t the surrounding work runs on (a null stream
//    means the legacy default stream).
//  - Every rank issues the same collectives in the same order; creating,
//    splitting and destroying communicators are collective too (destroy them
//    in the same order on every rank, children before parents is a good rule).
//  - All calls on one communicator come from one thread (MPI is FUNNELED).
//  - Destroying a communicator waits (up to timeout_s) for its collectives and
//    for the other local ranks to destroy theirs; destroyed while an exception
//    propagates, it aborts at once instead (the error path should end in
//    abort_all()). Destroy communicators before the process exits (not from
//    static destructors: CUDA may be gone by then).
#pragma once
#include <memory>

#include "loom/comm.hpp"

#ifndef LOOM_HAVE_NCCL
#include "loom/error.hpp"
#endif

namespace loom {

#ifdef LOOM_HAVE_NCCL

// A communicator over every rank of MPI_COMM_WORLD, on CUDA device `device`;
// initialises MPI if needed. timeout_s > 0 bounds creation, every host-side
// NCCL call and synchronize(). Collective over MPI_COMM_WORLD.
std::unique_ptr<Communicator> make_nccl_communicator(int device, double timeout_s);

#else

inline std::unique_ptr<Communicator> make_nccl_communicator(int /*device*/, double /*timeout_s*/) {
#if !defined(LOOM_HAVE_CUDA)
  throw Error("this build of loom has no CUDA support, so it has no NCCL communicator; rebuild with "
              "-DLOOM_WITH_CUDA=ON (CUDA toolkit and NCCL installed) or use the MPI communicator (host tensors)");
#elif !defined(LOOM_HAVE_MPI)
  throw Error("this build of loom has no MPI support, which the NCCL communicator needs to start (MPI hands out "
              "the NCCL id); rebuild with -DLOOM_WITH_MPI=ON (MPI development files installed)");
#else
  throw Error("this build of loom has no NCCL support (nccl.h or libnccl was not found when it was configured); "
              "install NCCL >= 2.18 (e.g. the libnccl-dev package or the nvidia-nccl wheel) and reconfigure, "
              "pointing NCCL_ROOT or NCCL_INCLUDE_DIR/NCCL_LIBRARY at it if it is not next to the CUDA toolkit");
#endif
}

#endif

}  // namespace loom
