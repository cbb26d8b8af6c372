// The fp8_block recipe on the CPU (DeepSeek-V3's fine-grained FP8 scaling):
// the reference casts of loom/fp8_block.hpp against a hand-computed example
// and an independent straightforward implementation, the recipe's refusals,
// its GEMMs against fp64 products of the quantised operands, and short
// training runs (against fp32, and resumed bitwise).
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "config/run_config.hpp"
#include "loom/comm.hpp"
#include "loom/config.hpp"
#include "loom/fp8.hpp"
#include "loom/fp8_block.hpp"
#include "loom/precision.hpp"
#include "loom/registry.hpp"
#include "fp8_recipe_rig.hpp"
#include "session_runs.hpp"
#include "test_util.hpp"
#include "train/session_probe.hpp"

namespace fs = std::filesystem;
using loom::Device;
using loom::DType;
using loom::Tensor;
namespace fp8 = loom::fp8;
namespace blk = loom::fp8::block;

namespace {

// ---- An independent reference: the rule written out as plainly as possible ----

struct RefTile {
  float scale_inv;
  bool nonfinite;
};

// scale for a tile from the values in it: 448 / amax in fp32, 1 for amax 0, inf or NaN; FLT_MAX on overflow.
RefTile ref_scale(const std::vector<float>& vals, float& scale) {
  bool bad = false;
  float amax = 0.0f;
  for (float v : vals) {
    if (std::isnan(v) || std::isinf(v)) bad = true;
    else amax = std::max(amax, std::fabs(v));
  }
  if (bad || amax == 0.0f) scale = 1.0f;
  else {
    scale = 448.0f / amax;
    if (std::isinf(scale)) scale = FLT_MAX;
  }
  return {1.0f / scale, bad};
}

// Operand [rows, k] in tiles of th x tw; codes in the operand's layout, scale_inv[tile_row][tile_col].
struct RefCast {
  std::vector<uint8_t> q;
  std::vector<std::vector<float>> sinv;
  int64_t nonfinite = 0;
};
RefCast ref_cast(const std::vector<float>& x, int64_t rows, int64_t cols, int64_t th, int64_t tw) {
  RefCast out;
  out.q.assign(static_cast<size_t>(rows * cols), 0);
  out.sinv.assign(static_cast<size_t>(rows / th), std::vector<float>(static_cast<size_t>(cols / tw)));
  for (int64_t tr = 0; tr < rows / th; ++tr)
    for (int64_t tc = 0; tc < cols / tw; ++tc) {
      std::vector<float> vals;
      for (int64_t r = tr * th; r < (tr + 1) * th; ++r)
        for (int64_t c = tc * tw; c < (tc + 1) * tw; ++c) vals.push_back(x[static_cast<size_t>(r * cols + c)]);
      float scale = 1.0f;
      const RefTile t = ref_scale(vals, scale);
      out.nonfinite += t.nonfinite;
      out.sinv[static_cast<size_t>(tr)][static_cast<size_t>(tc)] = t.scale_inv;
      for (int64_t r = tr * th; r < (tr + 1) * th; ++r)
        for (int64_t c = tc * tw; c < (tc + 1) * tw; ++c)
          out.q[static_cast<size_t>(r * cols + c)] =
              fp8::encode(x[static_cast<size_t>(r * cols + c)] * scale, fp8::Format::e4m3);
    }
  return out;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Random data with odd values: per-row magnitudes over 12 decades, a zero tile,
// a tile with one huge value, a tile with a subnormal amax, and (when
// `specials`) one tile with an inf and one with a NaN.
std::vector<float> odd_data(int64_t rows, int64_t cols, uint32_t seed, bool specials) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(-6.f, 6.f);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float mag = std::pow(10.f, ud(g));
    for (int64_t c = 0; c < cols; ++c) x[static_cast<size_t>(r * cols + c)] = nd(g) * mag;
  }
  auto at = [&](int64_t r, int64_t c) -> float& { return x[static_cast<size_t>(r * cols + c)]; };
  for (int64_t c = 0; c < 128; ++c) at(1, c) = 0.0f;                 // a zero 1x128 tile
  for (int64_t r = 0; r < 128; ++r) at(r, cols - 1) = 0.0f;          // a zero 128x1 tile
  at(2, 5) = 3.0e37f;                                                // one huge value
  for (int64_t c = 128; c < 256 && c < cols; ++c) at(3, c) = 1e-40f * static_cast<float>(c % 7);  // subnormal amax
  at(rows - 1, 0) = 0.1f + 1.0f / 3.0f;
  if (specials) {
    at(4, 7) = std::numeric_limits<float>::infinity();
    at(6, cols - 3) = std::numeric_limits<float>::quiet_NaN();
  }
  return x;
}

std::vector<float> transpose(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> t(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[static_cast<size_t>(c * rows + r)] = x[static_cast<size_t>(r * cols + c)];
  return t;
}

}  // namespace

