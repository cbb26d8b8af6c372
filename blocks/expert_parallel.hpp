// Expert parallelism for the `moe` FFN block (sharding.expert_parallel = P):
// each layer's E experts are split over groups of P consecutive ranks, rank r
// of a group running experts [(r mod P)·E/P, (r mod P + 1)·E/P). Every rank
// routes its own tokens; the rows it sorted by expert are sent to the ranks
// that run those experts and the expert outputs come back, by all_to_all
// within the group.
//
// Layouts. After the sort, a rank's rows are grouped by expert in ascending
// order, so the rows for peer q (experts [q·El, (q+1)·El), El = E/P) are one
// contiguous block starting at offsets[q·El]: the sorted buffer is already the
// all_to_all's send layout. The receiver gets, from each peer in rank order,
// that peer's rows for its El experts, expert by expert — segments()
// describes them.
//
// Exchanges, all on the group communicator, in this order on every rank,
// also when a rank sends or receives no rows:
//   forward   1. counts: the E per-expert row counts, an equal-split
//                all_to_all (El int64 per peer), so that each rank learns
//                how many rows of each of its experts every peer sends;
//             2. dispatch: the rows (h elements each) to the experts' owners;
//             3. return: the expert outputs back (the reverse counts).
//   backward  4. dispatch: the output gradients of the same rows (the counts
//                of 1 are kept, so they are not exchanged again);
//             5. return: the input gradients back.
// The rows a rank routes to its own experts never travel: 2-5 move only the
// other ranks' rows. Each is two all_to_alls, one to the lower ranks and one
// to the higher ones, so that both sides stay one packed run per call
// (all_to_all lays peers out without gaps, and a rank's own block sits
// between its lower and higher peers' in both layouts).
// Bytes a rank sends per layer and micro-batch: 8·El·(P−1) for 1, then
// h·b·(rows it sends to other ranks) for 2 and 4, and h·b·(rows it receives
// from other ranks) for 3 and 5 (b the activation's bytes per element).
//
// Where they run. Every exchange is queued on the backend's compute queue
// (Backend::ctx()). Only the counts exchange is waited for at once. The
// caller waits for 2-5 with wait(), and runs its own rows meanwhile: the
// segments marked `local` are read and written at `src_row` of the sorted
// layout (the send buffer of 2 and 4, the receive buffer of 3 and 5), where
// no exchange reads or writes, and only their intermediate rows (the GEMMs'
// and SwiGLU's) use `row` of the receive layout, whose local block no
// exchange touches either. Host communicators (MPI, CPU ranks) move host
// buffers and return when done. A device communicator (NCCL, one GPU per
// rank) moves device buffers on its own stream. The counts of exchange 1 go
// from the routing's counts into a buffer of E int64 beside them and are read
// back to the host, since the sizes of exchanges 2-5 and the experts' row
// runs are host decisions. Exchange 1 is queued right after the routing
// (exchange_counts), before the host waits for the layer's own counts: that
// one wait then covers both, and reading the received counts is a copy from
// an idle queue, not a second wait.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "loom/block.hpp"
#include "loom/comm.hpp"
#include "loom/ops/backend.hpp"

namespace loom {

class ExpertExchange {
 public:
  // group: the P ranks of this rank's expert-parallel group; backend: whose
  // compute queue orders the exchanges (and reads the counts back to the host
  // when the group moves device buffers).
  ExpertExchange(Communicator* group, Backend* backend, int64_t num_experts, int64_t tokens, int64_t top_k,
                 int64_t hidden);

  int64_t group_size() const { return P_; }
  int64_t first_expert() const { return first_; }
  int64_t local_experts() const { return El_; }
  // Most rows this rank's experts can receive in a micro-batch: from each
  // peer, at most one row per token for each of min(k, El) experts.
  int64_t max_recv_rows() const { return P_ * N_ * std::min(k_, El_); }

  // A run of rows for this rank's expert `expert` (global index): rows
  // [row, row + rows) of the receive layout. local: the rows come from this
  // rank itself; they never travel, and the block reads and writes them at
  // rows [src_row, src_row + rows) of the sorted (send) layout instead.
  struct Segment {
    int64_t expert = 0, row = 0, rows = 0, src_row = 0;
    bool local = false;
  };

  // Forward exchange 1, queued before the host reads any count: counts_src,
  // the sorted rows per expert [E] where the routing left them (host or
  // device), to counts_in, E int64 of scratch beside them (both as 8-byte
  // elements: DType::f64 views), which the next dispatch reads back.
  void exchange_counts(const Tensor& counts_src, Tensor& counts_in);
  // Exchanges 2-5, queued: wait() before reading what they bring.
  // 2, after exchange_counts. counts: this rank's rows per expert [E] on the
  // host (Backend::moe_route's, read back); xs: the sorted rows [N·k, h]; xr:
  // the receive buffer [max_recv_rows, h].
  void dispatch(const int64_t* counts, const Tensor& xs, Tensor& xr);
  // 3: yr [max_recv_rows, h] (outputs of the received rows) back into y [N·k, h] (sorted order).
  void give_back(const Tensor& yr, Tensor& y) { queue(yr, recv_, y, send_); }
  // 4: like dispatch's rows, with the counts of the last dispatch.
  void dispatch_grad(const Tensor& dy, Tensor& dyr) { queue(dy, send_, dyr, recv_); }
  // 5: like give_back.
  void give_back_grad(const Tensor& dxr, Tensor& dx) { queue(dxr, recv_, dx, send_); }
  // The compute queue waits for the exchange queued last (and so for every
  // earlier one); a no-op when none is pending.
  void wait();

  const std::vector<Segment>& segments() const { return segments_; }

 private:
  // One exchange without the rank's own block: to the lower ranks, then to
  // the higher ones (see above). send / recv are laid out by peer in rank
  // order, sc / rc elements per peer, the own entries ignored.
  void queue(const Tensor& send, const std::vector<int64_t>& sc, Tensor& recv, const std::vector<int64_t>& rc);

  Communicator* group_;
  Backend* backend_;
  int64_t P_, E_, El_, N_, k_, h_, first_, self_;
  Tensor counts_in_dev_;            // exchange 1's receive buffer, until dispatch reads it back
  std::vector<int64_t> counts_in_;  // exchange 1's received counts [E], on the host
  std::vector<int64_t> send_, recv_;             // elements per peer of the last dispatch
  std::vector<int64_t> lo_send_, lo_recv_, hi_send_, hi_recv_;  // queue()'s per-call counts
  std::vector<Segment> segments_;
  CommTicket pending_ = 0;  // the exchange the compute queue has not waited for yet
  bool pending_set_ = false;
};

}  // namespace loom
