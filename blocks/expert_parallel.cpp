#include "expert_parallel.hpp"

#include <algorithm>

#include "loom/error.hpp"

namespace loom {

ExpertExchange::ExpertExchange(Communicator* group, Backend* backend, int64_t num_experts, int64_t tokens,
                               int64_t top_k, int64_t hidden)
    : group_(group), backend_(backend), P_(group->size()), E_(num_experts), El_(0), N_(tokens), k_(top_k), h_(hidden),
      first_(0), self_(group->rank()) {
  LOOM_CHECK(P_ >= 1 && E_ % P_ == 0, "sharding.expert_parallel = ", P_, " does not divide model.num_experts = ", E_);
  LOOM_CHECK(backend_ != nullptr, "expert parallelism: no backend");
  const bool dev = backend_->device() != Device::cpu;
  LOOM_CHECK(group_->device_tensors() == dev, "expert parallelism: the expert group's communicator moves ",
             group_->device_tensors() ? "device" : "host", " buffers but the model runs on the ",
             dev ? "device" : "CPU", " (an NCCL group needs run.device = \"cuda\", an MPI one run.device = \"cpu\")");
  El_ = E_ / P_;
  first_ = self_ * El_;
  counts_in_.assign(static_cast<size_t>(E_), 0);
  for (auto* v : {&send_, &recv_, &lo_send_, &lo_recv_, &hi_send_, &hi_recv_}) v->assign(static_cast<size_t>(P_), 0);
  segments_.reserve(static_cast<size_t>(P_ * El_));  // at most one run per (peer, expert): no allocation per step
}

void ExpertExchange::exchange_counts(const Tensor& counts_src, Tensor& counts_in) {
  LOOM_CHECK(counts_src.numel() == E_ && counts_in.numel() == E_ && dtype_size(counts_src.dtype) == 8 &&
                 dtype_size(counts_in.dtype) == 8,
             "expert parallelism: the counts buffers hold ", counts_src.numel(), " and ", counts_in.numel(),
             " 8-byte elements, not the ", E_, " experts' counts");
  wait();  // nothing is pending here in a step; after a step that stopped half-way, its last exchange
  // 1. The per-expert counts: peer q gets the counts of its El experts, from
  // where the routing counted them. Only queued here: dispatch reads them.
  const ExecContext& ctx = backend_->ctx();
  group_->wait(ctx, group_->all_to_all(ctx, counts_src, {}, counts_in, {}));
  counts_in_dev_ = counts_in;
}

void ExpertExchange::dispatch(const int64_t* counts, const Tensor& xs, Tensor& xr) {
  LOOM_CHECK(counts_in_dev_.data != nullptr, "expert parallelism: dispatch without the counts exchange before it");
  // Exchange 1's counts, back to the host (a copy on the CPU): the sizes
  // below are host decisions. The caller's read of its own counts already
  // waited for the queue that exchange 1 is on.
  backend_->download(counts_in_.data(), counts_in_dev_, static_cast<size_t>(E_) * sizeof(int64_t));
  counts_in_dev_ = Tensor();
  segments_.clear();
  // Where this rank's own experts' rows start in its sorted layout: after
  // every row it sorted for experts below first_.
  int64_t src = 0;
  for (int64_t e = 0; e < first_; ++e) src += counts[e];
  int64_t row = 0;
  for (int64_t q = 0; q < P_; ++q) {
    int64_t out = 0, in = 0;
    for (int64_t j = 0; j < El_; ++j) {
      const int64_t mine = counts[q * El_ + j];
      const int64_t m = counts_in_[static_cast<size_t>(q * El_ + j)];
      const bool local = q == self_;
      LOOM_CHECK(!local || m == mine, "expert parallelism: rank ", self_, " sorted ", mine, " rows for its expert ",
                 first_ + j, " but the counts exchange says it sends itself ", m);
      if (m > 0) segments_.push_back({first_ + j, row, m, local ? src : 0, local});
      if (local) src += m;
      out += mine;
      row += m;
      in += m;
    }
    send_[static_cast<size_t>(q)] = out * h_;
    recv_[static_cast<size_t>(q)] = in * h_;
  }
  LOOM_CHECK(row <= max_recv_rows(), "expert parallelism: ", row, " rows received, more than the ", max_recv_rows(),
             " a micro-batch can send (a peer sent inconsistent counts)");
  // 2. The rows, queued: the local segments run while they travel.
  queue(xs, send_, xr, recv_);
}

// The elements of `t` from `offset` on, as a flat view (t itself when none are left: the counts are then zero).
static Tensor tail_of(const Tensor& t, int64_t offset) {
  const int64_t n = t.numel() - offset;
  LOOM_CHECK(n >= 0, "expert parallelism: an exchange starts ", offset, " elements into a buffer of ", t.numel());
  return n > 0 ? view(t, offset, {n}) : t;
}

void ExpertExchange::queue(const Tensor& send, const std::vector<int64_t>& sc, Tensor& recv,
                           const std::vector<int64_t>& rc) {
  LOOM_CHECK(!pending_set_, "expert parallelism: an exchange was queued before the compute queue waited for the "
             "last one (wait)");
  // Call 1: to the lower ranks (from the start of send), from the higher
  // ones (into recv after the own block). Call 2: to the higher ranks (from
  // send after the own block), from the lower ones (into the start of recv).
  // Peer a's call 1 pairs with peer b < a's call 1, and call 2 likewise.
  int64_t send_upto_self = 0, recv_upto_self = 0;  // elements of the blocks before and of this rank's own
  for (int64_t q = 0; q < P_; ++q) {
    const auto i = static_cast<size_t>(q);
    lo_send_[i] = q < self_ ? sc[i] : 0;
    lo_recv_[i] = q > self_ ? rc[i] : 0;
    hi_send_[i] = q > self_ ? sc[i] : 0;
    hi_recv_[i] = q < self_ ? rc[i] : 0;
    if (q <= self_) {
      send_upto_self += sc[i];
      recv_upto_self += rc[i];
    }
  }
  const ExecContext& ctx = backend_->ctx();
  Tensor recv_hi = tail_of(recv, recv_upto_self);
  group_->all_to_all(ctx, send, lo_send_, recv_hi, lo_recv_);
  pending_ = group_->all_to_all(ctx, tail_of(send, send_upto_self), hi_send_, recv, hi_recv_);
  pending_set_ = true;
}

void ExpertExchange::wait() {
  if (!pending_set_) return;
  // Collectives of one communicator complete in order: the last call covers the first.
  group_->wait(backend_->ctx(), pending_);
  pending_set_ = false;
}

}  // namespace loom
