// Token shards, the byte tokenizer, `loom prepare text`, and the data plugins
// `tokens` and `synthetic` (constructed directly, without the registry).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "data/synthetic/synthetic_data.hpp"
#include "data/tokens/tokens_data.hpp"
#include "loom/error.hpp"
#include "loom/ops/byte_tokenizer.hpp"
#include "loom/ops/hash.hpp"
#include "prepare_text.hpp"
#include "loom/token_shard.hpp"
#include "token_shard_writer.hpp"

namespace fs = std::filesystem;
using loom::DataSpec;
using loom::Split;
using loom::TokenShard;
using loom::data::TokensOptions;
using loom::plugins::SyntheticData;
using loom::plugins::TokensData;
using loom::test::patch_file;
using loom::test::set_token;
using loom::test::token_pattern;
using loom::test::write_damaged_tokens;
using loom::test::write_tokens;

namespace {

// A fresh directory per test, removed afterwards.
struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() /
           ("loom_test_data_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

void write_file(const std::string& path, const std::string& bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

// Expects every one of `parts` in message `m`.
void expect_error_parts(const std::string& m, std::initializer_list<std::string> parts) {
  for (const auto& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "missing '" << p << "' in: " << m;
}

// Runs `fn`, expects a loom::Error, returns its message.
template <typename F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const loom::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a loom::Error";
  return "";
}

DataSpec spec(int64_t batch, int64_t seq_len, int rank = 0, int world = 1, uint64_t seed = 1, int64_t vocab = 1000) {
  DataSpec s;
  s.batch = batch;
  s.seq_len = seq_len;
  s.vocab_size = vocab;
  s.rank = rank;
  s.world = world;
  s.seed = seed;
  return s;
}

using Batch = std::vector<int32_t>;

template <typename Source>
std::vector<Batch> take(Source& src, const DataSpec& s, int n, Split split = Split::train) {
  std::vector<Batch> out;
  for (int i = 0; i < n; ++i) {
    Batch b(static_cast<std::size_t>(s.batch * (s.seq_len + 1)));
    src.next(split, b.data());
    out.push_back(std::move(b));
  }
  return out;
}

std::unique_ptr<TokensData> tokens_source(TokensOptions opt, const DataSpec& s) {
  auto src = std::make_unique<TokensData>(loom::PluginInit{}, std::move(opt));
  src->open(s);
  return src;
}

// Three shards of distinct token values so that every window is identifiable by its first token.
struct Corpus {
  TempDir dir;
  std::vector<std::string> shards;
  Corpus() {
    shards.push_back(write_tokens(dir / "train_000.bin", token_pattern(41, 1000, 0)));    // 10 windows of 5 (stride 4)
    shards.push_back(write_tokens(dir / "train_001.bin", token_pattern(30, 1000, 100)));  // 7 windows
    shards.push_back(write_tokens(dir / "train_002.bin", token_pattern(23, 1000, 200)));  // 5 windows
    write_tokens(dir / "val.bin", token_pattern(21, 1000, 500));                          // 5 windows
  }
  TokensOptions options(bool shuffle = true, bool val = true) const {
    TokensOptions o;
    o.train = {dir / "train_*.bin"};
    if (val) o.val = {dir / "val.bin"};
    o.shuffle = shuffle;
    return o;
  }
};

// Each (field, JSON value) put into the state `st` on its own is refused as
// damage naming the field, and leaves the source at `cursor`.
template <typename Source>
void expect_each_field_refused(Source& src, const std::string& st, uint64_t cursor,
                               const std::vector<std::pair<std::string, std::string>>& cases) {
  for (const auto& [field, value] : cases) {
    SCOPED_TRACE(field + " = " + value);
    auto j = nlohmann::json::parse(st);
    j[field] = nlohmann::json::parse(value);
    try {
      src.restore(j.dump());
      ADD_FAILURE() << "accepted";
    } catch (const loom::ckpt::CheckpointDamaged& e) {
      EXPECT_NE(std::string(e.what()).find("\"" + field + "\" is "), std::string::npos) << e.what();
    }
    EXPECT_EQ(src.cursor(), cursor);
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Token shard format
// ---------------------------------------------------------------------------

TEST(TokenShard, RoundTripWidth2And4) {
  TempDir d;
  for (int width : {2, 4}) {
    std::vector<uint32_t> t = {0, 1, 255, 256, 257, 65535};
    if (width == 4) t.push_back(70000);
    const std::string p = d / ("w" + std::to_string(width) + ".bin");
    loom::write_token_shard(p, t.data(), t.size(), width, width == 2 ? 65536 : 100000);
    EXPECT_FALSE(fs::exists(p + ".tmp"));
    EXPECT_EQ(fs::file_size(p), loom::kTokenShardHeaderBytes + t.size() * width);
    TokenShard s(p);
    EXPECT_EQ(s.path(), p);
    EXPECT_EQ(s.width(), width);
    EXPECT_EQ(s.size(), t.size());
    EXPECT_EQ(s.vocab(), width == 2 ? 65536u : 100000u);
    std::vector<int32_t> out(t.size());
    s.copy(0, t.size(), out.data());
    for (std::size_t i = 0; i < t.size(); ++i) {
      EXPECT_EQ(s[i], t[i]);
      EXPECT_EQ(out[i], static_cast<int32_t>(t[i]));
    }
    char magic[8];
    std::ifstream(p, std::ios::binary).read(magic, 8);
    EXPECT_EQ(std::string(magic, 8), "LOOMTOKS");
  }
  // An empty shard is valid.
  loom::write_token_shard(d / "empty.bin", nullptr, 0, 2, 0);
  EXPECT_EQ(TokenShard(d / "empty.bin").size(), 0u);
}

TEST(TokenShard, WriteRejectsTokensThatDoNotFit) {
  TempDir d;
  const uint32_t big[] = {1, 70000};
  EXPECT_NE(error_of([&] { loom::write_token_shard(d / "a.bin", big, 2, 2, 0); }).find("does not fit 2-byte"),
            std::string::npos);
  const uint32_t t[] = {1, 300};
  EXPECT_NE(error_of([&] { loom::write_token_shard(d / "b.bin", t, 2, 2, 258); }).find("outside the vocabulary"),
            std::string::npos);
  EXPECT_NE(error_of([&] { loom::write_token_shard(d / "c.bin", t, 2, 3, 0); }).find("width 3"), std::string::npos);
  EXPECT_FALSE(fs::exists(d / "a.bin"));
  EXPECT_FALSE(fs::exists(d / "a.bin.tmp"));
}

TEST(TokenShard, CorruptFilesAreRejectedNamingTheFile) {
  TempDir d;
  auto fresh = [&](const std::string& name) { return write_tokens(d / name, token_pattern(1000, 258), 2, 258); };

  const std::string trunc = fresh("trunc.bin");
  fs::resize_file(trunc, 1500);
  std::string m = error_of([&] { TokenShard s(trunc); });
  EXPECT_NE(m.find(trunc), std::string::npos) << m;
  EXPECT_NE(m.find("truncated"), std::string::npos) << m;
  EXPECT_NE(m.find("header says 1000 tokens"), std::string::npos) << m;
  EXPECT_NE(m.find("3024 bytes"), std::string::npos) << m;
  EXPECT_NE(m.find("1500 bytes"), std::string::npos) << m;

  const std::string longer = fresh("long.bin");
  std::ofstream(longer, std::ios::binary | std::ios::app) << "xx";
  m = error_of([&] { TokenShard s(longer); });
  EXPECT_NE(m.find(longer), std::string::npos) << m;
  EXPECT_NE(m.find("3026 bytes"), std::string::npos) << m;

  const std::string tiny = d / "tiny.bin";
  write_file(tiny, "LOOMTOKS");
  m = error_of([&] { TokenShard s(tiny); });
  EXPECT_NE(m.find(tiny), std::string::npos) << m;
  EXPECT_NE(m.find("1024-byte header"), std::string::npos) << m;

  const std::string magic = fresh("magic.bin");
  patch_file(magic, 0, "GPT2TOKS", 8);
  m = error_of([&] { TokenShard s(magic); });
  EXPECT_NE(m.find(magic), std::string::npos) << m;
  EXPECT_NE(m.find("GPT2TOKS"), std::string::npos) << m;
  EXPECT_NE(m.find("LOOMTOKS"), std::string::npos) << m;

  const std::string version = fresh("version.bin");
  const uint32_t v7 = 7;
  patch_file(version, 8, &v7, 4);
  m = error_of([&] { TokenShard s(version); });
  EXPECT_NE(m.find(version), std::string::npos) << m;
  EXPECT_NE(m.find("version 7"), std::string::npos) << m;

  const std::string width = fresh("width.bin");
  const uint32_t w3 = 3;
  patch_file(width, 12, &w3, 4);
  m = error_of([&] { TokenShard s(width); });
  EXPECT_NE(m.find(width), std::string::npos) << m;
  EXPECT_NE(m.find("width 3"), std::string::npos) << m;
  EXPECT_NE(m.find("2 or 4"), std::string::npos) << m;

  const std::string missing = d / "nope.bin";
  m = error_of([&] { TokenShard s(missing); });
  EXPECT_NE(m.find(missing), std::string::npos) << m;
  EXPECT_NE(m.find("does not exist"), std::string::npos) << m;

  // The untouched shard still opens (the checks above are not simply always failing).
  EXPECT_EQ(TokenShard(fresh("good.bin")).size(), 1000u);
}

TEST(TokenShard, CopyChecksRangeAndVocabulary) {
  TempDir d;
  const std::string p = write_tokens(d / "s.bin", token_pattern(100, 1000));
  TokenShard s(p);
  std::vector<int32_t> out(100);
  s.copy(0, 50, out.data(), 50);  // ids 0..49 are all < 50
  std::string m = error_of([&] { s.copy(10, 50, out.data(), 50); });
  EXPECT_NE(m.find(p), std::string::npos) << m;
  EXPECT_NE(m.find("index 50"), std::string::npos) << m;
  m = error_of([&] { s.copy(90, 11, out.data()); });
  EXPECT_NE(m.find("outside the shard"), std::string::npos) << m;
}

// A shard's header states its tokenizer's vocabulary: a token at or beyond
// it means the shard is damaged, whatever model.vocab_size is — refused
// naming the shard, the index, the token and the header's vocabulary, and
// never with advice to raise model.vocab_size (no value would make it right).
// A shard whose header gives no vocabulary is held to the model's, and then
// the advice is right.
TEST(TokenShard, TokenBeyondTheHeadersVocabularyIsDamage) {
  TempDir d;
  std::vector<uint32_t> t(64, 5);
  t[37] = 300;
  const std::string p = write_damaged_tokens(d / "damaged.bin", t, 2, 258);  // as if written for vocabulary 258
  TokenShard s(p);
  ASSERT_EQ(s.vocab(), 258u);
  std::vector<int32_t> out(64);
  for (const int64_t limit : {int64_t{512}, int64_t{1} << 31, int64_t{301}}) {
    SCOPED_TRACE(limit);
    const std::string m = error_of([&] { s.copy(0, 64, out.data(), limit); });
    for (const std::string part : {p, std::string("index 37 is 300"), std::string("vocabulary of 258"),
                                   std::string("its header declares"), std::string("damaged")})
      EXPECT_NE(m.find(part), std::string::npos) << "missing '" << part << "' in: " << m;
    EXPECT_EQ(m.find("model.vocab_size is too small"), std::string::npos) << m;
    EXPECT_EQ(m.find("set it >="), std::string::npos) << m;
    EXPECT_EQ(error_of([&] { (void)s.scan(limit); }), m);
  }
  EXPECT_NO_THROW(s.copy(0, 37, out.data(), 512));  // the tokens before it are fine
  // Through the tokens plugin, with a model vocabulary larger than the header's.
  TokensOptions o;
  o.train = {p};
  o.shuffle = false;
  auto src = tokens_source(o, spec(1, 63, 0, 1, 1, 512));
  Batch b(64);
  const std::string m = error_of([&] { src->next(Split::train, b.data()); });
  EXPECT_NE(m.find("index 37 is 300, not below the vocabulary of 258 its header declares"), std::string::npos) << m;
  // No vocabulary in the header: the model's decides, and the advice fits.
  const std::string q = write_tokens(d / "unknown.bin", t);
  const std::string m2 = error_of([&] { TokenShard(q).copy(0, 64, out.data(), 258); });
  EXPECT_NE(m2.find("index 37 is 300, not below the model vocabulary 258"), std::string::npos) << m2;
  EXPECT_NE(m2.find("set it >= 301"), std::string::npos) << m2;
}

// scan() reads every token (loom check): the first bad one is found wherever
// it is — around the 4096-token blocks the scan reduces, at the ends — for
// both token widths and both limits (the header's and the model's).
TEST(TokenShard, ScanFindsTheFirstBadTokenAnywhere) {
  TempDir d;
  const uint64_t n = 3 * 4096 + 17;
  for (const int width : {2, 4}) {
    const std::vector<uint32_t> t = token_pattern(n, 250);
    const std::string clean = write_tokens(d / ("clean" + std::to_string(width) + ".bin"), t, width, 258);
    EXPECT_EQ(TokenShard(clean).scan(258), n);
    for (const uint64_t at : {uint64_t{0}, uint64_t{4095}, uint64_t{4096}, uint64_t{8191}, uint64_t{12287}, n - 1}) {
      for (const uint32_t bad : {258u, width == 2 ? 65535u : 4294967295u}) {
        SCOPED_TRACE(width * 1000000 + at);
        auto u = t;
        u[at] = bad;
        if (at + 1 < n) u[n - 1] = 300;  // a later bad token: the first one is named
        const std::string p = write_damaged_tokens(d / "bad.bin", u, width, 258);
        const std::string m = error_of([&] { (void)TokenShard(p).scan(100000); });
        EXPECT_NE(m.find("index " + std::to_string(at) + " is " + std::to_string(bad)), std::string::npos) << m;
      }
      // Below the header's vocabulary but not below the model's: the model's limit.
      auto u = t;
      u[at] = 255;
      const std::string p = write_tokens(d / "model.bin", u, width);
      const std::string m = error_of([&] { (void)TokenShard(p).scan(250); });
      EXPECT_NE(m.find("index " + std::to_string(at) + " is 255, not below the model vocabulary 250"), std::string::npos)
          << m;
    }
  }
}

// The tokens plugin's scan (loom::TokenScan, what `loom check` runs): every
// train and validation shard, the first bad token named; the count of tokens
// read when all are good.
TEST(TokensData, ScanReadsEveryTrainAndValidationToken) {
  Corpus c;
  auto src = tokens_source(c.options(), spec(1, 4));
  const loom::TokenScanReport r = src->scan_tokens();
  EXPECT_EQ(r.tokens, 41u + 30 + 23 + 21);
  EXPECT_EQ(r.files, 4u);
  EXPECT_EQ(r.what, "3 train shard(s), 1 validation shard(s)");
  // A bad token in the last token of a train shard, then in the validation shard.
  set_token(c.shards[2], 22, 1000);
  expect_error_parts(error_of([&] { (void)tokens_source(c.options(), spec(1, 4))->scan_tokens(); }),
                     {c.shards[2], "index 22 is 1000"});
  set_token(c.shards[2], 22, 7);
  set_token(c.dir / "val.bin", 3, 1000);
  expect_error_parts(error_of([&] { (void)tokens_source(c.options(), spec(1, 4))->scan_tokens(); }),
                     {c.dir / "val.bin", "index 3 is 1000"});
  // A shard too short for a window is read by no run, but scanned all the same (it is damaged).
  EXPECT_EQ(tokens_source(c.options(true, false), spec(1, 4))->scan_tokens().tokens, 41u + 30 + 23);
}

// End to end: `loom check` reads every token before a run and names a bad
// one far into the data, which training would meet only when a window
// reaches it (after steps and checkpoints).
TEST(TokensData, CheckFindsABadTokenBeforeTraining) {
  TempDir d;
  write_tokens(d / "train_000.bin", token_pattern(200000, 250), 2, 258);
  write_tokens(d / "val.bin", token_pattern(5000, 250), 2, 258);
  const std::string cfg = d / "c.toml";
  write_file(cfg, "[run]\nout_dir = \"" + d / "run" + "\"\ndevice = \"cpu\"\n"
                  "[model]\nhidden = 32\nnum_layers = 1\nnum_heads = 2\nnum_kv_heads = 2\nffn_hidden = 64\n"
                  "vocab_size = 258\nmax_seq_len = 16\n"
                  "[train]\nsteps = 3\nmicro_batch = 2\nseq_len = 16\nvalidation_every = 1\n"
                  "[data]\nplugin = \"tokens\"\ntrain = \"" + d / "train_*.bin" + "\"\nval = \"" + d / "val.bin" + "\"\n");
  const std::string log = d / "check.log";
  auto check = [&] {
    const int rc = std::system((std::string("'") + LOOM_CLI + "' check '" + cfg + "' > '" + log + "' 2>&1").c_str());
    std::ifstream in(log);
    return std::make_pair(WEXITSTATUS(rc), std::string(std::istreambuf_iterator<char>(in), {}));
  };
  auto [rc, out] = check();
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("data: 205000 tokens of 1 train shard(s), 1 validation shard(s) scanned in "), std::string::npos)
      << out;
  EXPECT_NE(out.find("every one is below model.vocab_size = 258"), std::string::npos) << out;
  set_token(d / "train_000.bin", 150001, 65535);
  std::tie(rc, out) = check();
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find(d / "train_000.bin" + "': token at index 150001 is 65535, not below the vocabulary of 258"),
            std::string::npos)
      << out;
  EXPECT_FALSE(fs::exists(d / "run/metrics.jsonl"));
  // --no-scan leaves the scan out (the plan of a run on a corpus too large to read now).
  const int no_scan =
      std::system((std::string("'") + LOOM_CLI + "' check '" + cfg + "' --no-scan > '" + log + "' 2>&1").c_str());
  std::ifstream in(log);
  out.assign(std::istreambuf_iterator<char>(in), {});
  EXPECT_EQ(WEXITSTATUS(no_scan), 0) << out;
  EXPECT_NE(out.find("data: tokens not scanned (--no-scan)"), std::string::npos) << out;
}

TEST(IndexPermutation, IsABijectionAndDependsOnSeedAndEpoch) {
  for (uint64_t n : {1ull, 2ull, 3ull, 17ull, 64ull, 1000ull, 4097ull}) {
    loom::data::IndexPermutation p(n, 42, 0);
    std::vector<bool> hit(n, false);
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t j = p(i);
      ASSERT_LT(j, n);
      ASSERT_FALSE(hit[j]) << "n=" << n;
      hit[j] = true;
    }
  }
  auto order = [](uint64_t seed, uint64_t epoch) {
    loom::data::IndexPermutation p(1000, seed, epoch);
    std::vector<uint64_t> v;
    for (uint64_t i = 0; i < 1000; ++i) v.push_back(p(i));
    return v;
  };
  EXPECT_EQ(order(1, 0), order(1, 0));
  EXPECT_NE(order(1, 0), order(2, 0));
  EXPECT_NE(order(1, 0), order(1, 1));
}

// ---------------------------------------------------------------------------
// tokens plugin
// ---------------------------------------------------------------------------

TEST(TokensData, WindowsAndFileOrderWithoutShuffle) {
  Corpus c;
  const DataSpec s = spec(2, 4);
  auto src = tokens_source(c.options(false), s);
  EXPECT_EQ(src->train_windows(), 22u);
  EXPECT_EQ(src->val_windows(), 5u);
  EXPECT_EQ(src->vocab_hint(), 0);  // shards were written with vocab 0 (unknown)
  // Expected window starts in file order: shard 0 at 0,4,..,36; shard 1 at 100,104,..; shard 2 at 200,...
  std::vector<int32_t> starts;
  for (int w = 0; w < 10; ++w) starts.push_back(4 * w);
  for (int w = 0; w < 7; ++w) starts.push_back(100 + 4 * w);
  for (int w = 0; w < 5; ++w) starts.push_back(200 + 4 * w);
  std::vector<int32_t> seen;
  for (auto& b : take(*src, s, 22)) {  // 44 windows: two epochs
    for (int row = 0; row < 2; ++row) {
      const int32_t* r = b.data() + row * 5;
      for (int k = 1; k < 5; ++k) ASSERT_EQ(r[k], r[0] + k) << "window crosses a shard boundary";
      seen.push_back(r[0]);
    }
  }
  for (std::size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], starts[i % 22]) << i;
}

TEST(TokensData, ShuffledEpochsArePermutationsAndSeedDetermined) {
  Corpus c;
  const DataSpec s = spec(1, 4, 0, 1, 7);
  auto a = tokens_source(c.options(), s);
  auto b = tokens_source(c.options(), s);
  auto other = tokens_source(c.options(), spec(1, 4, 0, 1, 8));
  const auto ba = take(*a, s, 44), bb = take(*b, s, 44), bo = take(*other, s, 44);
  EXPECT_EQ(ba, bb);
  EXPECT_NE(ba, bo);
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::multiset<int32_t> starts;
    for (int i = 0; i < 22; ++i) starts.insert(ba[epoch * 22 + i][0]);
    std::multiset<int32_t> all;
    for (int w = 0; w < 10; ++w) all.insert(4 * w);
    for (int w = 0; w < 7; ++w) all.insert(100 + 4 * w);
    for (int w = 0; w < 5; ++w) all.insert(200 + 4 * w);
    EXPECT_EQ(starts, all) << "epoch " << epoch;
  }
  std::vector<int32_t> e0, e1;
  for (int i = 0; i < 22; ++i) {
    e0.push_back(ba[i][0]);
    e1.push_back(ba[22 + i][0]);
  }
  EXPECT_NE(e0, e1) << "each epoch has its own order";
}

