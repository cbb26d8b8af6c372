// The one-rank communicator: collectives are identities or copies.
#include <cstring>

#include "comm/collective_checks.hpp"
#include "loom/comm.hpp"
#include "loom/error.hpp"

namespace loom {
namespace {

class SelfCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  CommTicket all_reduce(const ExecContext&, Tensor&, ReduceOp) override { return next_ticket(); }
  CommTicket reduce_scatter(const ExecContext& ctx, const Tensor& in, Tensor& out, ReduceOp) override {
    copy(ctx, in, out);
    return next_ticket();
  }
  CommTicket all_gather(const ExecContext& ctx, const Tensor& in, Tensor& out) override {
    copy(ctx, in, out);
    return next_ticket();
  }
  CommTicket all_to_all(const ExecContext& ctx, const Tensor& send, std::span<const int64_t> send_counts, Tensor& recv,
                        std::span<const int64_t> recv_counts) override {
    const collective::AllToAllCounts c =
        collective::check_all_to_all("all_to_all", 0, 1, send, send_counts, recv, recv_counts);
    LOOM_CHECK(c.send_count(0) == c.recv_count(0), "collective all_to_all on a one-rank communicator: sends ",
               c.send_count(0), " elements to itself but expects ", c.recv_count(0));
    LOOM_CHECK(ctx.device == Device::cpu, "self communicator copies host memory only");
    const size_t n = static_cast<size_t>(c.send_count(0)) * dtype_size(send.dtype);
    if (n > 0) std::memcpy(recv.data, send.data, n);
    return next_ticket();
  }
  CommTicket broadcast(const ExecContext&, Tensor&, int root) override {
    LOOM_CHECK(root == 0, "broadcast root ", root, " on a one-rank communicator");
    return next_ticket();
  }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int, int) override { return adopt(std::make_unique<SelfCommunicator>()); }

 private:
  static void copy(const ExecContext& ctx, const Tensor& in, Tensor& out) {
    LOOM_CHECK(in.bytes() == out.bytes(), "collective size mismatch: ", in.bytes(), " vs ", out.bytes(), " bytes");
    LOOM_CHECK(ctx.device == Device::cpu, "self communicator copies host memory only");
    if (in.data != out.data) std::memcpy(out.data, in.data, in.bytes());
  }
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator() { return std::make_unique<SelfCommunicator>(); }

}  // namespace loom
