// The NCCL communicator on several ranks, one GPU each (device = rank; run by
// mpirun, see CMakeLists.txt). Every rank draws its data from a seed derived
// from its rank, so each rank can regenerate every other rank's data and check
// collective results against a host reference. Every rank runs the same tests
// in the same order, so their collectives match. Where fewer CUDA devices than
// ranks are visible (CI), every test skips and the suite passes.
//
// Collectives run on the communicator's stream; the tests order them after
// and before their own work on a non-blocking "compute" stream (g_ctx.stream)
// with wait(ctx, ticket) only, so a missing dependency shows up as wrong data.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/launch.hpp"
#include "comm/nccl_communicator.hpp"
#include "hf/safetensors.hpp"
#include "loom/comm.hpp"
#include "loom/error.hpp"

namespace {

using loom::CollectiveKind;
using loom::CommTicket;
using loom::DType;
using loom::Device;
using loom::ReduceOp;
using loom::Tensor;

std::unique_ptr<loom::Communicator> g_world;
int g_rank = 0, g_size = 1;
std::string g_skip;  // why every test skips; empty when there is a GPU per rank
cudaStream_t g_stream = nullptr;
loom::ExecContext g_ctx;  // the CUDA context on g_stream

#define SKIP_WITHOUT_GPUS()                  \
  do {                                       \
    if (!g_skip.empty()) GTEST_SKIP() << g_skip; \
  } while (0)

#define CUDA_OK(call)                                                                                  \
  do {                                                                                                 \
    const cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) throw std::runtime_error(std::string(#call " failed: ") + cudaGetErrorString(e_)); \
  } while (0)

// Device memory for a test, freed at its end.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) { CUDA_OK(cudaMalloc(&p_, std::max<size_t>(bytes, 1))); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return p_; }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

template <typename T>
std::unique_ptr<DeviceBuffer> upload(const std::vector<T>& v) {
  auto b = std::make_unique<DeviceBuffer>(v.size() * sizeof(T));
  CUDA_OK(cudaMemcpy(b->get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}

// Everything queued on the compute stream has run, then the copy.
template <typename T>
std::vector<T> download(const void* p, size_t n) {
  CUDA_OK(cudaStreamSynchronize(g_stream));
  std::vector<T> v(n);
  CUDA_OK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

Tensor dev(void* p, DType t, int64_t n) { return Tensor(p, t, Device::cuda, {n}); }

std::vector<float> data_of(int rank, int64_t n, uint32_t salt = 0) {
  std::mt19937 gen(1000u + static_cast<uint32_t>(rank) * 7919u + salt);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(gen);
  return v;
}

std::string error_of(const std::function<void()>& f) {
  try { f(); } catch (const loom::Error& e) { return e.what(); }
  return "";
}

uint64_t bytes_of(CollectiveKind k) { return g_world->bytes_moved().bytes[static_cast<size_t>(k)]; }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// N is deliberately not a multiple of 4, so the byte formulas round.
constexpr int64_t kN = 1001;

TEST(NcclComm, RanksAndWorld) {
  SKIP_WITHOUT_GPUS();
  EXPECT_EQ(g_world->rank(), g_rank);
  EXPECT_EQ(g_world->size(), g_size);
  EXPECT_TRUE(g_world->device_tensors());
  EXPECT_GE(g_world->size(), 2);
}

TEST(NcclComm, AllReduceF32SumAvgMax) {
  SKIP_WITHOUT_GPUS();
  const int p = g_size, r = g_rank;
  std::vector<double> sum(kN, 0.0);
  std::vector<float> mx(kN, -INFINITY);
  for (int q = 0; q < p; ++q) {
    auto v = data_of(q, kN);
    for (int64_t i = 0; i < kN; ++i) { sum[i] += v[i]; mx[i] = std::max(mx[i], v[i]); }
  }
  auto mine = data_of(r, kN);
  auto s = upload(mine), a = upload(mine), m = upload(mine);
  Tensor ts = dev(s->get(), DType::f32, kN), ta = dev(a->get(), DType::f32, kN), tm = dev(m->get(), DType::f32, kN);
  CommTicket t1 = g_world->all_reduce(g_ctx, ts, ReduceOp::sum);
  CommTicket t2 = g_world->all_reduce(g_ctx, ta, ReduceOp::avg);
  CommTicket t3 = g_world->all_reduce(g_ctx, tm, ReduceOp::max);
  EXPECT_EQ(t2, t1 + 1);
  EXPECT_EQ(t3, t2 + 1);
  g_world->wait(g_ctx, t3);  // covers t1 and t2: collectives complete in order
  auto hs = download<float>(s->get(), kN), ha = download<float>(a->get(), kN), hm = download<float>(m->get(), kN);
  for (int64_t i = 0; i < kN; ++i) {
    ASSERT_NEAR(hs[i], sum[i], 1e-5) << "element " << i;
    ASSERT_NEAR(ha[i], sum[i] / p, 1e-5) << "element " << i;
    ASSERT_EQ(hm[i], mx[i]) << "element " << i;
  }
}

// bf16 keeps 8 significant bits. NCCL adds bf16 values in fp32 and rounds each
// partial result back to bf16 (round to nearest), so each of the p-1 additions
// may be off by half a unit in the last place of its partial sum: a bound is
// (p-1) * 2^-8 * sum_q |x_q|. avg scales every input by 1/p first (exact for
// p a power of two, else one more rounding per input: 2^-8 * |x_q| each).
// max only selects, so it is exact.
TEST(NcclComm, AllReduceBf16SumAvgMax) {
  SKIP_WITHOUT_GPUS();
  const int p = g_size, r = g_rank;
  auto round_bf16 = [](float x) { return loom::hf::bf16_to_f32(loom::hf::f32_to_bf16(x)); };
  std::vector<std::vector<float>> all(p);
  for (int q = 0; q < p; ++q) {
    all[q] = data_of(q, kN, 3);
    for (auto& x : all[q]) x = round_bf16(x);
  }
  std::vector<uint16_t> h(kN);
  for (int64_t i = 0; i < kN; ++i) h[i] = loom::hf::f32_to_bf16(all[r][i]);
  auto s = upload(h), a = upload(h), m = upload(h);
  Tensor ts = dev(s->get(), DType::bf16, kN), ta = dev(a->get(), DType::bf16, kN), tm = dev(m->get(), DType::bf16, kN);
  g_world->all_reduce(g_ctx, ts, ReduceOp::sum);
  g_world->all_reduce(g_ctx, ta, ReduceOp::avg);
  g_world->wait(g_ctx, g_world->all_reduce(g_ctx, tm, ReduceOp::max));
  auto hs = download<uint16_t>(s->get(), kN), ha = download<uint16_t>(a->get(), kN);
  auto hm = download<uint16_t>(m->get(), kN);
  for (int64_t i = 0; i < kN; ++i) {
    double ref = 0, mag = 0;
    float mx = -INFINITY;
    for (int q = 0; q < p; ++q) {
      ref += all[q][i];
      mag += std::fabs(all[q][i]);
      mx = std::max(mx, all[q][i]);
    }
    const double tol_sum = (p - 1) * mag / 256 + 1e-6;
    const double tol_avg = tol_sum / p + mag / p / 256;
    ASSERT_NEAR(loom::hf::bf16_to_f32(hs[i]), ref, tol_sum) << "sum element " << i;
    ASSERT_NEAR(loom::hf::bf16_to_f32(ha[i]), ref / p, tol_avg) << "avg element " << i;
    ASSERT_EQ(loom::hf::bf16_to_f32(hm[i]), mx) << "max element " << i;
  }
}

TEST(NcclComm, AllReduceF64AndInt32) {
  SKIP_WITHOUT_GPUS();
  const int p = g_size, r = g_rank;
  const int64_t n = 97;
  auto mine = data_of(r, n);
  std::vector<double> d(mine.begin(), mine.end());
  std::vector<int32_t> k(n);
  for (int64_t i = 0; i < n; ++i) k[i] = static_cast<int32_t>(mine[i] * 1000) + r;
  auto bd = upload(d), bk = upload(k);
  Tensor td = dev(bd->get(), DType::f64, n), tk = dev(bk->get(), DType::i32, n);
  g_world->all_reduce(g_ctx, td, ReduceOp::sum);
  g_world->wait(g_ctx, g_world->all_reduce(g_ctx, tk, ReduceOp::max));
  auto hd = download<double>(bd->get(), n);
  auto hk = download<int32_t>(bk->get(), n);
  std::vector<std::vector<float>> all(p);
  for (int q = 0; q < p; ++q) all[q] = data_of(q, n);
  for (int64_t i = 0; i < n; ++i) {
    double ref = 0;
    int32_t kmax = INT32_MIN;
    for (int q = 0; q < p; ++q) {
      ref += all[q][i];
      kmax = std::max(kmax, static_cast<int32_t>(all[q][i] * 1000) + q);
    }
    ASSERT_NEAR(hd[i], ref, 1e-12) << "element " << i;
    ASSERT_EQ(hk[i], kmax) << "element " << i;
  }
}

TEST(NcclComm, ReduceScatterAndAllGatherRoundTrip) {
  SKIP_WITHOUT_GPUS();
  const int p = g_size, r = g_rank;
  const int64_t n = 257;
  std::vector<double> ref(static_cast<size_t>(p * n), 0.0);
  for (int q = 0; q < p; ++q) {
    auto v = data_of(q, p * n, 1);
    for (int64_t i = 0; i < p * n; ++i) ref[i] += v[i];
  }
  auto in = upload(data_of(r, p * n, 1));
  DeviceBuffer shard(n * sizeof(float)), full(p * n * sizeof(float));
  Tensor tin = dev(in->get(), DType::f32, p * n), tsh = dev(shard.get(), DType::f32, n);
  Tensor tfull = dev(full.get(), DType::f32, p * n);
  g_world->reduce_scatter(g_ctx, tin, tsh, ReduceOp::sum);
  g_world->wait(g_ctx, g_world->all_gather(g_ctx, tsh, tfull));
  auto hsh = download<float>(shard.get(), n);
  auto hfull = download<float>(full.get(), p * n);
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(hsh[i], ref[r * n + i], 1e-5) << "shard element " << i;
  for (int64_t i = 0; i < p * n; ++i) ASSERT_NEAR(hfull[i], ref[i], 1e-5) << "gathered element " << i;
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hfull[r * n + i], hsh[i]) << "own shard, gathered, keeps its bits";

  // In place, as ZeRO uses them: the shard is this rank's view of the full buffer.
  auto buf = upload(data_of(r, p * n, 1));
  Tensor tbuf = dev(buf->get(), DType::f32, p * n);
  Tensor own = loom::view(tbuf, r * n, {n});
  g_world->reduce_scatter(g_ctx, tbuf, own, ReduceOp::avg);
  g_world->wait(g_ctx, g_world->all_gather(g_ctx, own, tbuf));
  auto hbuf = download<float>(buf->get(), p * n);
  for (int64_t i = 0; i < p * n; ++i) ASSERT_NEAR(hbuf[i], ref[i] / p, 1e-5) << "in-place element " << i;
}

TEST(NcclComm, BroadcastFromLastRank) {
  SKIP_WITHOUT_GPUS();
  const int root = g_size - 1;
  auto b = upload(data_of(g_rank, kN, 2));
  Tensor t = dev(b->get(), DType::f32, kN);
  g_world->wait(g_ctx, g_world->broadcast(g_ctx, t, root));
  EXPECT_EQ(download<float>(b->get(), kN), data_of(root, kN, 2));
}

TEST(NcclComm, SplitIntoGroups) {
  SKIP_WITHOUT_GPUS();
  const int p = g_size, r = g_rank;
  const int half = p / 2, color = r / half;  // np 2: two groups of one rank
  // key = -rank: the group orders its ranks in reverse world order.
  auto group = g_world->split(color, -r);
  ASSERT_EQ(group->size(), half);
  EXPECT_EQ(group->rank(), half - 1 - (r % half));
  EXPECT_TRUE(group->device_tensors());
  auto b = upload(std::vector<int32_t>{r, 1});
  Tensor t = dev(b->get(), DType::i32, 2);
  CommTicket tk = group->all_reduce(g_ctx, t, ReduceOp::sum);
  EXPECT_EQ(tk, 1u) << "a child counts its own tickets";
  group->wait(g_ctx, tk);
  auto h = download<int32_t>(b->get(), 2);
  int32_t expect = 0;
  for (int q = color * half; q < (color + 1) * half; ++q) expect += q;
  EXPECT_EQ(h[0], expect);
  EXPECT_EQ(h[1], half);
  // A broadcast inside the group from its rank 0 (the highest world rank).
  auto bb = upload(std::vector<int32_t>{r});
  Tensor tb = dev(bb->get(), DType::i32, 1);
  group->wait(g_ctx, group->broadcast(g_ctx, tb, 0));
  EXPECT_EQ(download<int32_t>(bb->get(), 1)[0], (color + 1) * half - 1);
  EXPECT_EQ(group->bytes_moved().bytes[static_cast<size_t>(CollectiveKind::all_reduce)],
            2ull * (half - 1) * 8 / half);
  group->barrier();
  group->synchronize();
  group.reset();
  // The parent is untouched by its child's life.
  auto c = upload(std::vector<float>{1.0f});
  Tensor tc = dev(c->get(), DType::f32, 1);
  g_world->wait(g_ctx, g_world->all_reduce(g_ctx, tc, ReduceOp::sum));
  EXPECT_EQ(download<float>(c->get(), 1)[0], static_cast<float>(p));
}

// The compute stream fills the buffer, the collective reads it, the compute
// stream copies the result back: only the start/done events order them.
// 16 MiB makes a missing dependency visible (the collective reading before
// the fill, or the copy reading before the collective).
TEST(NcclComm, TicketsOrderTheComputeStream) {
  SKIP_WITHOUT_GPUS();
  const int p = g_size, r = g_rank;
  const int64_t n = 4 << 20;
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  DeviceBuffer a(bytes), b(bytes);
  float* host = nullptr;
  CUDA_OK(cudaMallocHost(reinterpret_cast<void**>(&host), 2 * bytes));
  // Byte patterns 0x10101010 * (q+1) are normal floats, and their sum in
  // fp32 is what the host computes.
  auto pattern = [](int q, int salt) {
    uint32_t byte = static_cast<uint32_t>(0x10 * (q + 1) + salt);
    uint32_t bits = byte * 0x01010101u;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  };
  CUDA_OK(cudaMemsetAsync(a.get(), 0x10 * (r + 1), bytes, g_stream));
  CUDA_OK(cudaMemsetAsync(b.get(), 0x10 * (r + 1) + 1, bytes, g_stream));
  Tensor ta = dev(a.get(), DType::f32, n), tb = dev(b.get(), DType::f32, n);
  CommTicket t1 = g_world->all_reduce(g_ctx, ta, ReduceOp::sum);
  CommTicket t2 = g_world->all_reduce(g_ctx, tb, ReduceOp::max);
  ASSERT_EQ(t2, t1 + 1);
  g_world->wait(g_ctx, t2);  // and therefore t1
  CUDA_OK(cudaMemcpyAsync(host, a.get(), bytes, cudaMemcpyDeviceToHost, g_stream));
  CUDA_OK(cudaMemcpyAsync(host + n, b.get(), bytes, cudaMemcpyDeviceToHost, g_stream));
  CUDA_OK(cudaStreamSynchronize(g_stream));
  float sum = 0.0f, mx = -INFINITY;
  for (int q = 0; q < p; ++q) {
    sum += pattern(q, 0);
    mx = std::max(mx, pattern(q, 1));
  }
  // Two addends round the same in any order; more may differ in the last bit.
  const float tol = p == 2 ? 0.0f : 1e-6f * std::fabs(sum);
  int64_t bad_sum = 0, bad_max = 0;
  for (int64_t i = 0; i < n; ++i) {
    bad_sum += std::fabs(host[i] - sum) > tol;
    bad_max += host[n + i] != mx;
  }
  CUDA_OK(cudaFreeHost(host));
  EXPECT_EQ(bad_sum, 0) << "elements of the summed buffer that missed the fill or the collective";
  EXPECT_EQ(bad_max, 0) << "elements of the max buffer that missed the fill or the collective";

  // Tickets from elsewhere are refused; ticket 0 (no collective) is a no-op.
  g_world->wait(g_ctx, 0);
  std::string msg = error_of([&] { g_world->wait(g_ctx, t2 + 100); });
  EXPECT_NE(msg.find("was not issued by this communicator"), std::string::npos) << msg;
  g_world->synchronize();
}

TEST(NcclComm, ByteCountersFollowRingVolumes) {
  SKIP_WITHOUT_GPUS();
  const uint64_t p = static_cast<uint64_t>(g_size);
  const int64_t n = 250;
  g_world->reset_bytes();
  DeviceBuffer a(kN * 4), h(kN * 2), in(p * n * 4), sh(n * 4), full(p * n * 4);
  CUDA_OK(cudaMemset(a.get(), 0, kN * 4));
  CUDA_OK(cudaMemset(h.get(), 0, kN * 2));
  CUDA_OK(cudaMemset(in.get(), 0, p * n * 4));
  Tensor ta = dev(a.get(), DType::f32, kN), th = dev(h.get(), DType::bf16, kN);
  Tensor tin = dev(in.get(), DType::f32, static_cast<int64_t>(p) * n), tsh = dev(sh.get(), DType::f32, n);
  Tensor tfull = dev(full.get(), DType::f32, static_cast<int64_t>(p) * n);

  // A ring all-reduce is a reduce-scatter and an all-gather, each moving
  // (p − 1)/p of the buffer, counted in whole bytes on its own: 2·⌊(p−1)·B/p⌋,
  // which is one byte short of ⌊2·(p−1)·B/p⌋ when (p−1)·B/p has a half (the
  // bf16 buffer below on 4 ranks: 2·1501 = 3002, not 3003).
  const auto ring = [&](uint64_t bytes) { return (p - 1) * bytes / p; };
  g_world->all_reduce(g_ctx, ta, ReduceOp::sum);
  const uint64_t ar = 2 * ring(kN * 4);
  EXPECT_EQ(bytes_of(CollectiveKind::all_reduce), ar);
  g_world->all_reduce(g_ctx, th, ReduceOp::sum);  // native bf16: 2 bytes per element
  const uint64_t ar16 = 2 * ring(kN * 2);
  EXPECT_EQ(bytes_of(CollectiveKind::all_reduce), ar + ar16);
  g_world->reduce_scatter(g_ctx, tin, tsh, ReduceOp::sum);
  EXPECT_EQ(bytes_of(CollectiveKind::reduce_scatter), (p - 1) * n * 4);  // (p-1)/p of the p*n buffer
  g_world->all_gather(g_ctx, tsh, tfull);
  EXPECT_EQ(bytes_of(CollectiveKind::all_gather), (p - 1) * n * 4);
  g_world->broadcast(g_ctx, ta, 0);
  EXPECT_EQ(bytes_of(CollectiveKind::broadcast), ring(kN * 4));
  g_world->barrier();  // moves no payload
  EXPECT_EQ(g_world->bytes_moved().total(), ar + ar16 + 2 * (p - 1) * n * 4 + ring(kN * 4));
  // Refused calls move nothing.
  Tensor bad = dev(sh.get(), DType::f32, n - 1);
  EXPECT_THROW(g_world->all_gather(g_ctx, bad, tfull), loom::Error);
  EXPECT_EQ(bytes_of(CollectiveKind::all_gather), (p - 1) * n * 4);
}

// ---- all_to_all -------------------------------------------------------------------
// The cases of test_mpi_comm.cpp on device buffers. Elements rank `src` sends
// to rank `dst` in round `round`: 0..6, zero for about a quarter of the pairs,
// none at all from the round's silent rank (which still issues both exchanges).
int64_t a2a_count(int src, int dst, int round, int p) {
  if (src == round % p) return 0;
  const uint32_t hsh = (static_cast<uint32_t>(src) * 2654435761u) ^ (static_cast<uint32_t>(dst) * 40503u) ^
                       (static_cast<uint32_t>(round) * 97u);
  return (hsh >> 3) % 4 == 0 ? 0 : static_cast<int64_t>((hsh >> 7) % 7);
}
int32_t a2a_value(int src, int dst, int64_t i) { return src * 1000000 + dst * 1000 + static_cast<int32_t>(i); }

// The counts exchange on the device (an equal split of one int64 per peer,
// moved as 8-byte f64 elements), one read of the received counts, then the
// tokens; both ordered after the compute stream's writes by the collective
// itself and before its reads by wait(). The receive buffer is larger than the
// data and its tail must stay untouched.
TEST(NcclComm, AllToAllVariableCountsWithSilentRanks) {
  SKIP_WITHOUT_GPUS();
  const int p = g_size, r = g_rank;
  for (int round = 0; round < 2 * p; ++round) {
    std::vector<int64_t> send_counts(p);
    for (int q = 0; q < p; ++q) send_counts[q] = a2a_count(r, q, round, p);
    DeviceBuffer dsc(p * 8), drc(p * 8);
    CUDA_OK(cudaMemsetAsync(drc.get(), 0xFF, p * 8, g_stream));
    CUDA_OK(cudaMemcpyAsync(dsc.get(), send_counts.data(), p * 8, cudaMemcpyHostToDevice, g_stream));
    Tensor sc = dev(dsc.get(), DType::f64, p), rc = dev(drc.get(), DType::f64, p);
    const uint64_t before = bytes_of(CollectiveKind::all_to_all);
    g_world->wait(g_ctx, g_world->all_to_all(g_ctx, sc, {}, rc, {}));
    EXPECT_EQ(bytes_of(CollectiveKind::all_to_all) - before, static_cast<uint64_t>(p - 1) * 8);
    const std::vector<int64_t> recv_counts = download<int64_t>(drc.get(), p);
    int64_t nsend = 0, nrecv = 0;
    for (int q = 0; q < p; ++q) {
      ASSERT_EQ(recv_counts[q], a2a_count(q, r, round, p)) << "round " << round << " count from rank " << q;
      nsend += send_counts[q];
      nrecv += recv_counts[q];
    }
    std::vector<int32_t> send(static_cast<size_t>(nsend + 3), -7);
    int64_t off = 0;
    for (int q = 0; q < p; ++q)
      for (int64_t i = 0; i < send_counts[q]; ++i) send[off++] = a2a_value(r, q, i);
    DeviceBuffer ds((nsend + 3) * 4), dr((nrecv + 5) * 4);
    CUDA_OK(cudaMemsetAsync(dr.get(), 0xEE, (nrecv + 5) * 4, g_stream));
    CUDA_OK(cudaMemcpyAsync(ds.get(), send.data(), send.size() * 4, cudaMemcpyHostToDevice, g_stream));
    Tensor ts = dev(ds.get(), DType::i32, nsend + 3), tr = dev(dr.get(), DType::i32, nrecv + 5);
    const uint64_t mid = bytes_of(CollectiveKind::all_to_all);
    g_world->wait(g_ctx, g_world->all_to_all(g_ctx, ts, send_counts, tr, recv_counts));
    const std::vector<int32_t> recv = download<int32_t>(dr.get(), nrecv + 5);  // syncs g_stream first
    off = 0;
    for (int q = 0; q < p; ++q)
      for (int64_t i = 0; i < recv_counts[q]; ++i, ++off)
        ASSERT_EQ(recv[off], a2a_value(q, r, i)) << "round " << round << ", element " << i << " from rank " << q;
    for (int64_t i = nrecv; i < nrecv + 5; ++i)
      ASSERT_EQ(static_cast<uint32_t>(recv[i]), 0xEEEEEEEEu) << "past the counts: untouched";
    EXPECT_EQ(bytes_of(CollectiveKind::all_to_all) - mid, static_cast<uint64_t>(nsend - send_counts[r]) * 4)
        << "bytes sent to the other ranks";
  }
  g_world->synchronize();
}

// A 2-byte dtype (raw bytes, counts in elements) and an equal split of data.
TEST(NcclComm, AllToAllBf16AndEqualSplit) {
  SKIP_WITHOUT_GPUS();
  const int p = g_size, r = g_rank;
  std::vector<int64_t> sc(p), rc(p);
  for (int q = 0; q < p; ++q) {
    sc[q] = (r + q) % 3;
    rc[q] = (q + r) % 3;
  }
  std::vector<uint16_t> send(6 * p);
  int64_t off = 0;
  for (int q = 0; q < p; ++q)
    for (int64_t i = 0; i < sc[q]; ++i) send[off++] = static_cast<uint16_t>(r * 256 + q * 16 + i);
  auto ds = upload(send);
  DeviceBuffer dr(6 * p * 2);
  CUDA_OK(cudaDeviceSynchronize());  // the uploads ran on the legacy stream, which g_stream does not wait for
  Tensor ts = dev(ds->get(), DType::bf16, 6 * p), tr = dev(dr.get(), DType::bf16, 6 * p);
  g_world->wait(g_ctx, g_world->all_to_all(g_ctx, ts, sc, tr, rc));
  const auto recv = download<uint16_t>(dr.get(), 6 * p);
  off = 0;
  for (int q = 0; q < p; ++q)
    for (int64_t i = 0; i < rc[q]; ++i, ++off) ASSERT_EQ(recv[off], static_cast<uint16_t>(q * 256 + r * 16 + i));

  const int64_t n = 3;
  std::vector<double> es(n * p);
  for (int q = 0; q < p; ++q)
    for (int64_t i = 0; i < n; ++i) es[q * n + i] = r * 100.0 + q * 10.0 + i;
  auto des = upload(es);
  DeviceBuffer der(n * p * 8);
  CUDA_OK(cudaDeviceSynchronize());
  Tensor tes = dev(des->get(), DType::f64, n * p), ter = dev(der.get(), DType::f64, n * p);
  g_world->wait(g_ctx, g_world->all_to_all(g_ctx, tes, {}, ter, {}));
  const auto er = download<double>(der.get(), n * p);
  for (int q = 0; q < p; ++q)
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(er[q * n + i], q * 100.0 + r * 10.0 + i);
}

// Refused before anything is enqueued, on every rank alike.
TEST(NcclComm, AllToAllRefusals) {
  SKIP_WITHOUT_GPUS();
  const int p = g_size, r = g_rank;
  DeviceBuffer a(4096), b(4096);
  std::vector<int64_t> ones(p, 1), short_counts(p - 1, 1), neg(p, 1);
  neg[p - 1] = -2;
  Tensor ta = dev(a.get(), DType::i32, 64), tb = dev(b.get(), DType::i32, 64);
  std::string msg = error_of([&] { g_world->all_to_all(g_ctx, ta, short_counts, tb, ones); });
  EXPECT_NE(msg.find("send_counts has " + std::to_string(p - 1) + " entries but the group has " + std::to_string(p)),
            std::string::npos) << msg;
  msg = error_of([&] { g_world->all_to_all(g_ctx, ta, ones, tb, neg); });
  EXPECT_NE(msg.find("recv_counts[" + std::to_string(p - 1) + "] = -2 is negative"), std::string::npos) << msg;
  Tensor small = dev(b.get(), DType::i32, p - 1);
  msg = error_of([&] { g_world->all_to_all(g_ctx, ta, ones, small, ones); });
  EXPECT_NE(msg.find("recv_counts sum to " + std::to_string(p) + " elements but the receive buffer"),
            std::string::npos) << msg;
  Tensor tf = dev(b.get(), DType::f32, 64);
  msg = error_of([&] { g_world->all_to_all(g_ctx, ta, ones, tf, ones); });
  EXPECT_NE(msg.find("int32 but output is fp32"), std::string::npos) << msg;
  Tensor overlap = dev(static_cast<char*>(a.get()) + 4, DType::i32, 32);
  msg = error_of([&] { g_world->all_to_all(g_ctx, ta, ones, overlap, ones); });
  EXPECT_NE(msg.find("overlap"), std::string::npos) << msg;
  Tensor odd = dev(a.get(), DType::i32, p + 1), odd_out = dev(b.get(), DType::i32, p + 1);
  msg = error_of([&] { g_world->all_to_all(g_ctx, odd, {}, odd_out, {}); });
  EXPECT_NE(msg.find("equal split"), std::string::npos) << msg;
  std::vector<int32_t> host(64);
  msg = error_of([&] {
    Tensor t(host.data(), DType::i32, Device::cpu, {64});
    g_world->all_to_all(g_ctx, t, ones, tb, ones);
  });
  EXPECT_NE(msg.find("device memory only"), std::string::npos) << msg;
  msg = error_of([&] { g_world->all_to_all(loom::ExecContext{}, ta, ones, tb, ones); });
  EXPECT_NE(msg.find("cpu context"), std::string::npos) << msg;
  // Still usable.
  std::vector<int32_t> s(p);
  for (int q = 0; q < p; ++q) s[q] = r * 10 + q;
  auto ds = upload(s);
  CUDA_OK(cudaDeviceSynchronize());
  Tensor ts = dev(ds->get(), DType::i32, p);
  g_world->wait(g_ctx, g_world->all_to_all(g_ctx, ts, ones, tb, ones));
  const auto got = download<int32_t>(b.get(), p);
  for (int q = 0; q < p; ++q) EXPECT_EQ(got[q], q * 10 + r);
}

// Checked before anything is enqueued, on every rank alike, so the communicator stays usable.
TEST(NcclComm, SizeTypeAndPlacementMismatchesAreErrors) {
  SKIP_WITHOUT_GPUS();
  const int p = g_size, r = g_rank;
  DeviceBuffer a(4096), b(4096);
  std::string msg = error_of([&] {
    Tensor in = dev(a.get(), DType::f32, 10), out = dev(b.get(), DType::f32, 3);
    g_world->reduce_scatter(g_ctx, in, out, ReduceOp::sum);
  });
  EXPECT_NE(msg.find("reduce_scatter"), std::string::npos) << msg;
  EXPECT_NE(msg.find("input has 10 elements"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::to_string(p) + "*3"), std::string::npos) << msg;

  msg = error_of([&] {
    Tensor in = dev(a.get(), DType::f32, 5), out = dev(b.get(), DType::f32, 5 * p + 1);
    g_world->all_gather(g_ctx, in, out);
  });
  EXPECT_NE(msg.find("output has " + std::to_string(5 * p + 1) + " elements"), std::string::npos) << msg;

  msg = error_of([&] {
    Tensor in = dev(a.get(), DType::f32, 5), out = dev(b.get(), DType::f64, 5 * p);
    g_world->all_gather(g_ctx, in, out);
  });
  EXPECT_NE(msg.find("fp32 but output is fp64"), std::string::npos) << msg;

  msg = error_of([&] { Tensor t = dev(a.get(), DType::f32, 4); g_world->broadcast(g_ctx, t, p); });
  EXPECT_NE(msg.find("root " + std::to_string(p)), std::string::npos) << msg;

  msg = error_of([&] { Tensor t = dev(a.get(), DType::i32, 4); g_world->all_reduce(g_ctx, t, ReduceOp::avg); });
  EXPECT_NE(msg.find("avg of int32"), std::string::npos) << msg;

  msg = error_of([&] { Tensor t = dev(a.get(), DType::e4m3, 4); g_world->all_reduce(g_ctx, t, ReduceOp::sum); });
  EXPECT_NE(msg.find("fp8_e4m3 cannot be reduced"), std::string::npos) << msg;

  std::vector<float> host(4);
  msg = error_of([&] {
    Tensor t(host.data(), DType::f32, Device::cpu, {4});
    g_world->all_reduce(g_ctx, t, ReduceOp::sum);
  });
  EXPECT_NE(msg.find("device memory only"), std::string::npos) << msg;

  msg = error_of([&] {
    Tensor t = dev(a.get(), DType::f32, 4);
    g_world->all_reduce(loom::ExecContext{}, t, ReduceOp::sum);
  });
  EXPECT_NE(msg.find("cpu context"), std::string::npos) << msg;

  // Overlapping, but not at this rank's chunk: NCCL has no such in-place form.
  msg = error_of([&] {
    Tensor full = dev(a.get(), DType::f32, 8 * p);
    Tensor shifted = loom::view(full, r < p - 1 ? r * 8 + 1 : r * 8 - 1, {8});
    g_world->all_gather(g_ctx, shifted, full);
  });
  EXPECT_NE(msg.find("is not this rank's chunk"), std::string::npos) << msg;

  auto one = upload(std::vector<float>{1.0f});
  Tensor t = dev(one->get(), DType::f32, 1);
  g_world->wait(g_ctx, g_world->all_reduce(g_ctx, t, ReduceOp::sum));
  EXPECT_EQ(download<float>(one->get(), 1)[0], static_cast<float>(p))
      << "the communicator must stay usable after refused calls";
}

// Last, because it leaves a communicator aborted. Rank 1 skips an all_reduce
// that every other rank issues on a communicator with a 2 s limit: their
// synchronize() must throw at the limit, naming the collective, and the
// communicator must refuse everything after. A first all_reduce on every rank
// comes before: NCCL connects lazily, and this test is about the collective
// hanging on the device. Rank 1's copy is then destroyed: its teardown waits
// for the others (gone) up to the limit, then aborts, quietly.
TEST(NcclComm, SkippedCollectiveTimesOutOnTheOthers) {
  SKIP_WITHOUT_GPUS();
  const int p = g_size, r = g_rank;
  auto comm = loom::make_nccl_communicator(r, 2.0);
  auto buf = upload(std::vector<float>(64, 1.0f));
  Tensor t = dev(buf->get(), DType::f32, 64);
  comm->all_reduce(g_ctx, t, ReduceOp::sum);
  comm->synchronize();
  MPI_Barrier(MPI_COMM_WORLD);
  if (r != 1) {
    auto t0 = std::chrono::steady_clock::now();
    comm->all_reduce(g_ctx, t, ReduceOp::sum);
    EXPECT_LT(seconds_since(t0), 1.0) << "issuing must not block the host";
    std::string msg = error_of([&] { comm->synchronize(); });
    double waited = seconds_since(t0);
    EXPECT_NE(msg.find("collective all_reduce #2 of 256 bytes on rank " + std::to_string(r) + " of " +
                       std::to_string(p)),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("did not finish within 2 s"), std::string::npos) << msg;
    EXPECT_NE(msg.find("run.collective_timeout"), std::string::npos) << msg;
    EXPECT_GE(waited, 2.0);
    EXPECT_LT(waited, 6.0) << "the error must come at the limit";
    msg = error_of([&] { comm->all_reduce(g_ctx, t, ReduceOp::sum); });
    EXPECT_NE(msg.find("failed earlier"), std::string::npos) << msg;
    msg = error_of([&] { comm->barrier(); });
    EXPECT_NE(msg.find("failed earlier"), std::string::npos) << msg;
  }
  MPI_Barrier(MPI_COMM_WORLD);  // every other rank has aborted by now
  auto t0 = std::chrono::steady_clock::now();
  comm.reset();
  EXPECT_LT(seconds_since(t0), 6.0) << "tearing down must be bounded by the limit";
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace

// Ends with MPI_Finalize and std::_Exit once every communicator is destroyed:
// the exit code is gtest's, and no static teardown (CUDA, NCCL) runs after a
// test aborted a communicator.
int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int rc = 1;
  try {
    loom::ensure_mpi_initialized();
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess) {
      ndev = 0;
      (void)cudaGetLastError();
    }
    int fewest = ndev;  // every rank must take the same branch
    MPI_Allreduce(&ndev, &fewest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (fewest < g_size) {
      g_skip = loom::cat("the NCCL communicator needs one CUDA device per rank: ", g_size, " ranks, ", fewest,
                         " device(s) visible");
    } else {
      CUDA_OK(cudaSetDevice(g_rank));
      CUDA_OK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
      g_ctx.device = Device::cuda;
      g_ctx.stream = g_stream;
      g_ctx.rank = g_rank;
      g_ctx.world = g_size;
      g_world = loom::make_nccl_communicator(g_rank, 30.0);
    }
    rc = RUN_ALL_TESTS();
    if (g_world) {
      g_world->barrier();
      g_world.reset();
      cudaStreamDestroy(g_stream);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test_nccl_comm on rank %d: %s\n", g_rank, e.what());
    loom::abort_all(2);
  }
  std::fflush(nullptr);
  if (loom::mpi_initialized()) MPI_Finalize();
  std::_Exit(rc);
}