// A hand-computed example. x [128, 256] is zero but for: row 0, tile 0 holds
// 3.5, -1.0 and 0.3 (amax 3.5: scale 448 / 3.5 = 128 exactly, so 3.5 -> 448
// = code 0x7E, -1 -> -128 = 0xF0, 0.3 -> 38.4, between the E4M3 values 36 and
// 40 -> 40 = 0x62, dequantised 0.3125); row 5, tile 1 holds 1000 (scale
// 0.448f, 1000 -> 448 -> 0x7E). Every other tile is zero: scale 1.
TEST(Fp8Block, HandComputedTiles) {
  const int64_t R = 128, C = 256;
  std::vector<float> x(static_cast<size_t>(R * C), 0.0f);
  x[0] = 3.5f;
  x[1] = -1.0f;
  x[2] = 0.3f;
  x[5 * C + 128 + 9] = 1000.0f;
  std::vector<uint8_t> q(static_cast<size_t>(R * C), 0xAA);
  std::vector<float> s(static_cast<size_t>(blk::scale_floats(blk::ScaleMode::tile_1x128, R, C)), -1.0f);
  EXPECT_EQ(blk::cast_row_tiles(x.data(), R, C, C, q.data(), s.data()), 0);
  EXPECT_EQ(q[0], 0x7E);
  EXPECT_EQ(q[1], 0xF0);
  EXPECT_EQ(q[2], 0x62);
  EXPECT_EQ(q[3], 0x00);
  EXPECT_EQ(q[5 * C + 128 + 9], 0x7E);
  // Layout: scale of (row r, k block kb) at kb * rows + r.
  EXPECT_EQ(s.size(), 256u);
  EXPECT_EQ(s[0 * R + 0], 1.0f / 128.0f);
  EXPECT_EQ(s[1 * R + 5], 1.0f / (448.0f / 1000.0f));
  EXPECT_EQ(s[1 * R + 0], 1.0f);  // a zero tile
  EXPECT_EQ(s[0 * R + 5], 1.0f);
  std::vector<float> y(x.size());
  blk::dequantize(q.data(), R, C, blk::ScaleMode::tile_1x128, s.data(), y.data());
  EXPECT_EQ(y[0], 3.5f);
  EXPECT_EQ(y[1], -1.0f);
  EXPECT_EQ(y[2], 0.3125f);
  // 128x128 blocks: block (0, 0) has amax 3.5, block (0, 1) amax 1000.
  std::vector<float> sb(static_cast<size_t>(blk::scale_floats(blk::ScaleMode::block_128x128, R, C)), -1.0f);
  std::vector<float> sbt(static_cast<size_t>(blk::scale_floats(blk::ScaleMode::block_128x128, C, R)), -1.0f);
  EXPECT_EQ(sb.size(), 4u);   // 1 row block x roundup(2 k blocks, 4)
  EXPECT_EQ(sbt.size(), 8u);  // 2 row blocks x roundup(1, 4)
  std::vector<uint8_t> qb(x.size()), qbt(x.size());
  blk::cast_blocks(x.data(), R, C, C, qb.data(), qbt.data(), sb.data(), sbt.data());
  EXPECT_EQ(sb[0], 1.0f / 128.0f);
  EXPECT_EQ(sb[1], 1.0f / (448.0f / 1000.0f));
  EXPECT_EQ(sbt[0], sb[0]);  // [C, R]: row block rb at rb * 4
  EXPECT_EQ(sbt[4], sb[1]);
  EXPECT_EQ(qb[2], 0x62);
  EXPECT_EQ(qbt[2 * R + 0], 0x62);  // q_t [C, R]: x[0][2] at row 2, column 0
}

