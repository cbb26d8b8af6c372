// The argument checks every communicator makes before a collective, with one
// wording (the MPI and NCCL communicators share them), and the ring volume
// their byte counters use.
#pragma once
#include <cstdint>
#include <span>

#include "loom/comm.hpp"
#include "loom/error.hpp"
#include "loom/tensor.hpp"

namespace loom::collective {

// `which` ("input", "output", "tensor") of collective `name` must live where
// this communicator moves memory, be contiguous and have data.
inline void check_buffer(const char* name, int rank, const char* which, const Tensor& t, Device where) {
  if (t.device != where) {
    const bool host = where == Device::cpu;
    throw Error(cat("collective ", name, " on rank ", rank, ": the ", which, " ", t.shape_str(), " is on ",
                    device_name(t.device), " but the ", host ? "MPI" : "NCCL", " communicator moves ",
                    host ? "host" : "device", " memory only; use the ", host ? "NCCL" : "MPI", " communicator for ",
                    host ? "device" : "host", " tensors or copy to the ", host ? "host" : "device", " first"));
  }
  if (!t.is_contiguous())
    throw Error(cat("collective ", name, " on rank ", rank, ": the ", which, " ", t.shape_str(),
                    " is not contiguous; pass a contiguous buffer (a flat view of the parameters)"));
  if (t.numel() > 0 && !t.data)
    throw Error(cat("collective ", name, " on rank ", rank, ": the ", which, " ", t.shape_str(), " has no data pointer"));
}

inline void check_same_dtype(const char* name, int rank, const Tensor& in, const Tensor& out) {
  if (in.dtype != out.dtype)
    throw Error(cat("collective ", name, " on rank ", rank, ": input is ", dtype_name(in.dtype), " but output is ",
                    dtype_name(out.dtype), "; both must have the same dtype"));
}

// reduce_scatter: input = size * output elements; all_gather: output = size * input.
inline void check_shard_sizes(const char* name, int rank, int size, const Tensor& in, const Tensor& out,
                              bool input_is_full) {
  const Tensor& full = input_is_full ? in : out;
  const Tensor& shard = input_is_full ? out : in;
  if (full.numel() == static_cast<int64_t>(size) * shard.numel()) return;
  const char* f = input_is_full ? "input" : "output";
  const char* s = input_is_full ? "output" : "input";
  throw Error(cat("collective ", name, " on rank ", rank, " of ", size, ": ", f, " has ", full.numel(),
                  " elements but must be size*", s, " = ", size, "*", shard.numel(), " = ",
                  static_cast<int64_t>(size) * shard.numel(),
                  "; shard buffers must be padded to a multiple of the group size"));
}

inline const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
  }
  return "?";
}

// The dtypes every communicator reduces (fp32, fp64, int32, bf16, fp16), and
// no average of integers (integer division would silently truncate).
// `how` ends the message with the communicator's own detail ("" for none).
inline void check_reducible(const char* name, int rank, DType t, ReduceOp op, const char* how) {
  if (t == DType::i32 && op == ReduceOp::avg)
    throw Error(cat("collective ", name, " on rank ", rank, ": avg of int32 would truncate; reduce with sum and ",
                    "divide where the rounding is intended"));
  switch (t) {
    case DType::f32: case DType::f64: case DType::i32: case DType::bf16: case DType::f16: return;
    default: break;
  }
  throw Error(cat("collective ", name, " (", op_name(op), ") on rank ", rank, ": dtype ", dtype_name(t),
                  " cannot be reduced; reduce fp32, fp64, int32, bf16 or fp16", how));
}

// all_to_all: the counts (one per rank, none negative; or both spans empty
// for an equal split), the buffers against them, and no overlap. Returns the
// per-peer element counts through send_count(q) / recv_count(q).
struct AllToAllCounts {
  std::span<const int64_t> send, recv;
  int64_t chunk = 0;  // an equal split's count per peer
  int64_t send_count(int q) const { return send.empty() ? chunk : send[static_cast<size_t>(q)]; }
  int64_t recv_count(int q) const { return recv.empty() ? chunk : recv[static_cast<size_t>(q)]; }
};

inline AllToAllCounts check_all_to_all(const char* name, int rank, int size, const Tensor& send,
                                       std::span<const int64_t> send_counts, const Tensor& recv,
                                       std::span<const int64_t> recv_counts) {
  check_same_dtype(name, rank, send, recv);
  const auto where = [&] { return cat("collective ", name, " on rank ", rank, " of ", size, ": "); };
  const auto pa = reinterpret_cast<uintptr_t>(send.data), pb = reinterpret_cast<uintptr_t>(recv.data);
  if (send.bytes() > 0 && recv.bytes() > 0 && pa < pb + recv.bytes() && pb < pa + send.bytes())
    throw Error(cat(where(), "the send and receive buffers overlap; all_to_all has no in-place form, pass ",
                    "separate buffers"));
  if (send_counts.empty() && recv_counts.empty()) {
    if (send.numel() % size != 0 || recv.numel() != send.numel())
      throw Error(cat(where(), "an equal split (no counts) needs a send buffer that divides by the ", size,
                      " ranks and a receive buffer of the same size; got ", send.numel(), " and ", recv.numel(),
                      " elements"));
    return {send_counts, recv_counts, send.numel() / size};
  }
  const auto check_side = [&](std::span<const int64_t> counts, const char* which, const Tensor& buf,
                              const char* buf_name) {
    if (counts.size() != static_cast<size_t>(size))
      throw Error(cat(where(), which, " has ", counts.size(), " entries but the group has ", size,
                      " ranks; pass one count per rank for both sides, or none for an equal split"));
    int64_t total = 0;
    for (size_t q = 0; q < counts.size(); ++q) {
      if (counts[q] < 0)
        throw Error(cat(where(), which, "[", q, "] = ", counts[q], " is negative; counts are elements per rank"));
      total += counts[q];
    }
    if (total > buf.numel())
      throw Error(cat(where(), which, " sum to ", total, " elements but the ", buf_name, " buffer ", buf.shape_str(),
                      " holds ", buf.numel(), "; size it for the largest exchange"));
  };
  check_side(send_counts, "send_counts", send, "send");
  check_side(recv_counts, "recv_counts", recv, "receive");
  return {send_counts, recv_counts, 0};
}

// Bytes one rank sends in a ring over `size` ranks for a buffer of `bytes`:
// (p-1)/p of it (all-reduce moves twice that: reduce-scatter + all-gather).
inline uint64_t ring_share(int size, uint64_t bytes) {
  return size > 1 ? static_cast<uint64_t>(size - 1) * bytes / static_cast<uint64_t>(size) : 0;
}

}  // namespace loom::collective