TEST(TokensData, ResumeIsExact) {
  Corpus c;
  const DataSpec s = spec(3, 4, 0, 1, 11);
  auto src = tokens_source(c.options(), s);
  take(*src, s, 5);  // k = 5 batches; the m = 9 after them cross into epoch 1 (22 windows)
  const std::string st = src->state();
  const auto expected = take(*src, s, 9);
  auto fresh = tokens_source(c.options(), s);
  fresh->restore(st);
  EXPECT_EQ(take(*fresh, s, 9), expected);
  const auto j = nlohmann::json::parse(st);
  EXPECT_EQ(j.at("cursor").get<uint64_t>(), 15u);
  EXPECT_EQ(j.at("epoch").get<uint64_t>(), 0u);
  EXPECT_EQ(j.at("world").get<int>(), 1);
  EXPECT_EQ(j.at("seed").get<uint64_t>(), 11u);
  EXPECT_EQ(j.at("train_files").size(), 3u);
  EXPECT_EQ(j.at("train_files")[1].at("tokens").get<uint64_t>(), 30u);
}

TEST(TokensData, RanksSplitTheGlobalBatch) {
  Corpus c;
  const int64_t b = 2;
  auto one = tokens_source(c.options(), spec(2 * b, 4, 0, 1, 3));
  auto r0 = tokens_source(c.options(), spec(b, 4, 0, 2, 3));
  auto r1 = tokens_source(c.options(), spec(b, 4, 1, 2, 3));
  const auto g = take(*one, spec(2 * b, 4, 0, 1, 3), 8);
  const auto a = take(*r0, spec(b, 4, 0, 2, 3), 8), z = take(*r1, spec(b, 4, 1, 2, 3), 8);
  for (int i = 0; i < 8; ++i) {
    Batch joined = a[i];
    joined.insert(joined.end(), z[i].begin(), z[i].end());
    EXPECT_EQ(joined, g[i]) << "global batch " << i;
    if (i < 5) {  // within one epoch (22 windows) the ranks' windows are disjoint
      std::set<int32_t> s0 = {a[i][0], a[i][5]}, s1 = {z[i][0], z[i][5]};
      for (int32_t x : s0) EXPECT_EQ(s1.count(x), 0u);
    }
  }
}