// Every cast against the independent implementation above on odd random data,
// bitwise (codes and scale inverses), at several shapes; the non-finite
// tiles counted; the qdq functions the dequantised codes.
TEST(Fp8Block, CastsMatchAnIndependentImplementation) {
  for (auto [R, C] : {std::pair<int64_t, int64_t>{128, 128}, {256, 384}, {384, 256}}) {
    SCOPED_TRACE(testing::Message() << "x [" << R << ", " << C << "]");
    const std::vector<float> x = odd_data(R, C, static_cast<uint32_t>(R * 7 + C), true);
    // Row tiles.
    {
      const RefCast ref = ref_cast(x, R, C, 1, 128);
      std::vector<uint8_t> q(x.size());
      std::vector<float> s(static_cast<size_t>(blk::scale_floats(blk::ScaleMode::tile_1x128, R, C)));
      EXPECT_EQ(blk::cast_row_tiles(x.data(), R, C, C, q.data(), s.data()), ref.nonfinite);
      EXPECT_EQ(ref.nonfinite, 2);
      EXPECT_EQ(q, ref.q);
      int bad = 0;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t kb = 0; kb < C / 128; ++kb)
          bad += bits(s[static_cast<size_t>(kb * R + r)]) != bits(ref.sinv[static_cast<size_t>(r)][static_cast<size_t>(kb)]);
      EXPECT_EQ(bad, 0);
      std::vector<float> y(x.size()), z(x.size());
      blk::dequantize(q.data(), R, C, blk::ScaleMode::tile_1x128, s.data(), y.data());
      blk::qdq_row_tiles(x.data(), R, C, C, z.data());
      EXPECT_EQ(std::memcmp(y.data(), z.data(), y.size() * 4), 0);
    }
    // Column tiles: the tiles of xᵀ along its rows, written as xᵀ.
    {
      const std::vector<float> xt = transpose(x, R, C);
      const RefCast ref = ref_cast(xt, C, R, 1, 128);
      std::vector<uint8_t> qt(x.size());
      std::vector<float> st(static_cast<size_t>(blk::scale_floats(blk::ScaleMode::tile_1x128, C, R)));
      EXPECT_EQ(blk::cast_col_tiles(x.data(), R, C, C, qt.data(), st.data()), ref.nonfinite);
      EXPECT_EQ(qt, ref.q);
      int bad = 0;
      for (int64_t c = 0; c < C; ++c)
        for (int64_t kb = 0; kb < R / 128; ++kb)
          bad += bits(st[static_cast<size_t>(kb * C + c)]) != bits(ref.sinv[static_cast<size_t>(c)][static_cast<size_t>(kb)]);
      EXPECT_EQ(bad, 0);
      std::vector<float> yt(x.size()), z(x.size());
      blk::dequantize(qt.data(), C, R, blk::ScaleMode::tile_1x128, st.data(), yt.data());
      blk::qdq_col_tiles(x.data(), R, C, C, z.data());
      EXPECT_EQ(std::memcmp(transpose(yt, C, R).data(), z.data(), z.size() * 4), 0);
    }
    // Blocks, both copies.
    {
      const RefCast ref = ref_cast(x, R, C, 128, 128);
      std::vector<uint8_t> q(x.size()), qt(x.size());
      std::vector<float> s(static_cast<size_t>(blk::scale_floats(blk::ScaleMode::block_128x128, R, C)));
      std::vector<float> st(static_cast<size_t>(blk::scale_floats(blk::ScaleMode::block_128x128, C, R)));
      EXPECT_EQ(blk::cast_blocks(x.data(), R, C, C, q.data(), qt.data(), s.data(), st.data()), ref.nonfinite);
      EXPECT_EQ(q, ref.q);
      std::vector<uint8_t> want_t(x.size());
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) want_t[static_cast<size_t>(c * R + r)] = ref.q[static_cast<size_t>(r * C + c)];
      EXPECT_EQ(qt, want_t);
      const int64_t kbr = blk::round_up4(C / 128), kbt = blk::round_up4(R / 128);
      int bad = 0;
      for (int64_t rb = 0; rb < R / 128; ++rb)
        for (int64_t cb = 0; cb < C / 128; ++cb) {
          const float want = ref.sinv[static_cast<size_t>(rb)][static_cast<size_t>(cb)];
          bad += bits(s[static_cast<size_t>(rb * kbr + cb)]) != bits(want);
          bad += bits(st[static_cast<size_t>(cb * kbt + rb)]) != bits(want);
        }
      EXPECT_EQ(bad, 0);
      std::vector<float> y(x.size()), z(x.size());
      blk::dequantize(q.data(), R, C, blk::ScaleMode::block_128x128, s.data(), y.data());
      blk::qdq_blocks(x.data(), R, C, C, z.data());
      EXPECT_EQ(std::memcmp(y.data(), z.data(), y.size() * 4), 0);
    }
  }
  // A row view (row stride > cols) casts like the packed copy.
  const int64_t R = 128, C = 256, ld = 384;
  const std::vector<float> packed = odd_data(R, C, 11, false);
  std::vector<float> view(static_cast<size_t>(R * ld), 7.0f);
  for (int64_t r = 0; r < R; ++r)
    std::memcpy(view.data() + r * ld, packed.data() + r * C, static_cast<size_t>(C) * 4);
  std::vector<float> a(packed.size()), b(packed.size());
  blk::qdq_col_tiles(packed.data(), R, C, C, a.data());
  blk::qdq_col_tiles(view.data(), R, C, ld, b.data());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0);
  // Shapes that are not multiples of 128 are refused, naming them.
  loom::test::expect_error([&] { blk::qdq_row_tiles(packed.data(), 100, 128, 128, a.data()); },
                           {"100", "multiples of 128"});
}

// ---- The recipe ----

namespace {

loom::PluginRegistry& registry() {
  static auto* reg = new loom::PluginRegistry({fs::path(LOOM_TEST_PLUGIN_DIR)});
  return *reg;
}

std::unique_ptr<loom::Precision> make(const std::string& body = "", Device device = Device::cpu,
                                      bool deterministic = false) {
  loom::PluginInit init;
  init.config = loom::parse_config_table("[precision]\n" + body, "fp8_block.toml").table("precision");
  init.config.mark_used("plugin");
  init.device = device;
  init.deterministic = deterministic;
  return registry().create_as<loom::PluginKind::precision>("fp8_block", init);
}

loom::LinearDesc desc(const std::string& name, int64_t in, int64_t out, int64_t rows,
                      loom::LinearRole role = loom::LinearRole::hidden, bool variable = false) {
  loom::LinearDesc d;
  d.name = name;
  d.in = in;
  d.out = out;
  d.max_rows = rows;
  d.role = role;
  d.variable_rows = variable;
  return d;
}

// A recipe with its linears registered, set up alone and given its memory.
struct Rig : loom::test::RecipeRig {
  Rig(const std::string& body, const std::vector<loom::LinearDesc>& linears) : RecipeRig(make(body), linears) {}
};

std::vector<float> randn(size_t n, float sd, std::mt19937& g) {
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(g);
  return v;
}

// C[m, n] = A[m, k] B[n, k]^T in fp64.
std::vector<double> gemm_nt(const std::vector<float>& a, const std::vector<float>& b, int64_t m, int64_t n,
                            int64_t k) {
  std::vector<double> c(static_cast<size_t>(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t l = 0; l < k; ++l)
        s += static_cast<double>(a[static_cast<size_t>(i * k + l)]) * b[static_cast<size_t>(j * k + l)];
      c[static_cast<size_t>(i * n + j)] = s;
    }
  return c;
}

// max |got - want| / max |want|.
double rel_err(const float* got, const std::vector<double>& want) {
  double e = 0, m = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    e = std::max(e, std::fabs(got[i] - want[i]));
    m = std::max(m, std::fabs(want[i]));
  }
  return e / m;
}

}  // namespace

