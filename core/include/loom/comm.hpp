// Communicators: collectives over a group of ranks. The core provides a
// single-process one, an MPI one (host tensors) and an NCCL one (device
// tensors, one process per GPU); sharding plugins use whichever the run was
// started with. Every collective counts the bytes it moves, per kind, for
// `loom compare`.
//
// Ordering. A collective starts after the work already queued on ctx. Host
// communicators (self, MPI) finish it before returning. Device communicators
// (NCCL) run it on their own stream and return at once: the returned ticket,
// passed to wait(ctx, ticket), makes ctx's later work wait for it (a GPU-side
// wait, the host does not block). Until then ctx's work must neither read the
// outputs nor write the inputs. Tickets grow by one per collective and a
// communicator's collectives complete in order, so waiting on a ticket also
// waits for every earlier one. No allocation happens per collective.
//
// all_to_all (expert parallelism) moves a different number of elements to
// each peer, so its receivers must know their counts before the data moves:
// every rank first exchanges its per-peer counts with an equal-split
// all_to_all (one count per peer), reads the counts it receives, then issues
// the variable all_to_all of the tokens. Every rank issues both, in that
// order, even when it sends and receives nothing, so that the ranks' sequences
// of collectives stay the same; a device communicator runs both on its one
// stream, in issue order, and exchanges with the peers in rank order.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <span>

#include "loom/context.hpp"
#include "loom/tensor.hpp"

namespace loom {

enum class ReduceOp { sum, avg, max };
enum class CollectiveKind : uint8_t { all_reduce, reduce_scatter, all_gather, broadcast, all_to_all, kCount };

struct CommBytes {
  std::array<uint64_t, static_cast<size_t>(CollectiveKind::kCount)> bytes{};
  uint64_t total() const { uint64_t t = 0; for (auto b : bytes) t += b; return t; }
};

using CommTicket = uint64_t;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place on `t` (same shape on every rank).
  virtual CommTicket all_reduce(const ExecContext& ctx, Tensor& t, ReduceOp op) = 0;
  // in: size()*n elements, out: n elements (this rank's chunk).
  // Byte counts use the ring volume per rank (see mpi_communicator.hpp).
  virtual CommTicket reduce_scatter(const ExecContext& ctx, const Tensor& in, Tensor& out, ReduceOp op) = 0;
  // in: n elements, out: size()*n elements (rank-major).
  virtual CommTicket all_gather(const ExecContext& ctx, const Tensor& in, Tensor& out) = 0;
  virtual CommTicket broadcast(const ExecContext& ctx, Tensor& t, int root) = 0;
  // Personalised exchange: this rank sends send_counts[q] elements to rank q
  // and receives recv_counts[q] elements from rank q. Both buffers are laid
  // out by peer, in rank order, without gaps: the elements for (from) rank q
  // start at the sum of the counts of the ranks before q. The buffers may be
  // larger than the sum of their counts (capacity sized once; the rest is
  // neither read nor written) but must not overlap. recv_counts[q] must equal
  // what rank q sends here (send_counts[rank()] on q): exchange the counts
  // first, see above. Both spans empty: an equal split, send.numel() / size()
  // elements to every rank (recv of the same size), e.g. the counts exchange
  // itself. Elements are moved as raw bytes, so any dtype works (same dtype on
  // both sides). Counts the bytes this rank sends to the other ranks (what it
  // sends itself is a local copy).
  virtual CommTicket all_to_all(const ExecContext& ctx, const Tensor& send, std::span<const int64_t> send_counts,
                                Tensor& recv, std::span<const int64_t> recv_counts) = 0;
  // ctx's later work waits for collective t (no-op on host communicators).
  virtual void wait(const ExecContext& /*ctx*/, CommTicket /*t*/) {}
  // Blocks the host until every collective issued so far has finished (device
  // communicators: with the timeout, naming the collective that did not finish).
  virtual void synchronize() {}
  // True when tensors must be device memory (NCCL), false for host memory.
  virtual bool device_tensors() const { return false; }
  // Host barrier over the group.
  virtual void barrier() = 0;
  // Ranks with equal color form a new group, ordered by key.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
  // Bytes this communicator moved, including those of the groups split() made from it.
  const CommBytes& bytes_moved() const { return bytes_; }
  void reset_bytes() { bytes_ = {}; }

 protected:
  void count(CollectiveKind k, uint64_t b) {
    for (Communicator* c = this; c; c = c->counts_into_) c->bytes_.bytes[static_cast<size_t>(k)] += b;
  }
  // split() implementations return their child through this, so that the
  // child's traffic also counts in this communicator (which must outlive it).
  std::unique_ptr<Communicator> adopt(std::unique_ptr<Communicator> child) {
    child->counts_into_ = this;
    return child;
  }
  Communicator* counts_into_ = nullptr;
  CommTicket next_ticket() { return ++tickets_; }
  CommBytes bytes_;
  CommTicket tickets_ = 0;
};

// A host scalar (a loss, a norm, a time) reduced over a host communicator
// (self or MPI); returns the result on every rank.
inline double all_reduce_scalar(Communicator& c, double v, ReduceOp op) {
  if (c.size() == 1) return v;
  Tensor t(&v, DType::f64, Device::cpu, {1});
  c.all_reduce(ExecContext{}, t, op);
  return v;
}

// One rank: every collective is a copy or a no-op.
std::unique_ptr<Communicator> make_self_communicator();

}  // namespace loom
