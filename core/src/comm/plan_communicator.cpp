#include "comm/plan_communicator.hpp"

#include "loom/error.hpp"

namespace loom {
namespace {

class PlanCommunicator final : public Communicator {
 public:
  PlanCommunicator(int world, bool device) : world_(world), device_(device) {}
  int rank() const override { return 0; }
  int size() const override { return world_; }
  CommTicket all_reduce(const ExecContext&, Tensor&, ReduceOp) override { refuse("all_reduce"); }
  CommTicket reduce_scatter(const ExecContext&, const Tensor&, Tensor&, ReduceOp) override {
    refuse("reduce_scatter");
  }
  CommTicket all_gather(const ExecContext&, const Tensor&, Tensor&) override { refuse("all_gather"); }
  CommTicket broadcast(const ExecContext&, Tensor&, int) override { refuse("broadcast"); }
  CommTicket all_to_all(const ExecContext&, const Tensor&, std::span<const int64_t>, Tensor&,
                        std::span<const int64_t>) override {
    refuse("all_to_all");
  }
  bool device_tensors() const override { return device_; }
  void barrier() override { refuse("barrier"); }
  std::unique_ptr<Communicator> split(int, int) override {
    return adopt(std::make_unique<PlanCommunicator>(world_, device_));
  }

 private:
  [[noreturn]] void refuse(const char* op) const {
    throw Error(cat("a planned run of ", world_, " ranks (loom check --world) exchanges nothing, but ", op,
                    " was called: planning only lays out memory; start the ranks with a launcher to run"));
  }
  int world_;
  bool device_;
};

}  // namespace

std::unique_ptr<Communicator> make_plan_communicator(int world, bool device_tensors) {
  return std::make_unique<PlanCommunicator>(world, device_tensors);
}

}  // namespace loom