TEST(Fp8Block, Refusals) {
  using loom::test::expect_error;
  // Dims not multiples of 128: the linear, its dims, what to change, the alternative.
  {
    auto p = make();
    expect_error([&] { p->register_linear(desc("layer.0.k_proj", 128, 64, 128)); },
                 {"layer.0.k_proj", "[out, in] = [64, 128]", "multiples of 128", "fp8_current"});
    expect_error([&] { p->register_linear(desc("layer.0.q_proj", 128, 128, 124)); },
                 {"layer.0.q_proj", "124 rows", "train.micro_batch x train.seq_len", "fp8_current"});
    // The head stays in full precision by default: any dims.
    EXPECT_NO_THROW(p->register_linear(desc("lm_head", 128, 96, 124, loom::LinearRole::lm_head)));
    // A variable_rows linear (MoE expert) may have any max_rows: such calls run in full precision.
    EXPECT_NO_THROW(p->register_linear(desc("layer.0.expert.3.up", 128, 256, 100, loom::LinearRole::hidden, true)));
  }
  {
    auto p = make("fp8_head = true\n");
    expect_error([&] { p->register_linear(desc("lm_head", 128, 96, 128, loom::LinearRole::lm_head)); },
                 {"lm_head", "fp8_head = false"});
    // The head's rows are a chunk of the tokens: the message names the key that sets it.
    expect_error([&] { p->register_linear(desc("lm_head", 128, 128, 100, loom::LinearRole::lm_head)); },
                 {"lm_head", "100 rows", "per LM-head chunk", "model.head_chunk", "fp8_head = false"});
  }
  expect_error([] { make("format = \"hybrid\"\n"); }, {"fp8_block.toml", "format", "hybrid", "E4M3", "e4m3"});
  expect_error([] { make("format = \"e5m2\"\n"); }, {"format", "e4m3", "hybrid"});
  for (const char* v : {"auto", "heuristic", "fastest"})
    EXPECT_NO_THROW(make(loom::cat("gemm_algo = \"", v, "\"\n"))) << v;
  expect_error([] { make("gemm_algo = 2\n"); }, {"fp8_block.toml", "gemm_algo"});
  expect_error([] { make("gemm_algo = \"fastest\"\n", Device::cpu, /*deterministic=*/true); },
               {"fp8_block.toml", "gemm_algo", "run.deterministic = true"});
  for (const char* key : {"amax_history_len = 16", "amax_compute_algo = \"max\"", "margin = 1"})
    expect_error([&] { make(std::string(key) + "\n"); }, {"fp8_block", "fp8_delayed", "no amax history"});
  for (const char* key : {"fast_accum_fprop", "fast_accum_dgrad", "fast_accum_wgrad"})
    expect_error([&] { make(std::string(key) + " = true\n"); }, {key, "fast-accumulation", "CUDABlas.cpp"});
  EXPECT_NO_THROW(make("fast_accum_fprop = false\nfast_accum_dgrad = false\nfast_accum_wgrad = false\n"));
  expect_error([] { make("fp8_haed = true\n"); }, {"fp8_haed", "fp8_head"});
  expect_error([] { make("master = \"bf16\"\n"); }, {"master", "CPU", "fp32"});
  expect_error([] { make("stochastic_rounding = true\n"); }, {"stochastic_rounding", "master = \"bf16\""});
#ifdef LOOM_HAVE_CUDA
  EXPECT_NO_THROW(make("", Device::cuda));
  EXPECT_NO_THROW(make("master = \"bf16\"\nstochastic_rounding = true\n", Device::cuda));
#else
  expect_error([] { make("", Device::cuda); }, {"fp8_block", "cuda", "no CUDA backend"});
#endif
}