TEST(TokensData, RestoreUnderAnotherWorldContinuesFromTheGlobalCursor) {
  Corpus c;
  auto one = tokens_source(c.options(), spec(4, 4, 0, 1, 5));
  take(*one, spec(4, 4, 0, 1, 5), 3);
  const std::string st = one->state();
  const auto expected = take(*one, spec(4, 4, 0, 1, 5), 4);
  auto r0 = tokens_source(c.options(), spec(2, 4, 0, 2, 99));  // the checkpoint's seed wins
  auto r1 = tokens_source(c.options(), spec(2, 4, 1, 2, 99));
  r0->restore(st);
  r1->restore(st);
  const auto a = take(*r0, spec(2, 4, 0, 2), 4), z = take(*r1, spec(2, 4, 1, 2), 4);
  for (int i = 0; i < 4; ++i) {
    Batch joined = a[i];
    joined.insert(joined.end(), z[i].begin(), z[i].end());
    EXPECT_EQ(joined, expected[i]);
  }
}

TEST(TokensData, RestoreRejectsChangedDataAndBadState) {
  Corpus c;
  const DataSpec s = spec(1, 4);
  auto src = tokens_source(c.options(), s);
  take(*src, s, 2);
  const std::string st = src->state();
  write_tokens(c.dir / "train_001.bin", token_pattern(34, 1000, 100));  // the same name, another length
  auto changed = tokens_source(c.options(), s);
  std::string m = error_of([&] { changed->restore(st); });
  EXPECT_NE(m.find("the data changed since the checkpoint"), std::string::npos) << m;
  EXPECT_NE(m.find("train_001.bin"), std::string::npos) << m;

  auto other_len = tokens_source(c.options(), spec(1, 3));
  auto j = nlohmann::json::parse(st);
  j["train_files"][1]["tokens"] = 34;
  m = error_of([&] { other_len->restore(j.dump()); });
  EXPECT_NE(m.find("seq_len 4"), std::string::npos) << m;
  m = error_of([&] { changed->restore("{not json"); });
  EXPECT_NE(m.find("not valid JSON"), std::string::npos) << m;
  m = error_of([&] { changed->restore(R"({"source":"synthetic","cursor":1})"); });
  EXPECT_NE(m.find("'synthetic'"), std::string::npos) << m;
  j["train_files"][1]["tokens"] = 34;
  j["windows_per_epoch"] = changed->train_windows();
  changed->restore(j.dump());  // with matching counts (and windows) the state is accepted
  EXPECT_EQ(changed->cursor(), 2u);
}

