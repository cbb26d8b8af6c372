// Communicators: collectives over a group of ranks. The core provides a
// single-process one (and MPI / NCCL ones when built with them); sharding
// plugins use whichever the run was started with. Every collective counts the
// bytes it moves, per kind, for `loom compare`.
#pragma once
#include <array>
#include <cstdint>
#include <memory>

#include "loom/context.hpp"
#include "loom/tensor.hpp"

namespace loom {

enum class ReduceOp { sum, avg, max };
enum class CollectiveKind : uint8_t { all_reduce, reduce_scatter, all_gather, broadcast, kCount };

struct CommBytes {
  std::array<uint64_t, static_cast<size_t>(CollectiveKind::kCount)> bytes{};
  uint64_t total() const { uint64_t t = 0; for (auto b : bytes) t += b; return t; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place on `t` (same shape on every rank).
  virtual void all_reduce(const ExecContext& ctx, Tensor& t, ReduceOp op) = 0;
  // in: size()*n elements, out: n elements (this rank's chunk).
  virtual void reduce_scatter(const ExecContext& ctx, const Tensor& in, Tensor& out, ReduceOp op) = 0;
  // in: n elements, out: size()*n elements (rank-major).
  virtual void all_gather(const ExecContext& ctx, const Tensor& in, Tensor& out) = 0;
  virtual void broadcast(const ExecContext& ctx, Tensor& t, int root) = 0;
  virtual void barrier() = 0;
  // Ranks with equal color form a new group, ordered by key.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
  const CommBytes& bytes_moved() const { return bytes_; }
  void reset_bytes() { bytes_ = {}; }

 protected:
  void count(CollectiveKind k, uint64_t b) { bytes_.bytes[static_cast<size_t>(k)] += b; }
  CommBytes bytes_;
};

// One rank: every collective is a copy or a no-op.
std::unique_ptr<Communicator> make_self_communicator();

}  // namespace loom
