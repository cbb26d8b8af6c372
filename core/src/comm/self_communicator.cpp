// The one-rank communicator: collectives are identities or copies.
#include <cstring>

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
  CommTicket broadcast(const ExecContext&, Tensor&, int root) override {
    LOOM_CHECK(root == 0, "broadcast root ", root, " on a one-rank communicator");
    return next_ticket();
  }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int, int) override { return std::make_unique<SelfCommunicator>(); }

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