// A state at the edges of what it may hold — the first window, the last of
// an epoch, the first of the next, 2^53 windows in; seeds 0 and 2^63 - 1 —
// resumes exactly where the stream is at that window; a state holding any
// field of another type or out of range is refused as damage
// (ckpt::CheckpointDamaged, so the core names an earlier checkpoint) and
// leaves the position as it was.
TEST(TokensData, RestoreTakesEveryEdgeAndRefusesDamageWithoutMoving) {
  Corpus c;
  const DataSpec s = spec(1, 4, 0, 1, 11);
  auto ref = tokens_source(c.options(), s);
  const uint64_t W = ref->train_windows();
  ASSERT_EQ(W, 22u);
  const std::string st = ref->state();
  const auto stream = take(*ref, s, static_cast<int>(2 * W + 2));
  auto at = [&](uint64_t cursor, uint64_t epoch) {
    auto j = nlohmann::json::parse(st);
    j["cursor"] = cursor;
    j["epoch"] = epoch;
    return j.dump();
  };
  for (const uint64_t k : {uint64_t{0}, W - 1, W, 2 * W - 1, 2 * W}) {
    SCOPED_TRACE(k);
    auto src = tokens_source(c.options(), s);
    src->restore(at(k, k / W));
    EXPECT_EQ(src->cursor(), k);
    EXPECT_EQ(take(*src, s, 2), std::vector<Batch>(stream.begin() + static_cast<long>(k), stream.begin() + static_cast<long>(k) + 2));
  }
  auto far = tokens_source(c.options(), s);
  const uint64_t kPos = uint64_t{1} << 53;
  far->restore(at(kPos, kPos / W));
  EXPECT_EQ(far->cursor(), kPos);
  take(*far, s, 2);  // windows of epoch 2^53 / 22: read, no overflow
  for (const int64_t seed : {int64_t{0}, std::numeric_limits<int64_t>::max()}) {
    auto j = nlohmann::json::parse(st);
    j["seed"] = seed;
    auto src = tokens_source(c.options(), s);
    src->restore(j.dump());
    auto same = tokens_source(c.options(), spec(1, 4, 0, 1, static_cast<uint64_t>(seed)));
    EXPECT_EQ(take(*src, s, int(W)), take(*same, s, int(W))) << "seed " << seed;
  }

  auto src = tokens_source(c.options(), s);
  take(*src, s, 3);
  expect_each_field_refused(*src, st, 3,
                            {{"cursor", "-1"}, {"cursor", "1.5"}, {"cursor", "18446744073709551615"},
                             {"cursor", "9007199254740993"}, {"cursor", "22"}, {"cursor", "true"}, {"epoch", "-1"},
                             {"epoch", "1"}, {"epoch", "null"}, {"windows_per_epoch", "0"},
                             {"windows_per_epoch", "23"}, {"seed", "-1"}, {"seed", "9223372036854775808"},
                             {"world", "0"}, {"world", "1048577"}, {"batch", "-4"}, {"batch", "\"4\""},
                             {"seq_len", "4.0"}, {"shuffle", "1"}, {"version", "0"}});
  EXPECT_EQ(take(*src, s, 2), std::vector<Batch>(stream.begin() + 3, stream.begin() + 5));
}

TEST(TokensData, ValidationResetsAndWraps) {
  Corpus c;
  const DataSpec s = spec(2, 4);
  auto src = tokens_source(c.options(), s);
  ASSERT_TRUE(src->has_split(Split::validation));
  const auto first = take(*src, s, 5, Split::validation);  // 10 windows of 5: wraps twice
  for (int i = 0; i < 5; ++i)
    for (int row = 0; row < 2; ++row) EXPECT_EQ(first[i][row * 5], 500 + 4 * ((2 * i + row) % 5));
  take(*src, s, 3);  // training in between does not move validation
  src->reset(Split::validation);
  EXPECT_EQ(take(*src, s, 5, Split::validation), first);
  EXPECT_THROW(src->reset(Split::train), loom::Error);

  auto noval = tokens_source(c.options(true, false), s);
  EXPECT_FALSE(noval->has_split(Split::validation));
  EXPECT_TRUE(noval->has_split(Split::train));
  Batch b(10);
  const std::string m = error_of([&] { noval->next(Split::validation, b.data()); });
  EXPECT_NE(m.find("no validation split"), std::string::npos) << m;
}

TEST(TokensData, VocabularyChecks) {
  TempDir d;
  std::vector<uint32_t> t(64, 5);
  t[37] = 900;
  const std::string p = write_tokens(d / "bad.bin", t);
  TokensOptions o;
  o.train = {p};
  o.shuffle = false;
  const DataSpec s = spec(1, 63, 0, 1, 1, 500);
  auto src = tokens_source(o, s);
  Batch b(64);
  const std::string m = error_of([&] { src->next(Split::train, b.data()); });
  EXPECT_NE(m.find(p), std::string::npos) << m;
  EXPECT_NE(m.find("index 37"), std::string::npos) << m;
  EXPECT_NE(m.find("900"), std::string::npos) << m;

  const std::string q = write_tokens(d / "v.bin", token_pattern(64, 258), 2, 258);
  o.train = {q};
  const std::string m2 = error_of([&] { tokens_source(o, spec(1, 8, 0, 1, 1, 200)); });
  EXPECT_NE(m2.find(q), std::string::npos) << m2;
  EXPECT_NE(m2.find("258"), std::string::npos) << m2;
  EXPECT_NE(m2.find("200"), std::string::npos) << m2;
  EXPECT_EQ(tokens_source(o, spec(1, 8, 0, 1, 1, 258))->vocab_hint(), 258);
}

TEST(TokensData, OpenErrorsNameTheProblem) {
  Corpus c;
  TokensOptions o = c.options();
  o.train = {c.dir / "nothing_*.bin"};
  std::string m = error_of([&] { tokens_source(o, spec(1, 4)); });
  EXPECT_NE(m.find("nothing_*.bin"), std::string::npos) << m;
  EXPECT_NE(m.find("matches no files"), std::string::npos) << m;

  o = c.options();
  m = error_of([&] { tokens_source(o, spec(1, 64)); });  // no shard holds 65 tokens
  EXPECT_NE(m.find("no window"), std::string::npos) << m;

  const std::string bad = c.dir / "train_003.bin";
  write_file(bad, std::string(2000, 'x'));
  m = error_of([&] { tokens_source(c.options(), spec(1, 4)); });
  EXPECT_NE(m.find(bad), std::string::npos) << m;

  m = error_of([&] { TokensData t(loom::PluginInit{}); });  // empty table: train is required
  EXPECT_NE(m.find("train"), std::string::npos) << m;

  auto unopened = std::make_unique<TokensData>(loom::PluginInit{}, c.options());
  Batch b(5);
  EXPECT_THROW(unopened->next(Split::train, b.data()), loom::Error);
}

// ---------------------------------------------------------------------------
// synthetic plugin
// ---------------------------------------------------------------------------

namespace {
std::unique_ptr<SyntheticData> synthetic(const std::string& pattern, int64_t vocab, const DataSpec& s) {
  loom::data::SyntheticOptions o;
  o.pattern = pattern;
  o.vocab = vocab;
  auto src = std::make_unique<SyntheticData>(loom::PluginInit{}, o);
  src->open(s);
  return src;
}
}  // namespace