// The recipe's three GEMMs are the fp64 products of the independently
// quantised operands (x and dy in 1x128 tiles, W in 128x128 blocks, the wgrad
// operands in 128x1 tiles), up to fp32 accumulation: the relative error
// (max over the output / max of the output) is below 1e-5 (fp32 sums of
// <= 384 products: ~sqrt(384) * 2^-24 ~ 1e-6 typical, 20x margin). The
// weight is cast once per step; a variable-rows call of 100 rows runs in fp32.
TEST(Fp8Block, RecipeGemmsAreTheQuantisedProducts) {
  const int64_t in = 384, out = 256, rows = 256;
  // weight_cache = "step" (the Rig's grad_accum 1 would make "auto" "layer"): the reuse below.
  Rig rig("weight_cache = \"step\"\n",
          {desc("lin", in, out, rows), desc("moe", in, out, rows, loom::LinearRole::hidden, true)});
  std::mt19937 g(3);
  std::vector<float> x = randn(static_cast<size_t>(rows * in), 1.0f, g);
  std::vector<float> w = randn(static_cast<size_t>(out * in), 0.05f, g);
  std::vector<float> dy = randn(static_cast<size_t>(rows * out), 1e-3f, g);
  x[17] = 40.0f;  // one outlier: its tile gets its own scale
  Tensor tx(x.data(), DType::f32, Device::cpu, {rows, in}), tw(w.data(), DType::f32, Device::cpu, {out, in});
  Tensor tdy(dy.data(), DType::f32, Device::cpu, {rows, out});
  std::vector<float> y(static_cast<size_t>(rows * out)), dx(static_cast<size_t>(rows * in)),
      dw(static_cast<size_t>(out * in));
  Tensor ty(y.data(), DType::f32, Device::cpu, {rows, out}), tdx(dx.data(), DType::f32, Device::cpu, {rows, in}),
      tdw(dw.data(), DType::f32, Device::cpu, {out, in});
  loom::ExecContext ctx;
  rig.p->linear_forward(ctx, rig.ids[0], tx, tw, ty, nullptr);
  rig.p->linear_backward(ctx, rig.ids[0], tx, tw, tdy, &tdx, tdw, false);
  // Independent quantisation (ref_cast) and dequantisation.
  auto deq = [](const RefCast& rc, int64_t r_, int64_t c_, int64_t th, int64_t tw_) {
    std::vector<float> v(rc.q.size());
    for (int64_t r = 0; r < r_; ++r)
      for (int64_t c = 0; c < c_; ++c)
        v[static_cast<size_t>(r * c_ + c)] = fp8::decode(rc.q[static_cast<size_t>(r * c_ + c)], fp8::Format::e4m3) *
                                             rc.sinv[static_cast<size_t>(r / th)][static_cast<size_t>(c / tw_)];
    return v;
  };
  const std::vector<float> qx = deq(ref_cast(x, rows, in, 1, 128), rows, in, 1, 128);
  const std::vector<float> qw = deq(ref_cast(w, out, in, 128, 128), out, in, 128, 128);
  const std::vector<float> qdy = deq(ref_cast(dy, rows, out, 1, 128), rows, out, 1, 128);
  const std::vector<float> xt = transpose(x, rows, in), dyt = transpose(dy, rows, out);
  const std::vector<float> qxt = deq(ref_cast(xt, in, rows, 1, 128), in, rows, 1, 128);
  const std::vector<float> qdyt = deq(ref_cast(dyt, out, rows, 1, 128), out, rows, 1, 128);
  EXPECT_LT(rel_err(y.data(), gemm_nt(qx, qw, rows, out, in)), 1e-5);
  EXPECT_LT(rel_err(dx.data(), gemm_nt(qdy, transpose(qw, out, in), rows, in, out)), 1e-5);
  EXPECT_LT(rel_err(dw.data(), gemm_nt(qdyt, qxt, out, in, rows)), 1e-5);
  // The FP8 result differs from the fp32 one (the casts happened).
  EXPECT_GT(rel_err(y.data(), gemm_nt(x, w, rows, out, in)), 1e-4);
  // The weight cast is reused until end_step ("step"; "layer" casts at every call).
  std::vector<float> w2 = w;
  for (auto& v : w2) v *= 2.0f;
  Tensor tw2(w2.data(), DType::f32, Device::cpu, {out, in});
  std::vector<float> y2(y.size());
  Tensor ty2(y2.data(), DType::f32, Device::cpu, {rows, out});
  rig.p->linear_forward(ctx, rig.ids[0], tx, tw2, ty2, nullptr);
  EXPECT_EQ(y2, y);
  rig.p->linear_backward(ctx, rig.ids[0], tx, tw2, tdy, &tdx, tdw, true);
  rig.p->end_step(ctx);
  rig.p->linear_forward(ctx, rig.ids[0], tx, tw2, ty2, nullptr);
  for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(y2[i], 2.0f * y[i]) << i;  // scales are powers-of-two invariant
  rig.p->linear_backward(ctx, rig.ids[0], tx, tw2, tdy, &tdx, tdw, false);
  // A variable-rows call of 100 rows: full precision (fp32), bitwise the plain product.
  Tensor tx100(x.data(), DType::f32, Device::cpu, {100, in});
  std::vector<float> y100(static_cast<size_t>(100 * out));
  Tensor ty100(y100.data(), DType::f32, Device::cpu, {100, out});
  rig.p->linear_forward(ctx, rig.ids[1], tx100, tw, ty100, nullptr);
  const std::vector<double> ref100 = gemm_nt(std::vector<float>(x.begin(), x.begin() + 100 * in), w, 100, out, in);
  EXPECT_LT(rel_err(y100.data(), ref100), 1e-5);
  Tensor tdy100(dy.data(), DType::f32, Device::cpu, {100, out});
  EXPECT_NO_THROW(rig.p->linear_backward(ctx, rig.ids[1], tx100, tw, tdy100, nullptr, tdw, false));
  // No non-finite tiles so far; one inf in x counts one (its row tile) plus one (its column tile).
  x[5] = std::numeric_limits<float>::infinity();
  rig.p->linear_forward(ctx, rig.ids[0], tx, tw, ty, nullptr);
  EXPECT_NE(rig.p->log_summary().find("non-finite tiles 2"), std::string::npos) << rig.p->log_summary();
  rig.p->linear_backward(ctx, rig.ids[0], tx, tw, tdy, &tdx, tdw, false);
  for (const loom::StateTensor& st : rig.p->state_tensors()) {
    ASSERT_EQ(st.name, "fp8_block.counters");
    EXPECT_EQ(st.tensor.ptr<double>()[0], 1.0);  // steps
    EXPECT_EQ(st.tensor.ptr<double>()[1], 2.0);  // non-finite tiles
  }
}

