// The MPI communicator on several ranks (run by mpirun, see CMakeLists.txt).
// Every rank draws its data from a seed derived from its rank, so each rank can
// regenerate every other rank's data and check collective results against a
// local reference. Every rank runs the same tests in the same order, so their
// collectives match; a failing assertion on one rank surfaces as a non-zero
// exit of mpirun, and a rank that falls out of step hits the timeout instead of
// hanging ctest.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/launch.hpp"
#include "comm/mpi_communicator.hpp"
#include "hf/safetensors.hpp"
#include "loom/comm.hpp"
#include "loom/error.hpp"

namespace {

using loom::CollectiveKind;
using loom::DType;
using loom::Device;
using loom::ReduceOp;
using loom::Tensor;

std::unique_ptr<loom::Communicator> g_world;
const loom::ExecContext kCtx{};

std::vector<float> data_of(int rank, int64_t n, uint32_t salt = 0) {
  std::mt19937 gen(1000u + static_cast<uint32_t>(rank) * 7919u + salt);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(gen);
  return v;
}

Tensor flat(void* p, DType t, int64_t n) { return Tensor(p, t, Device::cpu, {n}); }

std::string error_of(const std::function<void()>& f) {
  try { f(); } catch (const loom::Error& e) { return e.what(); }
  return "";
}

uint64_t bytes_of(CollectiveKind k) { return g_world->bytes_moved().bytes[static_cast<size_t>(k)]; }

// N is deliberately not a multiple of 4, so the byte formulas round.
constexpr int64_t kN = 1001;

TEST(MpiComm, RanksAndWorld) {
  loom::LaunchInfo li = loom::detect_launch();
  EXPECT_TRUE(li.under_launcher);
  EXPECT_EQ(li.launcher, "openmpi");
  EXPECT_EQ(li.world, g_world->size());
  EXPECT_EQ(li.rank, g_world->rank());
  EXPECT_EQ(li.local_world, li.world) << "mpirun on one host: every rank shares the node";
  EXPECT_EQ(li.local_rank, li.rank);
  EXPECT_GE(g_world->size(), 2);
}

TEST(MpiComm, AllReduceF32SumAvgMax) {
  const int p = g_world->size(), r = g_world->rank();
  std::vector<double> sum(kN, 0.0);
  std::vector<float> mx(kN, -INFINITY);
  for (int q = 0; q < p; ++q) {
    auto v = data_of(q, kN);
    for (int64_t i = 0; i < kN; ++i) { sum[i] += v[i]; mx[i] = std::max(mx[i], v[i]); }
  }
  auto s = data_of(r, kN), a = s, m = s;
  Tensor ts = flat(s.data(), DType::f32, kN), ta = flat(a.data(), DType::f32, kN), tm = flat(m.data(), DType::f32, kN);
  g_world->all_reduce(kCtx, ts, ReduceOp::sum);
  g_world->all_reduce(kCtx, ta, ReduceOp::avg);
  g_world->all_reduce(kCtx, tm, ReduceOp::max);
  for (int64_t i = 0; i < kN; ++i) {
    ASSERT_NEAR(s[i], sum[i], 1e-5) << "element " << i;
    ASSERT_NEAR(a[i], sum[i] / p, 1e-5) << "element " << i;
    ASSERT_EQ(m[i], mx[i]) << "element " << i;
  }
}

TEST(MpiComm, AllReduceF64AndInt32) {
  const int p = g_world->size(), r = g_world->rank();
  std::vector<double> d(kN);
  std::vector<int32_t> k(kN);
  auto mine = data_of(r, kN);
  for (int64_t i = 0; i < kN; ++i) { d[i] = mine[i]; k[i] = static_cast<int32_t>(mine[i] * 1000) + r; }
  Tensor td = flat(d.data(), DType::f64, kN), tk = flat(k.data(), DType::i32, kN);
  g_world->all_reduce(kCtx, td, ReduceOp::sum);
  g_world->all_reduce(kCtx, tk, ReduceOp::max);
  for (int64_t i = 0; i < kN; ++i) {
    double ref = 0;
    int32_t kmax = INT32_MIN;
    for (int q = 0; q < p; ++q) {
      float x = data_of(q, kN)[i];
      ref += x;
      kmax = std::max(kmax, static_cast<int32_t>(x * 1000) + q);
    }
    ASSERT_NEAR(d[i], ref, 1e-12);
    ASSERT_EQ(k[i], kmax);
    if (i > 50) break;  // regenerating per element is quadratic; a prefix is enough here
  }
}

// bf16/fp16 sum in fp32 and round once: the result is the fp32 reference sum
// rounded, give or take the last bit (summation order differs across ranks).
TEST(MpiComm, AllReduceBf16AndFp16ThroughFp32) {
  const int p = g_world->size(), r = g_world->rank();
  // fp16 values m/256 with |m| <= 256 are exact and normal in fp16, encoded
  // here by their bit fields; bf16 values are fp32 rounded by the library helper.
  auto enc16 = [](float x) {
    if (x == 0.0f) return static_cast<uint16_t>(0);
    uint16_t sign = x < 0 ? 0x8000 : 0;
    int e;
    float f = std::frexp(std::fabs(x), &e);  // |x| = f * 2^e, f in [0.5, 1)
    uint16_t man = static_cast<uint16_t>(std::lround((f * 2 - 1) * 1024));
    return static_cast<uint16_t>(sign | ((e - 1 + 15) << 10) | man);
  };
  for (DType t : {DType::bf16, DType::f16}) {
    auto enc = [&](float x) { return t == DType::bf16 ? loom::hf::f32_to_bf16(x) : enc16(x); };
    auto dec = [t](uint16_t h) { return t == DType::bf16 ? loom::hf::bf16_to_f32(h) : loom::hf::f16_to_f32(h); };
    auto value = [t](float x) {
      return t == DType::bf16 ? loom::hf::bf16_to_f32(loom::hf::f32_to_bf16(x)) : std::round(x * 256) / 256;
    };
    std::vector<std::vector<float>> all(p);
    for (int q = 0; q < p; ++q) {
      all[q] = data_of(q, kN);
      for (auto& x : all[q]) x = value(x);
    }
    std::vector<uint16_t> h(kN);
    for (int64_t i = 0; i < kN; ++i) h[i] = enc(all[r][i]);
    for (int64_t i = 0; i < kN; ++i) ASSERT_EQ(dec(h[i]), all[r][i]) << "encoding of element " << i;
    Tensor th = flat(h.data(), t, kN);
    g_world->all_reduce(kCtx, th, ReduceOp::sum);
    for (int64_t i = 0; i < kN; ++i) {
      float ref = 0;
      for (int q = 0; q < p; ++q) ref += all[q][i];
      float ulp = std::fabs(ref) * (t == DType::bf16 ? 1.0f / 128 : 1.0f / 1024) + 1e-6f;
      ASSERT_NEAR(dec(h[i]), ref, ulp) << loom::dtype_name(t) << " element " << i;
    }
  }
}

TEST(MpiComm, ReduceScatterAndAllGatherRoundTrip) {
  const int p = g_world->size(), r = g_world->rank();
  const int64_t n = 257;
  auto in = data_of(r, p * n, 1);
  std::vector<double> ref(static_cast<size_t>(p * n), 0.0);
  for (int q = 0; q < p; ++q) {
    auto v = data_of(q, p * n, 1);
    for (int64_t i = 0; i < p * n; ++i) ref[i] += v[i];
  }
  std::vector<float> shard(n), full(p * n, 0.0f);
  Tensor tin = flat(in.data(), DType::f32, p * n), tsh = flat(shard.data(), DType::f32, n);
  Tensor tfull = flat(full.data(), DType::f32, p * n);
  g_world->reduce_scatter(kCtx, tin, tsh, ReduceOp::sum);
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(shard[i], ref[r * n + i], 1e-5) << "shard element " << i;
  g_world->all_gather(kCtx, tsh, tfull);
  for (int64_t i = 0; i < p * n; ++i) ASSERT_NEAR(full[i], ref[i], 1e-5) << "gathered element " << i;
  // The gathered own shard is this rank's bits, unchanged.
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(full[r * n + i], shard[i]);

  // In place, as ZeRO uses them: the shard is a view of the full buffer.
  std::vector<float> buf = data_of(r, p * n, 1);
  Tensor tbuf = flat(buf.data(), DType::f32, p * n);
  Tensor own = loom::view(tbuf, r * n, {n});
  g_world->reduce_scatter(kCtx, tbuf, own, ReduceOp::avg);
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(buf[r * n + i], ref[r * n + i] / p, 1e-5);
  g_world->all_gather(kCtx, own, tbuf);
  for (int64_t i = 0; i < p * n; ++i) ASSERT_NEAR(buf[i], ref[i] / p, 1e-5) << "in-place gathered element " << i;
}

TEST(MpiComm, BroadcastFromNonZeroRoot) {
  const int p = g_world->size(), r = g_world->rank();
  const int root = p - 1;
  auto v = data_of(r, kN, 2);
  Tensor t = flat(v.data(), DType::f32, kN);
  g_world->broadcast(kCtx, t, root);
  EXPECT_EQ(v, data_of(root, kN, 2));
}

TEST(MpiComm, SplitIntoTwoGroups) {
  const int p = g_world->size(), r = g_world->rank();
  const int half = p / 2, color = r / half;
  // key = -rank: the group orders its ranks in reverse world order.
  auto group = g_world->split(color, -r);
  ASSERT_EQ(group->size(), half);
  EXPECT_EQ(group->rank(), half - 1 - (r % half));
  std::vector<int32_t> v{r, 1};
  Tensor t = flat(v.data(), DType::i32, 2);
  group->all_reduce(kCtx, t, ReduceOp::sum);
  int32_t expect = 0;
  for (int q = color * half; q < (color + 1) * half; ++q) expect += q;
  EXPECT_EQ(v[0], expect);
  EXPECT_EQ(v[1], half);
  // A broadcast inside the group from its rank 0 (the highest world rank).
  std::vector<int32_t> b{r};
  Tensor tb = flat(b.data(), DType::i32, 1);
  group->broadcast(kCtx, tb, 0);
  EXPECT_EQ(b[0], (color + 1) * half - 1);
  EXPECT_EQ(group->bytes_moved().bytes[static_cast<size_t>(CollectiveKind::all_reduce)],
            2ull * (half - 1) * 8 / half);
  group->barrier();
}

TEST(MpiComm, ByteCountersFollowRingVolumes) {
  const uint64_t p = static_cast<uint64_t>(g_world->size());
  const int64_t n = 250;
  g_world->reset_bytes();
  std::vector<float> a(kN, 1.0f), in(p * n, 1.0f), sh(n), full(p * n);
  std::vector<uint16_t> h(kN, 0x3F80);  // bf16 1.0
  Tensor ta = flat(a.data(), DType::f32, kN), th = flat(h.data(), DType::bf16, kN);
  Tensor tin = flat(in.data(), DType::f32, static_cast<int64_t>(p) * n), tsh = flat(sh.data(), DType::f32, n);
  Tensor tfull = flat(full.data(), DType::f32, static_cast<int64_t>(p) * n);

  // A ring all-reduce is a reduce-scatter and an all-gather, each moving
  // (p − 1)/p of the buffer, counted in whole bytes on its own: 2·⌊(p−1)·B/p⌋
  // (on 6 ranks 2·3336 = 6672 for this buffer, where ⌊2·(p−1)·B/p⌋ is 6673).
  const auto ring = [&](uint64_t bytes) { return (p - 1) * bytes / p; };
  g_world->all_reduce(kCtx, ta, ReduceOp::sum);
  const uint64_t ar = 2 * ring(kN * 4);
  EXPECT_EQ(bytes_of(CollectiveKind::all_reduce), ar);
  g_world->all_reduce(kCtx, th, ReduceOp::sum);  // staged in fp32: 4 bytes per element on the wire
  EXPECT_EQ(bytes_of(CollectiveKind::all_reduce), 2 * ar);
  EXPECT_EQ(loom::hf::bf16_to_f32(h[0]), static_cast<float>(p));

  g_world->reduce_scatter(kCtx, tin, tsh, ReduceOp::sum);
  EXPECT_EQ(bytes_of(CollectiveKind::reduce_scatter), (p - 1) * n * 4);  // (p-1)/p of the p*n buffer
  g_world->all_gather(kCtx, tsh, tfull);
  EXPECT_EQ(bytes_of(CollectiveKind::all_gather), (p - 1) * n * 4);
  g_world->broadcast(kCtx, ta, 0);
  EXPECT_EQ(bytes_of(CollectiveKind::broadcast), ring(kN * 4));
  g_world->barrier();  // moves no payload
  EXPECT_EQ(g_world->bytes_moved().total(), 2 * ar + 2 * (p - 1) * n * 4 + ring(kN * 4));
  // Refused calls move nothing.
  Tensor bad = flat(sh.data(), DType::f32, n - 1);
  EXPECT_THROW(g_world->all_gather(kCtx, bad, tfull), loom::Error);
  EXPECT_EQ(bytes_of(CollectiveKind::all_gather), (p - 1) * n * 4);
}

// ---- all_to_all -------------------------------------------------------------------
// Elements rank `src` sends to rank `dst` in round `round`: 0..6, zero for
// about a quarter of the pairs, and none at all from the round's silent rank
// (it still takes part in both exchanges).
int64_t a2a_count(int src, int dst, int round, int p) {
  if (src == round % p) return 0;
  const uint32_t hsh = (static_cast<uint32_t>(src) * 2654435761u) ^ (static_cast<uint32_t>(dst) * 40503u) ^
                       (static_cast<uint32_t>(round) * 97u);
  return (hsh >> 3) % 4 == 0 ? 0 : static_cast<int64_t>((hsh >> 7) % 7);
}
// Element i of what src sends to dst: unique over (src, dst, i).
int32_t a2a_value(int src, int dst, int64_t i) { return src * 1000000 + dst * 1000 + static_cast<int32_t>(i); }

// The counts exchange (an equal split of one int64 per peer, moved as 8-byte
// f64 elements: all_to_all copies raw bytes), then the tokens, as the MoE
// layer will issue them; the receive buffer is larger than the data, and its
// tail must stay untouched.
TEST(MpiComm, AllToAllVariableCountsWithSilentRanks) {
  const int p = g_world->size(), r = g_world->rank();
  for (int round = 0; round < 2 * p; ++round) {
    std::vector<int64_t> send_counts(p), recv_counts(p, -1);
    for (int q = 0; q < p; ++q) send_counts[q] = a2a_count(r, q, round, p);
    Tensor sc = flat(send_counts.data(), DType::f64, p), rc = flat(recv_counts.data(), DType::f64, p);
    const uint64_t before = bytes_of(CollectiveKind::all_to_all);
    g_world->all_to_all(kCtx, sc, {}, rc, {});
    EXPECT_EQ(bytes_of(CollectiveKind::all_to_all) - before, static_cast<uint64_t>(p - 1) * 8);
    int64_t nsend = 0, nrecv = 0;
    for (int q = 0; q < p; ++q) {
      ASSERT_EQ(recv_counts[q], a2a_count(q, r, round, p)) << "round " << round << " count from rank " << q;
      nsend += send_counts[q];
      nrecv += recv_counts[q];
    }
    std::vector<int32_t> send(static_cast<size_t>(nsend + 3), -7), recv(static_cast<size_t>(nrecv + 5), -9);
    int64_t off = 0;
    for (int q = 0; q < p; ++q)
      for (int64_t i = 0; i < send_counts[q]; ++i) send[off++] = a2a_value(r, q, i);
    Tensor ts = flat(send.data(), DType::i32, nsend + 3), tr = flat(recv.data(), DType::i32, nrecv + 5);
    const uint64_t mid = bytes_of(CollectiveKind::all_to_all);
    g_world->all_to_all(kCtx, ts, send_counts, tr, recv_counts);
    off = 0;
    for (int q = 0; q < p; ++q)
      for (int64_t i = 0; i < recv_counts[q]; ++i, ++off)
        ASSERT_EQ(recv[off], a2a_value(q, r, i)) << "round " << round << ", element " << i << " from rank " << q;
    for (int64_t i = nrecv; i < nrecv + 5; ++i) ASSERT_EQ(recv[i], -9) << "past the counts: untouched";
    EXPECT_EQ(bytes_of(CollectiveKind::all_to_all) - mid,
              static_cast<uint64_t>(nsend - send_counts[r]) * 4) << "bytes sent to the other ranks";
  }
}

// A 2-byte dtype (raw bytes, counts in elements) and an equal split of data.
TEST(MpiComm, AllToAllBf16AndEqualSplit) {
  const int p = g_world->size(), r = g_world->rank();
  std::vector<int64_t> sc(p), rc(p);
  for (int q = 0; q < p; ++q) {
    sc[q] = (r + q) % 3;  // 0, 1 or 2 elements
    rc[q] = (q + r) % 3;
  }
  std::vector<uint16_t> send(6 * p), recv(6 * p, 0xFFFF);
  int64_t off = 0;
  for (int q = 0; q < p; ++q)
    for (int64_t i = 0; i < sc[q]; ++i) send[off++] = static_cast<uint16_t>(r * 256 + q * 16 + i);
  Tensor ts = flat(send.data(), DType::bf16, 6 * p), tr = flat(recv.data(), DType::bf16, 6 * p);
  g_world->all_to_all(kCtx, ts, sc, tr, rc);
  off = 0;
  for (int q = 0; q < p; ++q)
    for (int64_t i = 0; i < rc[q]; ++i, ++off) ASSERT_EQ(recv[off], static_cast<uint16_t>(q * 256 + r * 16 + i));

  const int64_t n = 3;
  std::vector<double> es(n * p), er(n * p, -1.0);
  for (int q = 0; q < p; ++q)
    for (int64_t i = 0; i < n; ++i) es[q * n + i] = r * 100.0 + q * 10.0 + i;
  Tensor tes = flat(es.data(), DType::f64, n * p), ter = flat(er.data(), DType::f64, n * p);
  g_world->all_to_all(kCtx, tes, {}, ter, {});
  for (int q = 0; q < p; ++q)
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(er[q * n + i], q * 100.0 + r * 10.0 + i);
}

// Refused before anything is sent, on every rank alike.
TEST(MpiComm, AllToAllRefusals) {
  const int p = g_world->size();
  std::vector<int32_t> a(64), b(64);
  std::vector<int64_t> ones(p, 1), short_counts(p - 1, 1), neg(p, 1);
  neg[p - 1] = -2;
  Tensor ta = flat(a.data(), DType::i32, 64), tb = flat(b.data(), DType::i32, 64);
  std::string msg = error_of([&] { g_world->all_to_all(kCtx, ta, short_counts, tb, ones); });
  EXPECT_NE(msg.find("send_counts has " + std::to_string(p - 1) + " entries but the group has " + std::to_string(p)),
            std::string::npos) << msg;
  msg = error_of([&] { g_world->all_to_all(kCtx, ta, ones, tb, neg); });
  EXPECT_NE(msg.find("recv_counts[" + std::to_string(p - 1) + "] = -2 is negative"), std::string::npos) << msg;
  msg = error_of([&] { g_world->all_to_all(kCtx, ta, ones, tb, {}); });
  EXPECT_NE(msg.find("recv_counts has 0 entries"), std::string::npos) << msg;
  Tensor small = flat(b.data(), DType::i32, p - 1);
  msg = error_of([&] { g_world->all_to_all(kCtx, ta, ones, small, ones); });
  EXPECT_NE(msg.find("recv_counts sum to " + std::to_string(p) + " elements but the receive buffer"),
            std::string::npos) << msg;
  Tensor tf = flat(b.data(), DType::f32, 64);
  msg = error_of([&] { g_world->all_to_all(kCtx, ta, ones, tf, ones); });
  EXPECT_NE(msg.find("int32 but output is fp32"), std::string::npos) << msg;
  Tensor overlap = flat(a.data() + 1, DType::i32, 32);
  msg = error_of([&] { g_world->all_to_all(kCtx, ta, ones, overlap, ones); });
  EXPECT_NE(msg.find("overlap"), std::string::npos) << msg;
  Tensor odd = flat(a.data(), DType::i32, p + 1), odd_out = flat(b.data(), DType::i32, p + 1);
  msg = error_of([&] { g_world->all_to_all(kCtx, odd, {}, odd_out, {}); });
  EXPECT_NE(msg.find("equal split"), std::string::npos) << msg;
  msg = error_of([&] {
    Tensor dev(a.data(), DType::i32, Device::cuda, {64});
    g_world->all_to_all(kCtx, dev, ones, tb, ones);
  });
  EXPECT_NE(msg.find("host memory only"), std::string::npos) << msg;
  // Still usable.
  std::vector<int32_t> s(p, 5), rr(p, 0);
  for (int q = 0; q < p; ++q) s[q] = g_world->rank() * 10 + q;
  Tensor ts = flat(s.data(), DType::i32, p), tr = flat(rr.data(), DType::i32, p);
  g_world->all_to_all(kCtx, ts, ones, tr, ones);
  for (int q = 0; q < p; ++q) EXPECT_EQ(rr[q], q * 10 + g_world->rank());
}

// The one-rank communicator: its own part is a copy; the same checks.
TEST(MpiComm, SelfCommunicatorAllToAll) {
  auto self = loom::make_self_communicator();
  std::vector<int32_t> s{1, 2, 3, 4}, r(6, -1);
  Tensor ts = flat(s.data(), DType::i32, 4), tr = flat(r.data(), DType::i32, 6);
  const std::vector<int64_t> three{3};
  self->all_to_all(kCtx, ts, three, tr, three);
  EXPECT_EQ(r, (std::vector<int32_t>{1, 2, 3, -1, -1, -1}));
  Tensor t4 = flat(r.data(), DType::i32, 4);
  self->all_to_all(kCtx, ts, {}, t4, {});
  EXPECT_EQ(r, (std::vector<int32_t>{1, 2, 3, 4, -1, -1}));
  const std::vector<int64_t> two{2};
  std::string msg = error_of([&] { self->all_to_all(kCtx, ts, three, tr, two); });
  EXPECT_NE(msg.find("sends 3 elements to itself but expects 2"), std::string::npos) << msg;
  const std::vector<int64_t> both{1, 1};
  msg = error_of([&] { self->all_to_all(kCtx, ts, both, tr, both); });
  EXPECT_NE(msg.find("the group has 1 ranks"), std::string::npos) << msg;
  EXPECT_EQ(self->bytes_moved().total(), 0u) << "nothing leaves the rank";
}

// Checked before anything is sent, on every rank alike, so the communicator stays usable.
TEST(MpiComm, SizeAndTypeMismatchesAreErrors) {
  const int p = g_world->size();
  std::vector<float> a(100), b(100);
  std::vector<double> d(100);
  std::string msg = error_of([&] {
    Tensor in = flat(a.data(), DType::f32, 10), out = flat(b.data(), DType::f32, 3);
    g_world->reduce_scatter(kCtx, in, out, ReduceOp::sum);
  });
  EXPECT_NE(msg.find("reduce_scatter"), std::string::npos) << msg;
  EXPECT_NE(msg.find("input has 10 elements"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::to_string(p) + "*3"), std::string::npos) << msg;

  msg = error_of([&] {
    Tensor in = flat(a.data(), DType::f32, 5), out = flat(b.data(), DType::f32, 5 * p + 1);
    g_world->all_gather(kCtx, in, out);
  });
  EXPECT_NE(msg.find("all_gather"), std::string::npos) << msg;
  EXPECT_NE(msg.find("output has " + std::to_string(5 * p + 1) + " elements"), std::string::npos) << msg;

  msg = error_of([&] {
    Tensor in = flat(a.data(), DType::f32, 5), out = flat(d.data(), DType::f64, 5 * p);
    g_world->all_gather(kCtx, in, out);
  });
  EXPECT_NE(msg.find("fp32 but output is fp64"), std::string::npos) << msg;

  msg = error_of([&] { Tensor t = flat(a.data(), DType::f32, 4); g_world->broadcast(kCtx, t, p); });
  EXPECT_NE(msg.find("root " + std::to_string(p)), std::string::npos) << msg;

  msg = error_of([&] { Tensor t = flat(a.data(), DType::i32, 4); g_world->all_reduce(kCtx, t, ReduceOp::avg); });
  EXPECT_NE(msg.find("avg of int32"), std::string::npos) << msg;

  msg = error_of([&] { Tensor t = flat(a.data(), DType::e4m3, 4); g_world->all_reduce(kCtx, t, ReduceOp::sum); });
  EXPECT_NE(msg.find("fp8_e4m3 cannot be reduced"), std::string::npos) << msg;

  msg = error_of([&] { Tensor t(a.data(), DType::f32, Device::cuda, {4}); g_world->all_reduce(kCtx, t, ReduceOp::sum); });
  EXPECT_NE(msg.find("host memory only"), std::string::npos) << msg;

  std::vector<float> one{1.0f};
  Tensor t = flat(one.data(), DType::f32, 1);
  g_world->all_reduce(kCtx, t, ReduceOp::sum);
  EXPECT_EQ(one[0], static_cast<float>(p)) << "the communicator must stay usable after refused calls";
}

// Rank 1 arrives 2.5 s late at an all_reduce with a 1 s limit: every other rank
// gets the timeout error naming the collective, and the communicator refuses
// further collectives. To end cleanly (exit 0 everywhere, no MPI_Abort), rank 1
// then does join the all_reduce: the others' abandoned requests are still
// posted, so it completes, and the final world barrier keeps their progress
// engines turning meanwhile. The buffers are static because MPI may write to
// the abandoned ones until that late completion.
TEST(MpiComm, LateRankTimesOutTheOthers) {
  const int p = g_world->size(), r = g_world->rank();
  auto comm = loom::make_mpi_communicator(1.0);
  static std::vector<float> buf(64);
  std::fill(buf.begin(), buf.end(), static_cast<float>(r + 1));
  Tensor t = flat(buf.data(), DType::f32, 64);
  if (r == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    comm->all_reduce(kCtx, t, ReduceOp::sum);
    EXPECT_EQ(buf[0], static_cast<float>(p * (p + 1) / 2)) << "the late rank still gets every rank's data";
  } else {
    auto start = std::chrono::steady_clock::now();
    std::string msg = error_of([&] { comm->all_reduce(kCtx, t, ReduceOp::sum); });
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_NE(msg.find("collective all_reduce of 256 bytes on " + std::to_string(p) +
                       " ranks did not complete within 1 s on rank " + std::to_string(r)),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("run.collective_timeout"), std::string::npos) << msg;
    EXPECT_GE(waited, 1.0);
    EXPECT_LT(waited, 2.4) << "the error must come at the limit, not when the late rank arrives";
    msg = error_of([&] { comm->barrier(); });
    EXPECT_NE(msg.find("failed earlier"), std::string::npos) << msg;
  }
  g_world->barrier();
}


}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  int rc = 1;
  try {
    g_world = loom::make_mpi_communicator(10.0);
    rc = RUN_ALL_TESTS();
    g_world->barrier();
    g_world.reset();
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "test_mpi_comm: %s\n", e.what());
    loom::abort_all(2);
  }
  return rc;
}