TEST(SyntheticData, DeterministicAndSeeded) {
  const DataSpec s = spec(4, 16, 0, 1, 3, 5000);
  auto a = synthetic("random", 0, s), b = synthetic("random", 0, s);
  auto c = synthetic("random", 0, spec(4, 16, 0, 1, 4, 5000));
  const auto ba = take(*a, s, 3);
  EXPECT_EQ(ba, take(*b, s, 3));
  EXPECT_NE(ba, take(*c, s, 3));
  EXPECT_NE(ba[0], ba[1]);
  std::set<int32_t> distinct;
  for (auto& x : ba)
    for (int32_t t : x) {
      ASSERT_GE(t, 0);
      ASSERT_LT(t, 5000);
      distinct.insert(t);
    }
  EXPECT_GT(distinct.size(), 150u);  // 204 draws from 5000 ids are mostly distinct
  EXPECT_EQ(a->vocab_hint(), 5000);
}

TEST(SyntheticData, RampIsLearnableAndRespectsVocab) {
  const DataSpec s = spec(8, 32, 0, 1, 1, 1000);
  auto src = synthetic("ramp", 50, s);
  EXPECT_EQ(src->vocab_hint(), 50);
  std::set<int32_t> starts;
  for (auto& b : take(*src, s, 2))
    for (int row = 0; row < 8; ++row) {
      const int32_t* r = b.data() + row * 33;
      starts.insert(r[0]);
      for (int p = 1; p < 33; ++p) ASSERT_EQ(r[p], (r[p - 1] + 1) % 50);
    }
  EXPECT_GT(starts.size(), 5u);
  EXPECT_THROW(synthetic("ramp", 2000, s), loom::Error);  // larger than the model vocab
  EXPECT_THROW(synthetic("zigzag", 0, s), loom::Error);
}

// The same for synthetic: the first sample, 2^53 samples in, seeds 0 and
// 2^63 - 1, ranks and batches up to 2^20, vocab 1 and 2^31 - 1 resume; a
// field of another type or out of range is damage and moves nothing.
TEST(SyntheticData, RestoreTakesEveryEdgeAndRefusesDamageWithoutMoving) {
  const DataSpec s = spec(2, 8, 0, 1, 9, 100);
  auto ref = synthetic("random", 0, s);
  const std::string st = ref->state();
  const auto stream = take(*ref, s, 4);
  const uint64_t kPos = uint64_t{1} << 53;
  for (const uint64_t k : {uint64_t{0}, uint64_t{4}, kPos}) {
    SCOPED_TRACE(k);
    auto j = nlohmann::json::parse(st);
    j["cursor"] = k;
    auto src = synthetic("random", 0, s);
    src->restore(j.dump());
    EXPECT_EQ(src->cursor(), k);
    const Batch b = take(*src, s, 1)[0];
    for (uint64_t i = 0; i < 2; ++i)
      for (uint64_t p = 0; p < 9; ++p) ASSERT_EQ(b[i * 9 + p], src->token(Split::train, k + i, p));
    if (k < 8) EXPECT_EQ(b, stream[k / 2]);
  }
  for (const auto& [field, value] : std::vector<std::pair<std::string, nlohmann::json>>{
           {"seed", 0}, {"seed", std::numeric_limits<int64_t>::max()}, {"world", 1 << 20}, {"batch", 1 << 20},
           {"vocab", 1}, {"vocab", 2147483647}, {"pattern", "ramp"}}) {
    SCOPED_TRACE(field);
    auto j = nlohmann::json::parse(st);
    j[field] = value;
    auto src = synthetic("random", 0, s);
    src->restore(j.dump());
    if (field == "seed") {
      auto same = synthetic("random", 0, spec(2, 8, 0, 1, value.get<uint64_t>(), 100));
      EXPECT_EQ(take(*src, s, 2), take(*same, s, 2));
    } else {
      EXPECT_EQ(take(*src, s, 2), std::vector<Batch>(stream.begin(), stream.begin() + 2));
    }
  }

  auto src = synthetic("random", 0, s);
  take(*src, s, 1);
  expect_each_field_refused(*src, st, 2,
                            {{"cursor", "-1"}, {"cursor", "2.5"}, {"cursor", "18446744073709551616"},
                             {"cursor", "9007199254740993"}, {"cursor", "null"}, {"seed", "-7"}, {"seed", "1e19"},
                             {"world", "0"}, {"world", "\"2\""}, {"batch", "1048577"}, {"batch", "false"},
                             {"vocab", "0"}, {"vocab", "2147483648"}, {"pattern", "3"}, {"pattern", "\"zigzag\""},
                             {"version", "-1"}, {"source", "null"}});
  EXPECT_EQ(take(*src, s, 3), std::vector<Batch>(stream.begin() + 1, stream.begin() + 4));
}

TEST(SyntheticData, ResumeRanksAndValidation) {
  const DataSpec s = spec(2, 8, 0, 1, 9, 100);
  auto src = synthetic("random", 0, s);
  take(*src, s, 3);
  const std::string st = src->state();
  const auto expected = take(*src, s, 4);
  auto fresh = synthetic("random", 0, spec(2, 8, 0, 1, 1234, 100));  // the checkpoint's seed wins
  fresh->restore(st);
  EXPECT_EQ(take(*fresh, s, 4), expected);

  // World 2 with batch 1 after restore: rank rows concatenated give the world-1 batches.
  auto r0 = synthetic("random", 0, spec(1, 8, 0, 2, 9, 100));
  auto r1 = synthetic("random", 0, spec(1, 8, 1, 2, 9, 100));
  r0->restore(st);
  r1->restore(st);
  const auto a = take(*r0, spec(1, 8, 0, 2), 4), z = take(*r1, spec(1, 8, 1, 2), 4);
  for (int i = 0; i < 4; ++i) {
    Batch joined = a[i];
    joined.insert(joined.end(), z[i].begin(), z[i].end());
    EXPECT_EQ(joined, expected[i]);
    EXPECT_NE(a[i], z[i]);
  }

  const auto v1 = take(*src, s, 3, Split::validation);
  src->reset(Split::validation);
  EXPECT_EQ(take(*src, s, 3, Split::validation), v1);
  auto t0 = synthetic("random", 0, s);
  const auto train = take(*t0, s, 3);
  EXPECT_NE(v1, train) << "validation is its own stream";
  EXPECT_TRUE(src->has_split(Split::validation));
  EXPECT_THROW(src->restore(R"({"source":"tokens"})"), loom::Error);
}

// ---------------------------------------------------------------------------
// byte tokenizer and loom prepare text
// ---------------------------------------------------------------------------

TEST(ByteTokenizer, EncodeDecodeAndTextDetection) {
  std::vector<uint32_t> t;
  loom::data::ByteTokenizer::encode_document("h\xc3\xa9", t);
  EXPECT_EQ(t, (std::vector<uint32_t>{256, 'h', 0xc3, 0xa9, 257}));
  std::vector<int32_t> ids(t.begin(), t.end());
  EXPECT_EQ(loom::data::ByteTokenizer::decode(ids.data(), ids.size()), "<s>h\xc3\xa9</s>");

  std::string why;
  EXPECT_TRUE(loom::data::is_utf8_text("plain \xe2\x82\xac text\n", &why));
  EXPECT_FALSE(loom::data::is_utf8_text(std::string("a\0b", 3), &why));
  EXPECT_NE(why.find("NUL byte at byte offset 1"), std::string::npos) << why;
  EXPECT_FALSE(loom::data::is_utf8_text("caf\xe9", &why));        // Latin-1
  EXPECT_FALSE(loom::data::is_utf8_text("\xc0\xaf", &why));       // overlong
  EXPECT_FALSE(loom::data::is_utf8_text("\xed\xa0\x80", &why));   // surrogate
  EXPECT_FALSE(loom::data::is_utf8_text("\xe2\x82", &why));       // truncated

  auto docs = loom::data::split_documents("one\nline\n%\ntwo\n%\n\n%\nthree%\nstill three\n%\n");
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(docs[0], "one\nline\n");
  EXPECT_EQ(docs[1], "two\n");
  EXPECT_EQ(docs[2], "three%\nstill three\n");
  docs = loom::data::split_documents("no separators\n");
  ASSERT_EQ(docs.size(), 1u);
  EXPECT_EQ(docs[0], "no separators\n");
}