// ---- Sessions ----

namespace {

fs::path temp_dir(const std::string& name) { return loom::test::temp_dir("fp8_block_" + name); }

// Every dim a multiple of 128: hidden 128 (4 heads of 32, 4 kv heads: q, k, v
// and o are 128 x 128), ffn 256, 4 x 32 = 128 tokens per micro-batch.
std::string block_config(const fs::path& out, const std::string& precision, int steps) {
  std::ostringstream s;
  s << "[run]\nname = \"fp8_block\"\nout_dir = \"" << out.string() << "\"\ndevice = \"cpu\"\nseed = 5\nthreads = 2\n"
    << "log_level = \"warn\"\nplugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nhidden = 128\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 4\nffn_hidden = 256\n"
    << "vocab_size = 96\nmax_seq_len = 64\n"
    << "[train]\nsteps = " << steps << "\nmicro_batch = 4\nseq_len = 32\ngrad_accum = 2\nlr = 3e-3\nmin_lr = 3e-4\n"
    << "warmup_steps = 2\nvalidation_every = 3\nvalidation_batches = 2\nlog_every = 5\n"
    << "[checkpoint]\nevery = 0\nresume = \"none\"\n"
    << "[precision]\n" << precision << "\n[attention]\nplugin = \"naive\"\n[sharding]\nplugin = \"none\"\n"
    << "[data]\nplugin = \"synthetic\"\npattern = \"ramp\"\n";
  return s.str();
}

loom::Config parse(const std::string& text, const std::vector<std::string>& ov = {}) {
  return loom::parse_config_string(text, "fp8_block_e2e.toml", ov);
}

}  // namespace

// Emulated fp8_block trains like fp32 on a model whose dims are all multiples
// of 128: over 40 steps (two micro-batches each) the losses stay finite, fall,
// and the mean of the last 10 losses is within 3% of fp32's. Why 3%: the
// per-tile E4M3 rounding is a relative error of at most 2^-4 per operand
// element (RNE on 3 mantissa bits), unbiased, so each GEMM's relative error
// is ~2^-4 / sqrt(K) ~ 0.5% for K >= 128, and the loss follows within a few
// tenths of a percent per step on this small model; the CPU FP8 recipes stay
// within 2% of fp32 after 300 steps on the quickstart model, and 3% leaves
// room for the noise of a 40-step window. Measured here: -0.21% (printed
// below). Outside CI, the quickstart model with num_kv_heads = 4 (so that
// every dim is a multiple of 128), micro_batch 8, 300 steps on the fortune
// corpus: validation loss fp32 2.6018, fp8_block 2.6018 (+0.00%). The CPU
// arithmetic is the same bits on every x86-64 processor (docs/RELIABILITY.md,
// "Reproducibility"), so every machine computes the printed value; the bound
// only has to absorb a future change of rounding, which acts like a reseed.
TEST(Fp8Block, TrainsLikeFp32) {
  fs::path d = temp_dir("vs_fp32");
  auto run = [&](const std::string& plugin) {
    loom::Session s(parse(block_config(d / plugin, "plugin = \"" + plugin + "\"", 40)));
    return s.train();
  };
  const loom::RunSummary ref = run("fp32");
  const loom::RunSummary b = run("fp8_block");
  ASSERT_EQ(ref.steps.size(), 40u);
  ASSERT_EQ(b.steps.size(), 40u);
  double mr = 0, mb = 0, maxdev = 0;
  for (size_t i = 0; i < 40; ++i) {
    ASSERT_TRUE(std::isfinite(b.steps[i].loss)) << "step " << i + 1;
    maxdev = std::max(maxdev, std::fabs(b.steps[i].loss - ref.steps[i].loss) / ref.steps[i].loss);
    if (i >= 30) {
      mr += ref.steps[i].loss / 10;
      mb += b.steps[i].loss / 10;
    }
  }
  EXPECT_LT(b.steps.back().loss, b.steps.front().loss - 0.5) << "fp8_block must learn";
  EXPECT_LT(std::fabs(mb - mr) / mr, 0.03) << "mean of the last 10 losses: fp8_block " << mb << ", fp32 " << mr;
  EXPECT_NE(b.steps[5].loss, ref.steps[5].loss) << "the FP8 casts must change something";
  std::printf("fp8_block vs fp32, 40 steps: first loss %.4f / %.4f, mean of the last 10 %.4f / %.4f (%+.2f%%), "
              "largest per-step deviation %.2f%%\n",
              b.steps.front().loss, ref.steps.front().loss, mb, mr, 100.0 * (mb - mr) / mr, 100.0 * maxdev);
}

