// MPI communicator (see mpi_communicator.hpp for types, byte counting and the
// failure model).
#include "comm/mpi_communicator.hpp"
#include "loom/trace.hpp"

#include "comm/collective_checks.hpp"
#include "loom/error.hpp"

#ifdef LOOM_HAVE_MPI
#include <mpi.h>

#include <bit>
#include <chrono>
#include <climits>
#include <span>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "comm/launch.hpp"
#include "hf/safetensors.hpp"
#endif

namespace loom {

#ifdef LOOM_HAVE_MPI
namespace {

std::string mpi_err(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return cat("MPI error code ", rc);
  return std::string(buf, static_cast<size_t>(len));
}

// fp32 -> fp16, round to nearest even; overflow to infinity, NaN kept NaN.
uint16_t f32_to_f16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504
  if (a < 0x38800000u) {  // below the smallest normal: subnormal or zero
    float v = std::bit_cast<float>(a);
    // Scaling by 2^24 makes the subnormal step 1; nearbyint rounds ties to even.
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(v * 16777216.0f)));
  }
  uint32_t r = a + 0xFFFu + ((a >> 13) & 1u) - (112u << 23);
  return static_cast<uint16_t>(sign | (r >> 13));
}

// How a dtype travels in a reduction.
struct ReduceWire {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  bool staged = false;  // bf16/fp16: through an fp32 buffer
  size_t elt = 0;       // bytes per element on the wire
};

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, double timeout_s) : comm_(comm), timeout_s_(timeout_s) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
    // Errors come back as return codes and become loom::Error with context,
    // instead of MPI's default of aborting the job without one.
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    // all_to_all's byte counts and displacements, made once (no allocation per collective).
    a2a_.assign(4 * static_cast<size_t>(size_), 0);
  }

  ~MpiCommunicator() override {
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin) return;
    // Requests abandoned by a timeout may still complete (the late rank
    // arrives); give them a moment so their buffers are no longer in use.
    // Whatever is still pending is leaked on purpose: the process is expected
    // to abort_all(), and freeing the buffers could let MPI write into freed memory.
    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
    while (!abandoned_.empty() && std::chrono::steady_clock::now() < until) {
      for (size_t i = 0; i < abandoned_.size();) {
        int flag = 0;
        if (MPI_Test(&abandoned_[i].req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) {
          abandoned_.erase(abandoned_.begin() + static_cast<std::ptrdiff_t>(i));
        } else {
          ++i;
        }
      }
      if (!abandoned_.empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    for (auto& a : abandoned_) new std::vector<char>(std::move(a.staging));  // leaked, see above
    MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  CommTicket all_reduce(const ExecContext&, Tensor& t, ReduceOp op) override {
    const char* name = "all_reduce";
    usable(name);
    trace::Scope traced(trace::Track::comm, name);  // host-timed: MPI runs on this thread
    collective::check_buffer(name, rank_, "tensor", t, Device::cpu);
    ReduceWire w = reduce_wire(name, t.dtype, op);
    int n = count_of(name, t.numel());
    std::vector<char> stage;
    void* buf = t.data;
    if (w.staged) {
      stage.resize(static_cast<size_t>(n) * 4);
      to_f32(t.data, t.dtype, reinterpret_cast<float*>(stage.data()), n);
      buf = stage.data();
    }
    uint64_t wire = static_cast<uint64_t>(n) * w.elt;
    MPI_Request req;
    check(MPI_Iallreduce(MPI_IN_PLACE, buf, n, w.type, mpi_op(op), comm_, &req), "MPI_Iallreduce", name, wire);
    wait(req, name, wire, stage);
    if (op == ReduceOp::avg) divide(buf, w.staged ? DType::f32 : t.dtype, n);
    if (w.staged) from_f32(reinterpret_cast<const float*>(stage.data()), t.data, t.dtype, n);
    count(CollectiveKind::all_reduce, 2 * collective::ring_share(size_, wire));
    return next_ticket();
  }

  CommTicket reduce_scatter(const ExecContext&, const Tensor& in, Tensor& out, ReduceOp op) override {
    const char* name = "reduce_scatter";
    usable(name);
    trace::Scope traced(trace::Track::comm, name);  // host-timed: MPI runs on this thread
    collective::check_buffer(name, rank_, "input", in, Device::cpu);
    collective::check_buffer(name, rank_, "output", out, Device::cpu);
    collective::check_same_dtype(name, rank_, in, out);
    collective::check_shard_sizes(name, rank_, size_, in, out, true);
    ReduceWire w = reduce_wire(name, in.dtype, op);
    int n = count_of(name, out.numel());
    count_of(name, in.numel());
    std::vector<char> stage;
    const void* send = in.data;
    void* recv = out.data;
    if (w.staged) {
      stage.resize(static_cast<size_t>(in.numel() + n) * 4);
      to_f32(in.data, in.dtype, reinterpret_cast<float*>(stage.data()), in.numel());
      send = stage.data();
      recv = stage.data() + static_cast<size_t>(in.numel()) * 4;
    } else if (overlaps(in, out)) {
      // MPI forbids aliasing send and receive buffers; the shard is often a view
      // of the full gradient buffer, so copy the input aside.
      stage.assign(static_cast<const char*>(in.data), static_cast<const char*>(in.data) + in.bytes());
      send = stage.data();
    }
    uint64_t wire = static_cast<uint64_t>(in.numel()) * w.elt;
    MPI_Request req;
    check(MPI_Ireduce_scatter_block(send, recv, n, w.type, mpi_op(op), comm_, &req), "MPI_Ireduce_scatter_block",
          name, wire);
    wait(req, name, wire, stage);
    if (op == ReduceOp::avg) divide(recv, w.staged ? DType::f32 : out.dtype, n);
    if (w.staged) from_f32(reinterpret_cast<const float*>(recv), out.data, out.dtype, n);
    count(CollectiveKind::reduce_scatter, collective::ring_share(size_, wire));
    return next_ticket();
  }

  CommTicket all_gather(const ExecContext&, const Tensor& in, Tensor& out) override {
    const char* name = "all_gather";
    usable(name);
    trace::Scope traced(trace::Track::comm, name);  // host-timed: MPI runs on this thread
    collective::check_buffer(name, rank_, "input", in, Device::cpu);
    collective::check_buffer(name, rank_, "output", out, Device::cpu);
    collective::check_same_dtype(name, rank_, in, out);
    collective::check_shard_sizes(name, rank_, size_, in, out, false);
    // Raw bytes: gathering moves data without arithmetic, so any dtype works.
    int nb = count_of(name, static_cast<int64_t>(in.bytes()));
    count_of(name, static_cast<int64_t>(out.bytes()));
    std::vector<char> stage;
    const void* send = in.data;
    char* own = static_cast<char*>(out.data) + static_cast<size_t>(rank_) * in.bytes();
    if (in.data == own) {
      send = MPI_IN_PLACE;  // the shard already sits at its place in the full buffer
    } else if (overlaps(in, out)) {
      stage.assign(static_cast<const char*>(in.data), static_cast<const char*>(in.data) + in.bytes());
      send = stage.data();
    }
    uint64_t full = out.bytes();
    MPI_Request req;
    check(MPI_Iallgather(send, nb, MPI_BYTE, out.data, nb, MPI_BYTE, comm_, &req), "MPI_Iallgather", name, full);
    wait(req, name, full, stage);
    count(CollectiveKind::all_gather, collective::ring_share(size_, full));
    return next_ticket();
  }

  CommTicket broadcast(const ExecContext&, Tensor& t, int root) override {
    const char* name = "broadcast";
    usable(name);
    trace::Scope traced(trace::Track::comm, name);  // host-timed: MPI runs on this thread
    collective::check_buffer(name, rank_, "tensor", t, Device::cpu);
    if (root < 0 || root >= size_)
      throw Error(cat("collective broadcast on rank ", rank_, " of ", size_, ": root ", root,
                      " is not a rank of this group (0..", size_ - 1, "); pass a rank of the group, not a world rank"));
    int nb = count_of(name, static_cast<int64_t>(t.bytes()));
    uint64_t bytes = t.bytes();
    std::vector<char> stage;
    MPI_Request req;
    check(MPI_Ibcast(t.data, nb, MPI_BYTE, root, comm_, &req), "MPI_Ibcast", name, bytes);
    wait(req, name, bytes, stage);
    count(CollectiveKind::broadcast, collective::ring_share(size_, bytes));
    return next_ticket();
  }

  CommTicket all_to_all(const ExecContext&, const Tensor& send, std::span<const int64_t> send_counts, Tensor& recv,
                        std::span<const int64_t> recv_counts) override {
    const char* name = "all_to_all";
    usable(name);
    trace::Scope traced(trace::Track::comm, name);  // host-timed: MPI runs on this thread
    collective::check_buffer(name, rank_, "input", send, Device::cpu);
    collective::check_buffer(name, rank_, "output", recv, Device::cpu);
    const collective::AllToAllCounts c =
        collective::check_all_to_all(name, rank_, size_, send, send_counts, recv, recv_counts);
    // Raw bytes, like all_gather: any dtype. MPI's counts and displacements are int.
    const int64_t elt = static_cast<int64_t>(dtype_size(send.dtype));
    int* scounts = a2a_.data();
    int* sdispls = scounts + size_;
    int* rcounts = sdispls + size_;
    int* rdispls = rcounts + size_;
    int64_t soff = 0, roff = 0;
    uint64_t total = 0, to_others = 0;
    for (int q = 0; q < size_; ++q) {
      const int64_t sb = c.send_count(q) * elt, rb = c.recv_count(q) * elt;
      scounts[q] = count_of(name, sb);
      rcounts[q] = count_of(name, rb);
      sdispls[q] = count_of(name, soff);
      rdispls[q] = count_of(name, roff);
      soff += sb;
      roff += rb;
      total += static_cast<uint64_t>(sb + rb);
      if (q != rank_) to_others += static_cast<uint64_t>(sb);
    }
    std::vector<char> stage;
    MPI_Request req;
    check(MPI_Ialltoallv(send.data, scounts, sdispls, MPI_BYTE, recv.data, rcounts, rdispls, MPI_BYTE, comm_, &req),
          "MPI_Ialltoallv", name, total);
    wait(req, name, total, stage);
    count(CollectiveKind::all_to_all, to_others);
    return next_ticket();
  }

  void barrier() override {
    usable("barrier");
    std::vector<char> stage;
    MPI_Request req;
    check(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier", "barrier", 0);
    wait(req, "barrier", 0, stage);
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    usable("split");
    if (color < 0)
      throw Error(cat("split on rank ", rank_, " of ", size_, ": color ", color,
                      " is negative; every rank must pass a color >= 0 (ranks with equal color form a group)"));
    // MPI_Comm_split has no non-blocking form: a timed barrier first makes sure
    // every rank has arrived, so the split itself cannot wait on a dead rank.
    barrier();
    MPI_Comm sub = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split", "split", 0);
    return adopt(std::make_unique<MpiCommunicator>(sub, timeout_s_));
  }

 private:
  struct Abandoned {
    MPI_Request req;
    std::vector<char> staging;
  };

  void usable(const char* name) const {
    if (!failure_.empty())
      throw Error(cat("collective ", name, " on rank ", rank_, " of ", size_,
                      " refused: this communicator failed earlier (", failure_,
                      "); the ranks no longer agree on the sequence of collectives — report the first error and "
                      "call abort_all()"));
  }

  // MPI counts are int; larger buffers would silently wrap.
  int count_of(const char* name, int64_t n) const {
    if (n > INT_MAX)
      throw Error(cat("collective ", name, " on rank ", rank_, " of ", size_, ": ", n,
                      " elements exceed MPI's count limit of ", INT_MAX, "; split the buffer into smaller buckets"));
    return static_cast<int>(n);
  }

  ReduceWire reduce_wire(const char* name, DType t, ReduceOp op) const {
    collective::check_reducible(name, rank_, t, op, " (bf16/fp16 are summed in fp32)");
    switch (t) {
      case DType::f64: return {MPI_DOUBLE, false, 8};
      case DType::i32: return {MPI_INT, false, 4};
      case DType::bf16: case DType::f16: return {MPI_FLOAT, true, 4};
      default: return {MPI_FLOAT, false, 4};  // f32, the only other reducible dtype
    }
  }

  static MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::max ? MPI_MAX : MPI_SUM; }

  static bool overlaps(const Tensor& a, const Tensor& b) {
    auto pa = reinterpret_cast<uintptr_t>(a.data), pb = reinterpret_cast<uintptr_t>(b.data);
    return pa < pb + b.bytes() && pb < pa + a.bytes();
  }

  void divide(void* buf, DType t, int64_t n) const {
    if (t == DType::f32) {
      float* p = static_cast<float*>(buf);
      float s = 1.0f / static_cast<float>(size_);
      for (int64_t i = 0; i < n; ++i) p[i] *= s;
    } else if (t == DType::f64) {
      double* p = static_cast<double*>(buf);
      for (int64_t i = 0; i < n; ++i) p[i] /= size_;
    }
  }

  static void to_f32(const void* src, DType t, float* dst, int64_t n) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    if (t == DType::bf16) {
      for (int64_t i = 0; i < n; ++i) dst[i] = hf::bf16_to_f32(s[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i] = hf::f16_to_f32(s[i]);
    }
  }

  static void from_f32(const float* src, void* dst, DType t, int64_t n) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    if (t == DType::bf16) {
      for (int64_t i = 0; i < n; ++i) d[i] = hf::f32_to_bf16(src[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
    }
  }

  void check(int rc, const char* call, const char* name, uint64_t bytes) {
    if (rc == MPI_SUCCESS) return;
    failure_ = cat(call, " failed");
    throw Error(cat("collective ", name, " of ", bytes, " bytes on ", size_, " ranks failed on rank ", rank_,
                    " (world rank ", world_rank_, "): ", call, ": ", mpi_err(rc),
                    "; another rank has likely failed — check its log, then restart the run"));
  }

  // Poll until done or timeout_s. Spinning first keeps small collectives fast;
  // then short sleeps leave the cores to the other ranks (often oversubscribed).
  void wait(MPI_Request& req, const char* name, uint64_t bytes, std::vector<char>& staging) {
    auto start = std::chrono::steady_clock::now();
    for (int polls = 0;; ++polls) {
      int flag = 0;
      check(MPI_Test(&req, &flag, MPI_STATUS_IGNORE), "MPI_Test", name, bytes);
      if (flag) return;
      double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (waited >= timeout_s_) {
        failure_ = cat("collective ", name, " timed out after ", timeout_s_, " s");
        // MPI may still write into the staging buffer: keep it alive with the request.
        abandoned_.push_back({req, std::move(staging)});
        throw Error(cat("collective ", name, " of ", bytes, " bytes on ", size_,
                        " ranks did not complete within ", timeout_s_, " s on rank ", rank_, " (world rank ",
                        world_rank_, "): another rank has likely failed or is running a different number of ",
                        "collectives; set run.collective_timeout to change the limit"));
      }
      if (polls < 200) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
  }

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1, world_rank_ = 0;
  double timeout_s_;
  std::string failure_;  // non-empty once a collective failed or timed out
  std::vector<Abandoned> abandoned_;
  std::vector<int> a2a_;  // all_to_all: send counts, send displacements, receive counts, receive displacements
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(double timeout_s) {
  if (!(timeout_s > 0) || !std::isfinite(timeout_s))
    throw Error(cat("collective timeout ", timeout_s, " s is not a positive number of seconds; set ",
                    "run.collective_timeout to e.g. 600"));
  ensure_mpi_initialized();
  MPI_Comm dup = MPI_COMM_NULL;
  // A private duplicate: our collectives never match messages of other users of
  // MPI_COMM_WORLD (a data loader, a profiler).
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  if (rc != MPI_SUCCESS) throw Error(cat("MPI_Comm_dup(MPI_COMM_WORLD) failed: ", mpi_err(rc)));
  return std::make_unique<MpiCommunicator>(dup, timeout_s);
}

#else

std::unique_ptr<Communicator> make_mpi_communicator(double) {
  throw Error("this build of loom has no MPI support, so it cannot run several processes; rebuild with "
              "-DLOOM_WITH_MPI=ON (MPI development files installed) or run a single process");
}

#endif

}  // namespace loom