namespace {
// All tokens of the shards, in order.
std::vector<int32_t> read_all(const std::vector<std::string>& paths) {
  std::vector<int32_t> all;
  for (auto& p : paths) {
    TokenShard s(p);
    std::vector<int32_t> v(s.size());
    s.copy(0, s.size(), v.data());
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}
// Documents between BOS and EOS.
std::vector<std::string> documents_of(const std::vector<int32_t>& t) {
  std::vector<std::string> docs;
  std::string cur;
  bool in = false;
  for (int32_t x : t) {
    if (x == 256) {
      EXPECT_FALSE(in);
      in = true;
      cur.clear();
    } else if (x == 257) {
      EXPECT_TRUE(in);
      in = false;
      docs.push_back(cur);
    } else {
      EXPECT_TRUE(in);
      cur += static_cast<char>(x);
    }
  }
  EXPECT_FALSE(in);
  return docs;
}

void make_inputs(const TempDir& d) {
  write_file(d / "in/a.txt", "alpha text\n");
  std::string fort;
  for (int i = 0; i < 30; ++i) fort += "fortune " + std::to_string(i) + "\n%\n";
  write_file(d / "in/b.txt", fort);
  write_file(d / "in/bin.dat", std::string("\0\0\0\x02\x10", 5));
  write_file(d / "in/latin1.txt", "caf\xe9\n");
  write_file(d / "in/sub/c.txt", "gamma\n");
  fs::create_symlink("a.txt", d / "in/link.txt");
}
// Writes make_inputs' corpus and returns the options that prepare it into
// d/out: a quarter for validation, shards of 100 tokens.
loom::data::PrepareTextOptions small_prepare(const TempDir& d) {
  make_inputs(d);
  loom::data::PrepareTextOptions o;
  o.out_dir = d / "out";
  o.inputs = {d / "in"};
  o.val_fraction = 0.25;
  o.shard_tokens = 100;
  return o;
}
}  // namespace

TEST(PrepareText, DocumentsSkipsAndDeterministicSplit) {
  TempDir d;
  loom::data::PrepareTextOptions o = small_prepare(d);
  o.seed = 1;
  const auto r = loom::data::prepare_text(o);

  EXPECT_EQ(r.files_used, (std::vector<std::string>{d / "in/a.txt", d / "in/b.txt", d / "in/sub/c.txt"}));
  std::set<std::string> skipped;
  for (auto& [p, why] : r.files_skipped) skipped.insert(p);
  EXPECT_EQ(skipped, (std::set<std::string>{d / "in/bin.dat", d / "in/latin1.txt"}));
  EXPECT_EQ(r.documents, 32u);
  EXPECT_EQ(r.val_documents, 8u);  // round(0.25 * 32)
  EXPECT_EQ(r.train_documents, 24u);

  std::vector<std::string> expected_docs = {"alpha text\n"};
  for (int i = 0; i < 30; ++i) expected_docs.push_back("fortune " + std::to_string(i) + "\n");
  expected_docs.push_back("gamma\n");
  uint64_t total = 0;
  for (auto& e : expected_docs) total += e.size() + 2;
  EXPECT_EQ(r.train_tokens + r.val_tokens, total);

  // Shards: each holds shard_tokens except the last; names sort in write order.
  ASSERT_GE(r.train_shards.size(), 2u);
  for (std::size_t i = 0; i < r.train_shards.size(); ++i) {
    char name[32];
    std::snprintf(name, sizeof name, "train_%03zu.bin", i);
    EXPECT_EQ(fs::path(r.train_shards[i]).filename(), name);
    TokenShard s(r.train_shards[i]);
    EXPECT_EQ(s.width(), 2);
    EXPECT_EQ(s.vocab(), 258u);
    if (i + 1 < r.train_shards.size()) {
      EXPECT_EQ(s.size(), 100u);
    }
  }
  const auto train_docs = documents_of(read_all(r.train_shards));
  const auto val_docs = documents_of(read_all({r.val_shard}));
  EXPECT_EQ(train_docs.size(), 24u);
  EXPECT_EQ(val_docs.size(), 8u);
  // Train and val partition the documents, each in input order.
  std::vector<std::string> merged;
  std::size_t ti = 0, vi = 0;
  for (auto& e : expected_docs) {
    if (ti < train_docs.size() && train_docs[ti] == e) merged.push_back(train_docs[ti++]);
    else if (vi < val_docs.size() && val_docs[vi] == e) merged.push_back(val_docs[vi++]);
  }
  EXPECT_EQ(merged, expected_docs);

  const auto manifest = nlohmann::json::parse(std::ifstream(r.manifest));
  EXPECT_EQ(manifest.at("tokenizer"), "bytes");
  EXPECT_EQ(manifest.at("vocab"), 258);
  EXPECT_EQ(manifest.at("documents"), 32);
  EXPECT_EQ(manifest.at("files_skipped").size(), 2u);
  EXPECT_EQ(manifest.at("train").at("shards").size(), r.train_shards.size());

  // Same seed: byte-identical output. Another seed: another split.
  o.out_dir = d / "out_same";
  const auto same = loom::data::prepare_text(o);
  EXPECT_EQ(read_all(same.train_shards), read_all(r.train_shards));
  EXPECT_EQ(read_all({same.val_shard}), read_all({r.val_shard}));
  o.out_dir = d / "out_seed2";
  o.seed = 2;
  const auto other = loom::data::prepare_text(o);
  EXPECT_EQ(other.val_documents, 8u);
  EXPECT_NE(documents_of(read_all({other.val_shard})), val_docs);

  // A second prepare into a used directory needs --force.
  o.out_dir = d / "out";
  const std::string m = error_of([&] { loom::data::prepare_text(o); });
  EXPECT_NE(m.find("--force"), std::string::npos) << m;
  o.force = true;
  o.shard_tokens = 1000;
  const auto again = loom::data::prepare_text(o);
  EXPECT_EQ(again.train_shards.size(), 1u);
  EXPECT_FALSE(fs::exists(d / "out/train_001.bin")) << "stale shards are removed";

  // The output feeds the tokens plugin directly.
  TokensOptions t;
  t.train = {d / "out/train_*.bin"};
  t.val = {d / "out/val.bin"};
  auto src = tokens_source(t, spec(2, 8, 0, 1, 1, 258));
  EXPECT_EQ(src->vocab_hint(), 258);
  take(*src, spec(2, 8, 0, 1, 1, 258), 3);
  take(*src, spec(2, 8, 0, 1, 1, 258), 1, Split::validation);
}

TEST(PrepareText, InputErrors) {
  TempDir d;
  loom::data::PrepareTextOptions o;
  o.out_dir = d / "out";
  o.inputs = {d / "missing"};
  std::string m = error_of([&] { loom::data::prepare_text(o); });
  EXPECT_NE(m.find(d / "missing"), std::string::npos) << m;
  write_file(d / "only.bin", std::string("\0\1\2", 3));
  o.inputs = {d / "only.bin"};
  m = error_of([&] { loom::data::prepare_text(o); });
  EXPECT_NE(m.find("no usable text"), std::string::npos) << m;
  EXPECT_NE(m.find("only.bin"), std::string::npos) << m;
  o.inputs = {d / "only.bin"};
  o.val_fraction = 1.0;
  EXPECT_THROW(loom::data::prepare_text(o), loom::Error);
}

// --force replaces an earlier prepare's outputs only once the new ones are
// written: a prepare refused or failed at any point (a bad tokenizer, a
// missing input, a bad --bos, inputs without text) leaves the old shards and
// manifest byte for byte, and no staging folder; a prepare into a folder it
// had to create leaves nothing. A successful one leaves exactly its own
// outputs (no stale shard of the old set).
TEST(PrepareText, ForceReplacesTheOldOutputsOnlyAfterSuccess) {
  TempDir d;
  loom::data::PrepareTextOptions o = small_prepare(d);
  const auto first = loom::data::prepare_text(o);
  ASSERT_GE(first.train_shards.size(), 3u);
  auto contents = [&](const std::string& dir) {
    std::map<std::string, std::string> m;
    for (auto& e : fs::directory_iterator(dir)) {
      std::ifstream in(e.path(), std::ios::binary);
      m[e.path().filename().string()] = e.is_directory() ? "<dir>" : std::string(std::istreambuf_iterator<char>(in), {});
    }
    return m;
  };
  const auto before = contents(d / "out");
  write_file(d / "empty_tokenizer.json", "");
  write_file(d / "notext/x.bin", std::string("\0\1", 2));
  auto failing = [&](const std::string& what) {
    loom::data::PrepareTextOptions f = o;
    f.force = true;
    if (what == "tokenizer") f.tokenizer = d / "empty_tokenizer.json";
    if (what == "input") f.inputs = {d / "in", d / "nonexistent"};
    if (what == "bos") f.bos = "<s>";  // the byte-level tokenizer has no named tokens
    if (what == "no text") f.inputs = {d / "notext"};
    return f;
  };
  for (const std::string what : {"tokenizer", "input", "bos", "no text"}) {
    SCOPED_TRACE(what);
    EXPECT_THROW(loom::data::prepare_text(failing(what)), loom::Error);
    EXPECT_EQ(contents(d / "out"), before) << "a refused prepare --force changed the old outputs";
    // Into a folder it had to make: nothing is left behind.
    loom::data::PrepareTextOptions f = failing(what);
    f.out_dir = d / "new/out";
    EXPECT_THROW(loom::data::prepare_text(f), loom::Error);
    EXPECT_FALSE(fs::exists(d / "new/out"));
  }
  // A staging folder a killed prepare left is cleared; success replaces the
  // whole set: fewer shards and no val.bin leave no stale file behind.
  write_file(d / "out/.prepare.tmp/train_000.bin", "left over");
  o.force = true;
  o.shard_tokens = 100000;
  o.val_fraction = 0;
  const auto second = loom::data::prepare_text(o);
  ASSERT_EQ(second.train_shards.size(), 1u);
  const auto after = contents(d / "out");
  std::set<std::string> names;
  for (auto& [name, bytes] : after) names.insert(name);
  EXPECT_EQ(names, (std::set<std::string>{"prepare.json", fs::path(second.train_shards[0]).filename().string()}));
  EXPECT_EQ(second.manifest, d / "out/prepare.json");
  EXPECT_EQ(TokenShard(second.train_shards[0]).size(), second.train_tokens);
  EXPECT_EQ(nlohmann::json::parse(after.at("prepare.json")).at("val"), nullptr);
}

TEST(PrepareText, CommandLine) {
  TempDir d;
  make_inputs(d);
  const std::string log = d / "cli.log";
  auto run = [&](const std::string& args) {
    const std::string cmd = std::string("'") + LOOM_CLI + "' prepare " + args + " > '" + log + "' 2>&1";
    const int rc = std::system(cmd.c_str());
    std::ifstream in(log);
    return std::make_pair(WEXITSTATUS(rc), std::string(std::istreambuf_iterator<char>(in), {}));
  };
  auto [rc, out] = run("json '" + d / "o" + "' '" + d / "in" + "'");
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("supports: text"), std::string::npos) << out;