// Save at step 6, resume in a new session: the same losses, bitwise, as one
// run of 10 steps, and the same counters (the weight cast is redone after the
// resume, as after every optimizer step).
TEST(Fp8Block, ResumesBitwise) {
  fs::path d = temp_dir("resume");
  const std::string prec = "plugin = \"fp8_block\"";
  loom::RunSummary full, first, second;
  std::vector<double> full_c, resumed_c;
  auto counters = [](loom::Session& s) {
    for (const loom::StateTensor& t : loom::probe(s).precision().state_tensors())
      if (t.name == "fp8_block.counters") return std::vector<double>(t.tensor.ptr<double>(), t.tensor.ptr<double>() + 2);
    return std::vector<double>{};
  };
  {
    loom::Session s(parse(block_config(d / "full", prec, 10)));
    full = s.train();
    full_c = counters(s);
  }
  const std::vector<std::string> ov = {"checkpoint.every=3", "checkpoint.resume=auto"};
  {
    loom::Session s(parse(block_config(d / "split", prec, 10), ov));
    first = s.train(6);
  }
  {
    loom::Session s(parse(block_config(d / "split", prec, 10), ov));
    second = s.train();
    resumed_c = counters(s);
  }
  ASSERT_EQ(full.steps.size(), 10u);
  ASSERT_EQ(second.first_step, 6);
  ASSERT_EQ(second.steps.size(), 4u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(first.steps[i].loss, full.steps[i].loss) << "step " << i + 1;
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(second.steps[i].loss, full.steps[6 + i].loss) << "step " << 7 + i;
  ASSERT_EQ(full_c.size(), 2u);
  EXPECT_EQ(full_c[0], 10.0);
  EXPECT_EQ(resumed_c, full_c);
}

// Fused layers (the residual added as the GEMMs' C, packed projections) train
// like native ones under fp8_block: 6 steps, losses within 1% step by step
// (the same FP8 tiles, other fp32 summation orders). Measured: final 2.7352
// fused against 2.7357 native (0.02%), the same on every x86-64 processor
// (docs/RELIABILITY.md, "Reproducibility").
TEST(Fp8Block, FusedLayersFollowNative) {
  fs::path d = temp_dir("fused");
  auto run = [&](const std::string& layers) {
    loom::Session s(parse(block_config(d / layers, "plugin = \"fp8_block\"", 6),
                          {"model.layers=" + layers, "train.validation_every=0"}));
    return s.train();
  };
  const loom::RunSummary native = run("native"), fused = run("fused");
  ASSERT_EQ(native.steps.size(), 6u);
  ASSERT_EQ(fused.steps.size(), 6u);
  for (size_t i = 0; i < 6; ++i)
    EXPECT_LT(std::fabs(fused.steps[i].loss - native.steps[i].loss), 0.01 * native.steps[i].loss)
        << "step " << i + 1 << ": fused " << fused.steps[i].loss << ", native " << native.steps[i].loss;
}

// ---- weight_cache and keeps_wgrad_input ----

using loom::test::state_bytes;

// The workspace each weight_cache plans, on the CPU and (built with CUDA) on
// the GPU path, whose planning needs no GPU (what `loom check` prints as
// precision.workspace): "layer" holds the largest cast weight (on the GPU: W
// or Wᵀ with its block scales) instead of every one; "auto" follows
// grad_accum. And keeps_wgrad_input: true for the FP8 linears of fixed rows,
// false for the full-precision head and for variable_rows linears.
TEST(Fp8Block, WeightCachePlansTheWorkspace) {
  const std::vector<loom::LinearDesc> linears = {desc("layer.0.qkv_proj", 256, 768, 256),
                                                 desc("layer.0.gate_up_proj", 256, 1024, 256),
                                                 desc("layer.0.down_proj", 512, 256, 256),
                                                 desc("layer.0.expert", 256, 512, 256, loom::LinearRole::hidden, true),
                                                 desc("lm_head", 256, 384, 256, loom::LinearRole::lm_head)};
  std::vector<Device> devices = {Device::cpu};
#ifdef LOOM_HAVE_CUDA
  devices.push_back(Device::cuda);
#endif
  for (Device dev : devices) {
    SCOPED_TRACE(loom::device_name(dev));
    auto plan = [&](const std::string& mode, int accum, std::vector<bool>* keeps = nullptr) {
      loom::test::RecipeRig r(make("weight_cache = \"" + mode + "\"\n", dev), linears, dev, accum);
      if (keeps)
        for (int id : r.ids) keeps->push_back(r.p->keeps_wgrad_input(id));
      return r.p->workspace_bytes();
    };
    std::vector<bool> keeps;
    const size_t step = plan("step", 1, &keeps), layer = plan("layer", 4);
    EXPECT_EQ(keeps, (std::vector<bool>{true, true, true, false, false}));
    size_t all = 0, largest = 0;
    for (const auto& d : linears) {
      if (d.role == loom::LinearRole::lm_head) continue;
      const size_t wb = static_cast<size_t>(d.out * d.in);
      if (dev == Device::cpu) {  // the emulated cast of W in fp32
        all += 4 * wb;
        largest = std::max(largest, 4 * wb);
      } else {  // W and Wᵀ in FP8 with their 128x128 block scales, each slot 256-byte aligned
        auto r = [](size_t n) { return (n + 255) / 256 * 256; };
        const size_t sw = r(4 * static_cast<size_t>(blk::scale_floats(blk::ScaleMode::block_128x128, d.out, d.in)));
        const size_t swt = r(4 * static_cast<size_t>(blk::scale_floats(blk::ScaleMode::block_128x128, d.in, d.out)));
        all += 2 * r(wb) + sw + swt;
        largest = std::max(largest, r(wb) + std::max(sw, swt));
      }
    }
    EXPECT_EQ(step - layer, all - largest);
    EXPECT_EQ(plan("auto", 1), layer);
    EXPECT_EQ(plan("auto", 2), step);
    EXPECT_EQ(plan("step", 3), step);
  }
  loom::test::expect_error([] { make("weight_cache = \"micro_batch\"\n"); },
                           {"fp8_block.toml", "weight_cache", "auto", "step", "layer"});
}

// weight_cache = "layer" casts W into one scratch before every fprop and
// dgrad, "step" once per step into a copy per linear: every 128x128 block's
// scale comes from W itself, so the bits are the same and the losses,
// validation losses and counters are bitwise equal, with two micro-batches
// per step (block_config's grad_accum = 2) and with one ("auto" is then
// "layer"). And the planned workspace holds one weight (the largest) instead
// of all.
TEST(Fp8Block, WeightCacheLayerMatchesStepBitwise) {
  for (const std::string accum : {"1", "2"}) {
    SCOPED_TRACE("grad_accum " + accum);
    fs::path d = temp_dir("wcache_" + accum);
    const std::vector<std::string> ov = {"train.grad_accum=" + accum, "train.validation_every=2"};
    std::map<std::string, size_t> ws = loom::test::weight_cache_modes_match(
        [&](const std::string& mode) {
          return parse(block_config(d / mode, "plugin = \"fp8_block\"\nweight_cache = \"" + mode + "\"", 5), ov);
        },
        5);
    // Native layers: per layer q, k, v, o [128, 128], gate, up [256, 128], down [128, 256].
    const size_t all = 2 * (4 * 128 * 128 + 3 * 256 * 128) * 4, largest = 256 * 128 * 4;
    EXPECT_EQ(ws["step"] - ws["layer"], all - largest);
    EXPECT_EQ(ws["auto"], accum == "1" ? ws["layer"] : ws["step"]);
  }
}

// Training losses are bitwise those of the test-only variant that lets the
// blocks keep every linear input (fp8_block's FP8 backward never reads x, the
// wgrad reads the token-axis cast saved by the forward), native and fused
// layers, with and without recompute = "full"; and the blocks drop those
// inputs (the planned activations shrink).
TEST(Fp8Block, DroppingTheBlocksLinearInputsKeepsTheLossesBitwise) {
  const std::string dirs =
      "run.plugin_path=[\"" + std::string(LOOM_TEST_PLUGIN_DIR) + "\", \"" + LOOM_TEST_FP8_PLUGIN_DIR + "\"]";
  for (const std::string layers : {"native", "fused"})
    for (const std::string recompute : {"none", "full"}) {
      SCOPED_TRACE(layers + " recompute " + recompute);
      fs::path d = temp_dir("keeps_x_" + layers + recompute);
      const std::vector<std::string> ov = {"model.layers=" + layers, "model.recompute=" + recompute, dirs,
                                           "train.validation_every=2"};
      loom::Session a(parse(block_config(d / "a", "plugin = \"fp8_block\"", 4), ov));
      loom::Session b(parse(block_config(d / "b", "plugin = \"fp8_block_bf16_x\"", 4), ov));
      const size_t act_a = loom::probe(a).memory_plan().category_bytes(loom::MemCategory::activations);
      const size_t act_b = loom::probe(b).memory_plan().category_bytes(loom::MemCategory::activations);
      if (recompute == "none") EXPECT_LT(act_a, act_b) << "the blocks must drop the FP8 linears' inputs";
      std::printf("[fp8_block keeps x] %s recompute %s: activations %zu bytes, %zu keeping x\n", layers.c_str(),
                  recompute.c_str(), act_a, act_b);
      loom::test::expect_same_losses(a.train(), b.train(), 4);
      EXPECT_EQ(state_bytes(a), state_bytes(b));
    }
}
