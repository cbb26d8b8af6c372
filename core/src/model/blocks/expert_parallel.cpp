#include "model/blocks/expert_parallel.hpp"

#include <algorithm>

#include "loom/error.hpp"

namespace loom {

ExpertExchange::ExpertExchange(Communicator* group, Backend* backend, int64_t num_experts, int64_t tokens,
                               int64_t top_k, int64_t hidden)
    : group_(group), backend_(backend), P_(group->size()), E_(num_experts), El_(0), N_(tokens), k_(top_k), h_(hidden),
      first_(0) {
  LOOM_CHECK(P_ >= 1 && E_ % P_ == 0, "sharding.expert_parallel = ", P_, " does not divide model.num_experts = ", E_);
  LOOM_CHECK(backend_ != nullptr, "expert parallelism: no backend");
  const bool dev = backend_->device() != Device::cpu;
  LOOM_CHECK(group_->device_tensors() == dev, "expert parallelism: the expert group's communicator moves ",
             group_->device_tensors() ? "device" : "host", " buffers but the model runs on the ",
             dev ? "device" : "CPU", " (an NCCL group needs run.device = \"cuda\", an MPI one run.device = \"cpu\")");
  El_ = E_ / P_;
  first_ = group->rank() * El_;
  counts_in_.assign(static_cast<size_t>(E_), 0);
  send_.assign(static_cast<size_t>(P_), 0);
  recv_.assign(static_cast<size_t>(P_), 0);
  segments_.reserve(static_cast<size_t>(P_ * El_));  // at most one run per (peer, expert): no allocation per step
}

void ExpertExchange::exchange(const Tensor& send, const std::vector<int64_t>& sc, Tensor& recv,
                              const std::vector<int64_t>& rc) {
  const ExecContext& ctx = backend_->ctx();
  group_->wait(ctx, group_->all_to_all(ctx, send, sc, recv, rc));
}

void ExpertExchange::exchange_counts(const Tensor& counts_src, Tensor& counts_in) {
  LOOM_CHECK(counts_src.numel() == E_ && counts_in.numel() == E_ && dtype_size(counts_src.dtype) == 8 &&
                 dtype_size(counts_in.dtype) == 8,
             "expert parallelism: the counts buffers hold ", counts_src.numel(), " and ", counts_in.numel(),
             " 8-byte elements, not the ", E_, " experts' counts");
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
  int64_t row = 0;
  for (int64_t q = 0; q < P_; ++q) {
    int64_t out = 0, in = 0;
    for (int64_t j = 0; j < El_; ++j) {
      out += counts[q * El_ + j];
      const int64_t m = counts_in_[static_cast<size_t>(q * El_ + j)];
      if (m > 0) segments_.push_back({first_ + j, row, m});
      row += m;
      in += m;
    }
    send_[static_cast<size_t>(q)] = out * h_;
    recv_[static_cast<size_t>(q)] = in * h_;
  }
  LOOM_CHECK(row <= max_recv_rows(), "expert parallelism: ", row, " rows received, more than the ", max_recv_rows(),
             " a micro-batch can send (a peer sent inconsistent counts)");
  // 2. The rows.
  exchange(xs, send_, xr, recv_);
}

void ExpertExchange::give_back(const Tensor& yr, Tensor& y) { exchange(yr, recv_, y, send_); }

}  // namespace loom