  std::tie(rc, out) = run("text '" + d / "o" + "' '" + d / "in" + "' --val-fraction 0.1 --shard-tokens 1K --seed 3");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("3 used, 2 skipped"), std::string::npos) << out;
  EXPECT_NE(out.find("documents: 32 (train 29, val 3)"), std::string::npos) << out;
  EXPECT_NE(out.find("bin.dat"), std::string::npos) << "skipped files are named: " << out;
  EXPECT_TRUE(fs::exists(d / "o/train_000.bin"));
  EXPECT_TRUE(fs::exists(d / "o/val.bin"));

  std::tie(rc, out) = run("text '" + d / "o2" + "' '" + d / "in" + "' --shard-tokens lots");
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("--shard-tokens 'lots'"), std::string::npos) << out;
}

TEST(PrepareText, FortunesInstalled) {
  const std::string fortunes = "/usr/share/games/fortunes";
  if (!fs::is_directory(fortunes)) GTEST_SKIP() << fortunes << " is not installed";
  TempDir d;
  loom::data::PrepareTextOptions o;
  o.out_dir = d / "out";
  o.inputs = {fortunes};
  const auto r = loom::data::prepare_text(o);
  EXPECT_GT(r.documents, 1000u);
  EXPECT_GT(r.train_tokens, 1000000u);
  for (auto& [p, why] : r.files_skipped) EXPECT_TRUE(p.ends_with(".dat")) << p << ": " << why;
  for (auto& p : r.files_used) EXPECT_FALSE(p.ends_with(".u8")) << "symlinked duplicates are read once: " << p;
  TokensOptions t;
  t.train = {d / "out/train_*.bin"};
  t.val = {d / "out/val.bin"};
  const DataSpec s = spec(4, 256, 0, 1, 1, 258);
  auto src = tokens_source(t, s);
  const auto b = take(*src, s, 2);
  EXPECT_NE(b[0], b[1]);
}

// Whatever a shard holds (its header's vocabulary, a token id) and whatever
// data.vocab says, a message never asks for a model.vocab_size above the
// largest one accepted (2147483647: ids are int32); beyond it, it says so.
TEST(TokensData, NoMessageAsksForAVocabularyBeyondTheMaximum) {
  TempDir d;
  const int64_t max_vocab = 2147483647;
  std::vector<std::string> messages;
  // The header's vocabulary.
  for (const uint32_t header : {1001u, 2147483646u, 2147483647u, 2147483648u, 4294967295u}) {
    std::vector<uint32_t> t(64, 5);
    const std::string p = write_tokens(d / ("h" + std::to_string(header) + ".bin"), t, 4, header);
    TokensOptions o;
    o.train = {p};
    const std::string m = error_of([&] { tokens_source(o, spec(1, 8, 0, 1, 1, 1000)); });
    EXPECT_NE(m.find(p), std::string::npos) << m;
    EXPECT_NE(m.find(std::to_string(header)), std::string::npos) << m;
    messages.push_back(m);
  }
  // A token id read (the header gives no vocabulary).
  for (const uint32_t id : {1500u, 2147483646u, 2147483647u, 4294967295u}) {
    std::vector<uint32_t> t(64, 5);
    t[3] = id;
    const std::string p = write_tokens(d / ("t" + std::to_string(id) + ".bin"), t, 4);
    TokensOptions o;
    o.train = {p};
    o.shuffle = false;
    auto src = tokens_source(o, spec(1, 63, 0, 1, 1, 1000));
    Batch b(64);
    const std::string m = error_of([&] { src->next(Split::train, b.data()); });
    EXPECT_NE(m.find(p), std::string::npos) << m;
    EXPECT_NE(m.find("index 3 is " + std::to_string(id)), std::string::npos) << m;
    messages.push_back(m);
  }
  // The synthetic plugin's data.vocab.
  for (const int64_t vocab : {int64_t{2000}, max_vocab + 1, int64_t{3000000000}})
    messages.push_back(error_of([&] { synthetic("random", vocab, spec(1, 8, 0, 1, 1, 1000)); }));
  const std::regex ask(R"(model\.vocab_size (>=|is too small \(set it >=) (\d+))");
  int asked = 0, beyond = 0;
  for (const std::string& m : messages) {
    std::smatch g;
    if (std::regex_search(m, g, ask)) {
      ++asked;
      EXPECT_LE(std::stoll(g[2]), max_vocab) << "asks for a vocabulary Loom refuses: " << m;
    } else if (m.find("raise model.vocab_size") == std::string::npos) {
      ++beyond;
      EXPECT_NE(m.find("beyond"), std::string::npos) << m;
      EXPECT_NE(m.find("2147483647"), std::string::npos) << m;
    }
  }
  EXPECT_EQ(asked, 5);   // headers 1001, 2147483646, 2147483647; ids 1500, 2147483646
  EXPECT_EQ(beyond, 6);  // headers 2^31, 2^32 - 1; ids 2^31 - 1, 2^32 - 1; data.vocab 2^31, 3e9
}

// A validation split too small to validate on is told when it is made, with
// the option that would give a usable one (a --val-fraction, more documents,
// or none), and training on it names the same fixes. The warning holds its
// promise: the --val-fraction it suggests gives a val.bin that serves seq_len 2048.
TEST(PrepareText, SmallValidationSplitIsToldWhenMadeAndWhenUsed) {
  TempDir d;
  auto prepare = [&](const std::string& out, const std::string& in, double fraction) {
    loom::data::PrepareTextOptions o;
    o.out_dir = d / out;
    o.inputs = {d / in};
    o.val_fraction = fraction;
    o.progress = false;
    return loom::data::prepare_text(o);
  };
  // One document: val.bin is empty, and no fraction can help.
  write_file(d / "one/a.txt", "a single document of text\n");
  auto r = prepare("o1", "one", 0.05);
  EXPECT_EQ(r.val_tokens, 0u);
  EXPECT_NE(r.val_warning.find("val.bin is empty"), std::string::npos) << r.val_warning;
  EXPECT_NE(r.val_warning.find("With one document no --val-fraction"), std::string::npos) << r.val_warning;
  EXPECT_NE(r.val_warning.find("--val-fraction 0"), std::string::npos) << r.val_warning;
  // Eighty documents of ~200 bytes: 5% is 4 of them, ~800 tokens.
  std::string many;
  for (int i = 0; i < 80; ++i) many += "document " + std::to_string(i) + " " + std::string(190, 'a' + i % 26) + "\n%\n";
  write_file(d / "many/f.txt", many);
  r = prepare("o2", "many", 0.05);
  EXPECT_GT(r.val_tokens, 0u);
  EXPECT_LT(r.val_tokens, 2049u);
  EXPECT_NE(r.val_warning.find("holds only " + std::to_string(r.val_tokens) + " tokens"), std::string::npos)
      << r.val_warning;
  EXPECT_NE(r.val_warning.find("train.seq_len <= " + std::to_string(r.val_tokens - 1)), std::string::npos)
      << r.val_warning;
  const size_t at = r.val_warning.find("--val-fraction 0.");
  ASSERT_NE(at, std::string::npos) << r.val_warning;
  const double suggested = std::stod(r.val_warning.substr(at + 15));
  EXPECT_GT(suggested, 0.05);
  // Training on it says what to do.
  TokensOptions o;
  o.train = {d / "o2/train_*.bin"};
  o.val = {d / "o2/val.bin"};
  const std::string m = error_of([&] { tokens_source(o, spec(1, 2048, 0, 1, 1, 300)); });
  EXPECT_NE(m.find("data.val"), std::string::npos) << m;
  EXPECT_NE(m.find("--val-fraction"), std::string::npos) << m;
  EXPECT_NE(m.find("shorten train.seq_len to at most " + std::to_string(r.val_tokens - 1)), std::string::npos) << m;
  EXPECT_NE(m.find("leave data.val out"), std::string::npos) << m;
  // The suggestion is enough, and then nothing is said.
  r = prepare("o3", "many", suggested);
  EXPECT_GE(r.val_tokens, 2049u);
  EXPECT_EQ(r.val_warning, "");
  // An empty val.bin at training: the same fixes, no seq_len to shorten to.
  o.val = {d / "o1/val.bin"};
  o.train = {d / "o2/train_*.bin"};
  const std::string e = error_of([&] { tokens_source(o, spec(1, 8, 0, 1, 1, 300)); });
  EXPECT_NE(e.find("hold 0 token(s)"), std::string::npos) << e;
  EXPECT_NE(e.find("--val-fraction"), std::string::npos) << e;
  EXPECT_EQ(e.find("shorten train.seq_len"), std::string::npos) << e;
}

// Document starts of token shards (loom::DocumentStarts): a token begins a
// document when it is BOS or follows EOS, with the ids the shards record
// (loom prepare writes them) or data.bos / data.eos; the flags follow the
// window through shuffling and resume; shards without markers say so.
TEST(TokensData, DocumentStartsFromTheShardsMarkers) {
  TempDir d;
  const uint32_t bos = 1, eos = 2;
  std::vector<uint32_t> toks;
  for (int doc = 0; doc < 40; ++doc) {  // BOS, 0..6 tokens, EOS
    toks.push_back(bos);
    for (int k = 0; k < doc % 7; ++k) toks.push_back(static_cast<uint32_t>(10 + (doc + k) % 30));
    toks.push_back(eos);
  }
  loom::write_token_shard(d / "train_000.bin", toks.data(), toks.size(), 2, 50, loom::DocumentMarkers{bos, eos});
  const loom::TokenShard shard(d / "train_000.bin");
  ASSERT_TRUE(shard.has_markers());
  EXPECT_EQ(shard.markers(), (loom::DocumentMarkers{bos, eos}));
  TokensOptions o;
  o.train = {d / "train_*.bin"};
  o.shuffle = true;
  const DataSpec s = spec(3, 6);
  auto a = tokens_source(o, s), b = tokens_source(o, s);
  EXPECT_EQ(a->starts_unavailable(), "");
  const size_t row = 7;
  std::string state;
  std::vector<std::vector<uint8_t>> flags_after;
  for (int g = 0; g < 12; ++g) {
    if (g == 5) state = a->state();
    Batch t(3 * row), u(3 * row);
    std::vector<uint8_t> f(3 * row);
    a->next_with_starts(Split::train, t.data(), f.data());
    b->next(Split::train, u.data());
    EXPECT_EQ(t, u);
    for (size_t i = 0; i < 3; ++i)
      for (size_t p = 0; p < row; ++p) {
        const int32_t tok = t[i * row + p];
        // The token before the window (shuffled windows: find it in the shard by the window's start).
        bool prev_eos = false;
        if (p > 0) prev_eos = t[i * row + p - 1] == static_cast<int32_t>(eos);
        const bool begins = tok == static_cast<int32_t>(bos) || prev_eos;
        if (p > 0 || tok == static_cast<int32_t>(bos)) EXPECT_EQ(f[i * row + p], begins) << g << " " << i << " " << p;
      }
    if (g >= 5) flags_after.push_back(f);
  }
  auto c = tokens_source(o, s);
  c->restore(state);
  for (size_t g = 0; g < flags_after.size(); ++g) {
    Batch t(3 * row);
    std::vector<uint8_t> f(3 * row);
    c->next_with_starts(Split::train, t.data(), f.data());
    EXPECT_EQ(f, flags_after[g]) << "step " << g + 5 << " after resume";
  }
  // A shard written without markers: none unless the config gives them.
  const fs::path plain_dir = fs::path(d / "plain");
  fs::create_directories(plain_dir);
  write_tokens((plain_dir / "train_000.bin").string(), std::vector<uint32_t>(toks.begin(), toks.end()));
  TokensOptions p;
  p.train = {(plain_dir / "train_*.bin").string()};
  auto plain = tokens_source(p, s);
  EXPECT_NE(plain->starts_unavailable().find("records no document markers"), std::string::npos);
  EXPECT_NE(plain->starts_unavailable().find("data.bos and data.eos"), std::string::npos);
  p.markers = loom::DocumentMarkers{bos, eos};
  auto given = tokens_source(p, s);
  EXPECT_EQ(given->starts_unavailable(), "");
}

// loom prepare records the tokenizer's BOS and EOS in every shard it writes.
TEST(PrepareText, ShardsRecordTheDocumentMarkers) {
  TempDir d;
  loom::data::PrepareTextOptions o = small_prepare(d);
  const auto r = loom::data::prepare_text(o);
  for (const std::string& f : r.train_shards) {
    const loom::TokenShard sh(f);
    ASSERT_TRUE(sh.has_markers()) << f;
    EXPECT_EQ(sh.markers(), (loom::DocumentMarkers{loom::data::ByteTokenizer::bos, loom::data::ByteTokenizer::eos}));
  }
  EXPECT_TRUE(loom::TokenShard(r.val_shard).has_markers());
}

// Synthetic documents: log-normal lengths with the configured mean, a pure
// function of (seed, split, sample); none without document_length.
TEST(SyntheticData, DocumentStartsHaveTheConfiguredMeanLength) {
  loom::data::SyntheticOptions o;
  o.document_length = 100;
  const DataSpec s = spec(4, 1023);
  auto a = std::make_unique<SyntheticData>(loom::PluginInit{}, o), b = std::make_unique<SyntheticData>(loom::PluginInit{}, o);
  a->open(s);
  b->open(s);
  EXPECT_EQ(a->starts_unavailable(), "");
  uint64_t starts = 0, tokens = 0;
  for (int g = 0; g < 50; ++g) {
    Batch t(4 * 1024), u(4 * 1024);
    std::vector<uint8_t> f(4 * 1024), h(4 * 1024);
    a->next_with_starts(Split::train, t.data(), f.data());
    b->next_with_starts(Split::train, u.data(), h.data());
    EXPECT_EQ(t, u);
    EXPECT_EQ(f, h);
    for (size_t i = 0; i < 4; ++i)
      for (size_t p = 1; p < 1024; ++p) starts += f[i * 1024 + p], ++tokens;
  }
  // 204600 tokens at a mean of 100: the sample mean within 10% (sigma 1: the
  // log-normal's spread gives a standard error of ~2%).
  const double mean = static_cast<double>(tokens) / static_cast<double>(starts);
  EXPECT_NEAR(mean, 100.0, 10.0);
  auto none = std::make_unique<SyntheticData>(loom::PluginInit{}, loom::data::SyntheticOptions{});
  none->open(s);
  EXPECT_NE(none->starts_unavailable().find("data.document_length"), std::string::npos);
}
