// Data plugin `megatron`: Megatron indexed datasets written by an independent
// Python writer (tests/data/megatron_model.py, following the published
// layout), samples checked against that script's from-scratch model of
// GPTDataset's index building and BlendedDataset's blending; resume; damaged
// indexes refused by name; a real `loom train` on one.
#include <gtest/gtest.h>

#include <algorithm>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "data/megatron/megatron_data.hpp"
#include "data/megatron/megatron_source.hpp"
#include "loom/config.hpp"
#include "loom/error.hpp"
#include "megatron_writer.hpp"
#include "test_util.hpp"

namespace fs = std::filesystem;
using loom::DataSpec;
using loom::Split;
using loom::data::MegatronOptions;
using loom::plugins::MegatronData;
using loom::test::expect_error;
using loom::test::TmpDir;

namespace {

// Runs the Python writer and model into `dir`; returns the scenarios.
nlohmann::json make_datasets(const fs::path& dir) {
  const std::string cmd = loom::cat("python3 ", LOOM_SOURCE_DIR, "/tests/data/megatron_model.py ", dir.string());
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(dir / "expected.json");
  EXPECT_TRUE(in.good()) << "megatron_model.py wrote no expected.json";
  return in ? nlohmann::json::parse(in) : nlohmann::json::array();
}

MegatronOptions options_of(const nlohmann::json& s) {
  MegatronOptions o;
  o.prefixes = s["prefix"].get<std::vector<std::string>>();
  if (s.contains("weights")) o.weights = s["weights"].get<std::vector<double>>();
  if (s.contains("split")) o.split = s["split"];
  if (s.contains("val_prefix")) o.val_prefixes = s["val_prefix"].get<std::vector<std::string>>();
  o.shuffle = s.value("shuffle", true);
  return o;
}

DataSpec spec_of(const nlohmann::json& s, int rank) {
  DataSpec d;
  d.batch = s["batch"];
  d.seq_len = s["seq_len"];
  d.world = s["world"];
  d.rank = rank;
  d.seed = s["seed"];
  d.vocab_size = 200000;
  return d;
}

std::vector<int32_t> batch(MegatronData& m, const DataSpec& d, Split split) {
  std::vector<int32_t> t(static_cast<size_t>(d.batch * (d.seq_len + 1)));
  m.next(split, t.data());
  return t;
}

std::vector<int32_t> flat(const nlohmann::json& rows, size_t from, size_t n) {
  std::vector<int32_t> v;
  for (size_t i = from; i < from + n; ++i)
    for (auto& t : rows.at(i)) v.push_back(t.get<int32_t>());
  return v;
}

}  // namespace

TEST(Megatron, SamplesMatchThePythonModelOfGptDataset) {
  TmpDir d;
  const auto scenarios = make_datasets(d.path);
  ASSERT_EQ(scenarios.size(), 7u);
  for (const auto& s : scenarios) {
    SCOPED_TRACE(s["name"].get<std::string>());
    const auto& e = s["expected"];
    for (int r = 0; r < s["world"].get<int>(); ++r) {
      MegatronData m(loom::PluginInit{}, options_of(s));
      const DataSpec spec = spec_of(s, r);
      m.open(spec);
      const auto want_samples = e["train_samples"].get<std::vector<uint64_t>>();
      for (size_t k = 0; k < want_samples.size(); ++k) EXPECT_EQ(m.train_samples(k), want_samples[k]);
      const size_t B = static_cast<size_t>(spec.batch);
      for (int step = 0; step < s["steps"].get<int>(); ++step)
        ASSERT_EQ(batch(m, spec, Split::train), flat(e["train"][r], step * B, B)) << "rank " << r << " step " << step;
      EXPECT_EQ(m.counts(), e["counts"].get<std::vector<uint64_t>>());
      ASSERT_EQ(m.has_split(Split::validation), e["has_val"].get<bool>());
      for (int v = 0; v < s["val_batches"].get<int>(); ++v)
        ASSERT_EQ(batch(m, spec, Split::validation), flat(e["val"][r], v * B, B)) << "rank " << r << " val " << v;
    }
  }
}

// A state at the edges of what it may hold — the first sample, the last of
// an epoch, the first of the next, 2^53 samples in, a blend's weight all on
// one dataset, seeds 0 and 2^63 - 1 — resumes exactly where the stream is
// at that sample; a state holding any field of another type or out of range,
// or counts that are not one per dataset summing to the cursor, is refused
// as damage (ckpt::CheckpointDamaged, so the core names an earlier
// checkpoint) and leaves the position as it was.
TEST(Megatron, RestoreTakesEveryEdgeAndRefusesDamageWithoutMoving) {
  TmpDir d;
  loom::test::write_megatron(d.path / "a", loom::test::megatron_docs(40, 23, 96));
  MegatronOptions o;
  o.prefixes = {(d.path / "a").string()};
  o.split = "1";
  DataSpec spec;
  spec.batch = 1;
  spec.seq_len = 8;
  spec.vocab_size = 96;
  spec.seed = 5;
  MegatronData ref(loom::PluginInit{}, o);
  ref.open(spec);
  const uint64_t S = ref.train_samples(0);
  ASSERT_EQ(S, (40u * 23u - 1u) / 8u);
  const std::string st = ref.state();
  std::vector<std::vector<int32_t>> stream;
  for (uint64_t i = 0; i < 2 * S + 2; ++i) stream.push_back(batch(ref, spec, Split::train));
  auto at = [&](uint64_t cursor) {
    auto j = nlohmann::json::parse(st);
    j["cursor"] = cursor;
    j["counts"] = {cursor};
    return j.dump();
  };
  for (const uint64_t k : {uint64_t{0}, S - 1, S, 2 * S - 1, 2 * S}) {
    SCOPED_TRACE(k);
    MegatronData m(loom::PluginInit{}, o);
    m.open(spec);
    m.restore(at(k));
    EXPECT_EQ(m.cursor(), k);
    EXPECT_EQ(batch(m, spec, Split::train), stream[k]);
    EXPECT_EQ(batch(m, spec, Split::train), stream[k + 1]);
  }
  {
    MegatronData m(loom::PluginInit{}, o);
    m.open(spec);
    m.restore(at(uint64_t{1} << 53));
    EXPECT_EQ(m.counts(), std::vector<uint64_t>{uint64_t{1} << 53});
    batch(m, spec, Split::train);  // a sample of epoch 2^53 / S: read, no overflow
  }
  for (const int64_t seed : {int64_t{0}, std::numeric_limits<int64_t>::max()}) {
    auto j = nlohmann::json::parse(st);
    j["seed"] = seed;
    MegatronData m(loom::PluginInit{}, o), same(loom::PluginInit{}, o);
    m.open(spec);
    m.restore(j.dump());
    DataSpec other = spec;
    other.seed = static_cast<uint64_t>(seed);
    same.open(other);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(batch(m, spec, Split::train), batch(same, other, Split::train)) << seed;
  }

  MegatronData m(loom::PluginInit{}, o);
  m.open(spec);
  for (int i = 0; i < 3; ++i) batch(m, spec, Split::train);
  for (const auto& [field, value] : std::vector<std::pair<std::string, std::string>>{
           {"/cursor", "-1"}, {"/cursor", "1.5"}, {"/cursor", "18446744073709551616"}, {"/cursor", "9007199254740993"},
           {"/counts/0", "-1"}, {"/counts/0", "0.5"}, {"/counts/0", "\"0\""}, {"/weights/0", "1.5"},
           {"/weights/0", "-0.5"}, {"/weights/0", "null"}, {"/seed", "-1"}, {"/seed", "9223372036854775808"},
           {"/world", "0"}, {"/batch", "1048577"}, {"/seq_len", "true"}, {"/shuffle", "0"}, {"/version", "0"},
           {"/datasets/0/sequences", "-40"}, {"/datasets/0/tokens", "1e3"},
           {"/datasets/0/train_documents/1", "41"}, {"/datasets/0/train_documents/0", "-1"}}) {
    SCOPED_TRACE(field + " = " + value);
    auto j = nlohmann::json::parse(st);
    j[nlohmann::json::json_pointer(field)] = nlohmann::json::parse(value);
    std::string key = field.substr(1);
    for (size_t p; (p = key.find("/0")) != std::string::npos;) key.replace(p, 2, "[0]");
    for (size_t p; (p = key.find("/1")) != std::string::npos;) key.replace(p, 2, "[1]");
    for (size_t p; (p = key.find('/')) != std::string::npos;) key.replace(p, 1, ".");
    try {
      m.restore(j.dump());
      ADD_FAILURE() << "accepted";
    } catch (const loom::ckpt::CheckpointDamaged& e) {
      EXPECT_NE(std::string(e.what()).find("\"" + key + "\" is "), std::string::npos) << e.what();
    }
    EXPECT_EQ(m.cursor(), 3u);
  }
  // Counts that are not one per dataset, though they sum to the cursor.
  for (const std::string& counts : {"[-1, 4]", "[]", "[3, 0]", "[1, 1, 1]"}) {
    SCOPED_TRACE(counts);
    auto j = nlohmann::json::parse(st);
    j["cursor"] = 3;
    j["counts"] = nlohmann::json::parse(counts);
    EXPECT_THROW(m.restore(j.dump()), loom::ckpt::CheckpointDamaged);
  }
  EXPECT_EQ(m.cursor(), 3u);
  EXPECT_EQ(batch(m, spec, Split::train), stream[3]);
}

TEST(Megatron, SamplesShareOneTokenAndCrossDocuments) {
  TmpDir d;
  const auto scenarios = make_datasets(d.path);
  const auto& s = scenarios.at(2);  // unshuffled: samples in stream order
  MegatronData m(loom::PluginInit{}, options_of(s));
  DataSpec spec = spec_of(s, 0);
  m.open(spec);
  auto a = batch(m, spec, Split::train);
  const size_t row = static_cast<size_t>(spec.seq_len + 1);
  for (size_t i = 0; i + 1 < static_cast<size_t>(spec.batch); ++i)
    EXPECT_EQ(a[i * row + row - 1], a[(i + 1) * row]) << "sample " << i << " and the next share their boundary token";
}

TEST(Megatron, ResumeIsExactUnderAnyWorldSize) {
  TmpDir d;
  const auto scenarios = make_datasets(d.path);
  const auto& s = scenarios.at(1);  // a blend
  // Uninterrupted, one rank with batch 4.
  DataSpec one = spec_of(s, 0);
  one.batch = 4;
  one.world = 1;
  MegatronData ref(loom::PluginInit{}, options_of(s));
  ref.open(one);
  std::vector<int32_t> all;
  for (int i = 0; i < 30; ++i) {
    auto b = batch(ref, one, Split::train);
    all.insert(all.end(), b.begin(), b.end());
  }
  // 10 steps, state, then two ranks of batch 2 continue the same global stream.
  MegatronData first(loom::PluginInit{}, options_of(s));
  first.open(one);
  for (int i = 0; i < 10; ++i) batch(first, one, Split::train);
  const std::string state = first.state();
  const size_t row = static_cast<size_t>(one.seq_len + 1);
  for (int r = 0; r < 2; ++r) {
    DataSpec two = one;
    two.batch = 2;
    two.world = 2;
    two.rank = r;
    MegatronData m(loom::PluginInit{}, options_of(s));
    m.open(two);
    m.restore(state);
    for (int step = 10; step < 30; ++step) {
      auto b = batch(m, two, Split::train);
      std::vector<int32_t> want(all.begin() + static_cast<long>((step * 4 + r * 2) * row),
                                all.begin() + static_cast<long>((step * 4 + r * 2 + 2) * row));
      ASSERT_EQ(b, want) << "rank " << r << " step " << step;
    }
  }
  // A state from other data, another seq_len or another plugin is refused.
  MegatronOptions other = options_of(s);
  other.prefixes = {other.prefixes[0]};
  other.weights.clear();
  MegatronData m(loom::PluginInit{}, other);
  m.open(one);
  expect_error([&] { m.restore(state); }, {"the data changed since the checkpoint"});
  MegatronData m2(loom::PluginInit{}, options_of(s));
  DataSpec longer = one;
  longer.seq_len = 9;
  m2.open(longer);
  expect_error([&] { m2.restore(state); }, {"seq_len 8", "train.seq_len is now 9"});
  expect_error([&] { m2.restore(R"({"source": "tokens"})"); }, {"data plugin 'tokens', not 'megatron'"});
  expect_error([&] { m2.restore("{"); }, {"not valid JSON"});
  // Counts that do not add up to the cursor, or one per dataset, are damage (not an out-of-range write).
  MegatronData m3(loom::PluginInit{}, options_of(s));
  m3.open(one);
  auto damaged = nlohmann::json::parse(state);
  damaged["counts"].push_back(0);
  expect_error([&] { m3.restore(damaged.dump()); }, {"3 per-dataset count(s)", "for 2 dataset(s)", "damaged"});
  damaged = nlohmann::json::parse(state);
  damaged["cursor"] = damaged["cursor"].get<uint64_t>() + 1;
  expect_error([&] { m3.restore(damaged.dump()); }, {"\"counts\" [12,28] sum to 40 but \"cursor\" is 41", "damaged"});
  m3.restore(state);  // the undamaged state still restores
  EXPECT_EQ(m3.cursor(), 40u);
}

TEST(Megatron, DamagedIndexesAreRefusedByName) {
  TmpDir d;
  make_datasets(d.path);
  const fs::path a = d.path / "a";
  auto bytes = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  const std::string idx = bytes(a.string() + ".idx"), bin = bytes(a.string() + ".bin");
  auto variant = [&](const std::string& name, const std::string& idx_bytes, const std::string& bin_bytes) {
    const fs::path p = d.path / name;
    std::ofstream(p.string() + ".idx", std::ios::binary) << idx_bytes;
    std::ofstream(p.string() + ".bin", std::ios::binary) << bin_bytes;
    return p.string();
  };
  auto open = [](const std::string& prefix) { loom::data::IndexedDataset ds(prefix); };
  std::string bad_magic = idx;
  bad_magic[0] = 'X';
  expect_error([&] { open(variant("magic", bad_magic, bin)); }, {"magic.idx", "is not a Megatron index: bad magic"});
  expect_error([&] { open(variant("short", idx.substr(0, 20), bin)); }, {"short.idx", "truncated", "34-byte header"});
  expect_error([&] { open(variant("trunc", idx.substr(0, idx.size() - 9), bin)); },
               {"trunc.idx", "is truncated: header says 240 sequences and 241 document indices"});
  expect_error([&] { open(variant("long", idx + "x", bin)); }, {"long.idx", "longer than its header says"});
  std::string version = idx;
  version[9] = 2;
  expect_error([&] { open(variant("version", version, bin)); }, {"version.idx", "version 2"});
  std::string fl = idx;
  fl[17] = 7;
  expect_error([&] { open(variant("float", fl, bin)); }, {"float.idx", "floating-point"});
  expect_error([&] { open(variant("shortbin", idx, bin.substr(0, bin.size() - 2))); },
               {"shortbin.idx", "points past the end of", "shortbin.bin"});
  std::string docs = idx;
  docs[docs.size() - 8] = 7;  // the last document index no longer equals N
  expect_error([&] { open(variant("docs", docs, bin)); }, {"docs.idx", "document indices"});
  // Every other field: dtype codes, counts, sizes, pointers, document indices.
  auto with = [&](std::size_t at, const void* v, std::size_t n) {
    std::string s = idx;
    std::memcpy(s.data() + at, v, n);
    return s;
  };
  const uint64_t N = 240, kSizes = 34, kPtrs = 34 + 4 * N, kDocs = 34 + 12 * N;
  for (unsigned char code : {0, 9, 255}) {
    SCOPED_TRACE(int(code));
    expect_error([&] { open(variant("dtype", with(17, &code, 1), bin)); }, {"dtype.idx", "unknown dtype code"});
  }
  const uint64_t huge = uint64_t{1} << 63, big = uint64_t{1} << 57;
  expect_error([&] { open(variant("count", with(18, &huge, 8), bin)); }, {"count.idx", "impossible header"});
  expect_error([&] { open(variant("count2", with(26, &big, 8), bin)); }, {"count2.idx", "is truncated: header says"});
  const int32_t neg = -3;
  expect_error([&] { open(variant("negsize", with(kSizes + 4 * 5, &neg, 4), bin)); },
               {"negsize.idx", "sequence 5 a negative length (-3)"});
  // Two pointers swapped: both in bounds, but not where the sizes put them.
  std::string swapped = idx;
  std::memcpy(swapped.data() + kPtrs + 8 * 10, idx.data() + kPtrs + 8 * 20, 8);
  std::memcpy(swapped.data() + kPtrs + 8 * 20, idx.data() + kPtrs + 8 * 10, 8);
  ASSERT_NE(swapped, idx);
  expect_error([&] { open(variant("swap", swapped, bin)); }, {"swap.idx", "sizes and pointers that disagree"});
  const int64_t past = static_cast<int64_t>(bin.size()) + 100, negp = -8;
  expect_error([&] { open(variant("ptr", with(kPtrs + 8 * 3, &past, 8), bin)); },
               {"ptr.idx", "points past the end of", "sequence 3"});
  expect_error([&] { open(variant("negptr", with(kPtrs + 8 * 3, &negp, 8), bin)); }, {"negptr.idx", "sequence 3 at byte -8"});
  // A size that grew: the pointers after it disagree (or the last one runs past the .bin).
  int32_t grown = 0;
  std::memcpy(&grown, idx.data() + kSizes + 4 * 7, 4);
  grown += 1;
  expect_error([&] { open(variant("grown", with(kSizes + 4 * 7, &grown, 4), bin)); },
               {"grown.idx", "sizes and pointers that disagree: sequence 8"});
  expect_error([&] { open(variant("longbin", idx, bin + "xx")); },
               {"longbin.idx", "covers", "do not belong together"});
  const int64_t back = 2;
  std::string nonmono = with(kDocs + 8 * 5, &back, 8);
  expect_error([&] { open(variant("nonmono", nonmono, bin)); }, {"nonmono.idx", "bad document indices: entry 5 is 2"});
  const int64_t one = 1;
  expect_error([&] { open(variant("docstart", with(kDocs, &one, 8), bin)); }, {"docstart.idx", "entry 0 is 1"});
  // An empty dataset, and one whose .bin is a directory.
  std::string empty(idx.data(), 18);
  const uint64_t zero = 0, d1 = 1;
  empty.append(reinterpret_cast<const char*>(&zero), 8).append(reinterpret_cast<const char*>(&d1), 8);
  empty.append(reinterpret_cast<const char*>(&zero), 8);
  expect_error([&] { open(variant("empty", empty, "")); }, {"empty.idx", "holds no sequences"});
  fs::create_directories(d.path / "dirbin.bin");
  std::ofstream((d.path / "dirbin.idx").string(), std::ios::binary) << idx;
  expect_error([&] { open((d.path / "dirbin").string()); }, {"dirbin.bin", "not a regular file"});
  expect_error([&] { open((d.path / "missing").string()); }, {"missing.idx", "does not exist", "PREFIX.bin"});
  // A missing validation dataset is named by its own key, not data.prefix.
  {
    MegatronOptions o;
    o.prefixes = {a.string()};
    o.val_prefixes = {(d.path / "missing").string()};
    MegatronData m(loom::PluginInit{}, o);
    DataSpec spec;
    spec.batch = 1;
    spec.seq_len = 8;
    spec.vocab_size = 50000;
    try {
      m.open(spec);
      ADD_FAILURE() << "a missing data.val_prefix was accepted";
    } catch (const loom::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("missing.idx' does not exist; data.val_prefix names PREFIX"), std::string::npos) << msg;
      EXPECT_EQ(msg.find("data.prefix"), std::string::npos) << msg;
    }
  }
  expect_error([&] { open((d.path / "a.bin").string()); }, {"a.bin' ends with .bin", "write \"" + a.string() + "\""});
  expect_error([&] { open((d.path / "a.idx").string()); }, {"a.idx' ends with .idx"});
  std::ofstream((d.path / "nobin.idx").string(), std::ios::binary) << idx;
  expect_error([&] { open((d.path / "nobin").string()); }, {"nobin.bin", "does not exist"});

  // A seq_len longer than a train split, or a validation split without one sample, is named with what to change.
  {
    MegatronOptions o;
    o.prefixes = {(d.path / "c").string()};
    o.split = "1";
    MegatronData m(loom::PluginInit{}, o);
    DataSpec spec;
    spec.batch = 1;
    spec.seq_len = 100000;
    spec.vocab_size = 32000;
    expect_error([&] { m.open(spec); }, {"c'", "its train split", "less than one sample of seq_len + 1 = 100001",
                                         "shorter seq_len"});
    o.split = "90,10";  // 3 documents of 5..24 tokens
    MegatronData v(loom::PluginInit{}, o);
    spec.seq_len = 100;
    expect_error([&] { v.open(spec); }, {"validation documents hold no sample of seq_len + 1 = 101", "data.split"});
  }
  // Tokens beyond the model's vocabulary are named when read.
  MegatronOptions o;
  o.prefixes = {(d.path / "b").string()};
  MegatronData m(loom::PluginInit{}, o);
  DataSpec spec;
  spec.batch = 2;
  spec.seq_len = 8;
  spec.vocab_size = 32000;
  m.open(spec);
  std::vector<int32_t> t(18);
  expect_error([&] { m.next(Split::train, t.data()); }, {"b.bin", "not in [0, 32000)", "model.vocab_size is too small"});
}

TEST(Megatron, ConfigTableAndSplitChecks) {
  auto opts = [](const std::string& toml) {
    loom::ConfigTable root = loom::parse_config_table(toml, "m.toml", {});
    loom::ConfigTable t = root.table("data");
    t.mark_used("plugin");
    return MegatronData::read_options(t);
  };
  auto o = opts("[data]\nplugin = \"megatron\"\nprefix = [\"x\", \"y\"]\nweights = [1, 3]\nsplit = \"98,2\"\n");
  EXPECT_EQ(o.prefixes.size(), 2u);
  EXPECT_EQ(o.weights, (std::vector<double>{1, 3}));
  expect_error([&] { opts("[data]\nplugin = \"megatron\"\n"); }, {"m.toml", "prefix", "is required"});
  expect_error([&] { opts("[data]\nplugin = \"megatron\"\nprefix = \"x\"\nweights = [1, 2]\n"); },
               {"m.toml:4", "weights", "one weight per prefix"});
  expect_error([&] { opts("[data]\nplugin = \"megatron\"\nprefix = \"x\"\nsplit = \"9,x\"\n"); },
               {"m.toml:4", "'x' is not a non-negative number"});
  expect_error([&] { opts("[data]\nplugin = \"megatron\"\nprefix = \"x\"\nsplt = \"1\"\n"); },
               {"unknown key 'data.splt'", "did you mean 'split'"});
  EXPECT_EQ(loom::data::megatron_split_indices("969,30,1", 1000, "k"), (std::vector<uint64_t>{0, 969, 999, 1000}));
  EXPECT_EQ(loom::data::megatron_split_indices("1", 7, "k"), (std::vector<uint64_t>{0, 7, 7, 7}));
  EXPECT_EQ(loom::data::megatron_split_indices(" 969, 30 ,1 ", 1000, "k"), (std::vector<uint64_t>{0, 969, 999, 1000}));
  // Ties round to even, as Python's round: 0.5 -> 0 (half-up would give {0, 0, 1, 2}).
  EXPECT_EQ(loom::data::megatron_split_indices("1,1,2", 2, "k"), (std::vector<uint64_t>{0, 1, 1, 2}));
  expect_error([] { loom::data::megatron_split_indices("1,2,3,4", 10, "data.split"); }, {"4 parts"});
  expect_error([] { loom::data::megatron_split_indices("0,0", 10, "data.split"); }, {"sums to 0"});
  // Malformed split strings, each named with the part that is wrong.
  for (const auto& [split, what] : std::vector<std::pair<std::string, std::string>>{
           {"0,0,0", "sums to 0"}, {"a,b,c", "'a' is not a non-negative number"},
           {"-1,2,3", "'-1' is not"}, {"969,,1", "'' is not"}, {"nan,1", "'nan' is not"},
           {"inf,1", "'inf' is not"}, {"1e999,1", "'1e999' is not"}, {"969,30,", "'' is not"},
           {"9 6 9", "'9 6 9' is not"}, {" , 1", "'' is not"}}) {
    SCOPED_TRACE(split);
    expect_error([&] { opts("[data]\nplugin = \"megatron\"\nprefix = \"x\"\nsplit = \"" + split + "\"\n"); },
                 {"m.toml:4", "data.split = \"" + split + "\"", what});
  }
  // Blend weights: negative, all zero, or the wrong count name the key and its line.
  expect_error([&] { opts("[data]\nplugin = \"megatron\"\nprefix = [\"x\", \"y\"]\nweights = [1, -1]\n"); },
               {"m.toml:4", "weights"});
  expect_error([&] { opts("[data]\nplugin = \"megatron\"\nprefix = [\"x\", \"y\"]\nweights = [0, 0]\n"); },
               {"m.toml:4", "weights", "sum to 0"});
  expect_error([&] { opts("[data]\nplugin = \"megatron\"\nprefix = [\"x\", \"y\"]\nweights = [1, 2, 3]\n"); },
               {"m.toml:4", "3 entries", "names 2 dataset(s)"});
  expect_error([&] { opts("[data]\nplugin = \"megatron\"\nprefix = [\"x\", \"y\"]\nweights = \"1,2\"\n"); },
               {"m.toml:4", "weights"});
}

TEST(Megatron, TrainsThroughTheCommand) {
  TmpDir d;
  make_datasets(d.path);
  const std::string cfg = (d.path / "m.toml").string();
  std::ofstream(cfg) << "[run]\nname = \"m\"\nout_dir = \"" << (d.path / "run").string() << "\"\n"
                     << "[model]\nhidden = 32\nnum_layers = 1\nnum_heads = 2\nnum_kv_heads = 2\nffn_hidden = 64\n"
                     << "vocab_size = 50000\nmax_seq_len = 16\n"
                     << "[train]\nsteps = 3\nmicro_batch = 2\nseq_len = 16\nvalidation_every = 3\nvalidation_batches = 1\n"
                     << "[data]\nplugin = \"megatron\"\nprefix = \"" << (d.path / "a").string() << "\"\nsplit = \"90,10\"\n";
  const std::string cmd = loom::cat(LOOM_CLI, " train ", cfg, " > ", (d.path / "out.txt").string(), " 2>&1");
  const int rc = std::system(cmd.c_str());
  std::ifstream in(d.path / "out.txt");
  const std::string out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("megatron: '"), std::string::npos) << out;
  EXPECT_NE(out.find("val loss"), std::string::npos) << out;
}

namespace {

// A Megatron source on `prefix`, opened for a model of vocabulary `vocab`.
std::unique_ptr<MegatronData> open_megatron(const std::string& prefix, int64_t vocab, const std::string& split = "1",
                                            const std::vector<std::string>& val = {}) {
  MegatronOptions o;
  o.prefixes = {prefix};
  o.split = split;
  o.val_prefixes = val;
  auto m = std::make_unique<MegatronData>(loom::PluginInit{}, o);
  DataSpec spec;
  spec.batch = 1;
  spec.seq_len = 8;
  spec.vocab_size = vocab;
  m->open(spec);
  return m;
}

// Every token type: a bad token at each place of the data (around the scan's
// 4096-token blocks, the last token) is found, named by sequence and offset.
template <typename T>
void check_scan_of_type(const fs::path& dir, const std::string& type) {
  SCOPED_TRACE(type);
  const int64_t vocab = 100;
  auto docs = loom::test::megatron_docs<T>(300, 50, vocab);  // 15000 tokens
  const std::string prefix = (dir / ("s_" + type)).string();
  loom::test::write_megatron<T>(prefix, docs);
  const loom::TokenScanReport clean = open_megatron(prefix, vocab)->scan_tokens();
  EXPECT_EQ(clean.tokens, 15000u);
  std::vector<int64_t> bad_values = {vocab, std::numeric_limits<T>::max()};
  if (std::is_signed_v<T>) bad_values.push_back(-1);
  for (const uint64_t at : {uint64_t{0}, uint64_t{4095}, uint64_t{4096}, uint64_t{8200}, uint64_t{14999}})
    for (const int64_t v : bad_values) {
      auto damaged = docs;
      damaged[at / 50][at % 50] = static_cast<T>(v);
      loom::test::write_megatron<T>(prefix, damaged);
      auto m = open_megatron(prefix, vocab);
      expect_error([&] { (void)m->scan_tokens(); },
                   {prefix + ".bin", loom::cat("token ", at % 50, " of sequence ", at / 50, " is ", v), "not in [0, 100)"});
    }
}

}  // namespace

// `loom check`'s scan (loom::TokenScan): every token of the documents the run
// reads, of every token type, against the model's vocabulary — negative ones
// too — found wherever it is, before a step.
TEST(Megatron, ScanFindsEveryBadTokenOfTheDocumentsARunReads) {
  TmpDir d;
  check_scan_of_type<uint8_t>(d.path, "uint8");
  check_scan_of_type<int8_t>(d.path, "int8");
  check_scan_of_type<int16_t>(d.path, "int16");
  check_scan_of_type<uint16_t>(d.path, "uint16");
  check_scan_of_type<int32_t>(d.path, "int32");
  check_scan_of_type<int64_t>(d.path, "int64");
  // Huge int64 tokens, beyond any vocabulary: named as such.
  auto docs = loom::test::megatron_docs<int64_t>(10, 20, 100);
  docs[7][3] = int64_t{1} << 40;
  const std::string big = (d.path / "big").string();
  loom::test::write_megatron(big, docs);
  expect_error([&] { (void)open_megatron(big, 100)->scan_tokens(); },
               {"token 3 of sequence 7 is 1099511627776", "no model.vocab_size can hold it"});
  // Only the documents the splits read: damage in the test share is never read.
  docs = loom::test::megatron_docs<int64_t>(100, 20, 100);
  docs[99][5] = -7;  // split "90,9,1": document 99 is the test share
  loom::test::write_megatron(big, docs);
  const loom::TokenScanReport r = open_megatron(big, 100, "90,9,1")->scan_tokens();
  EXPECT_EQ(r.tokens, 99u * 20);
  docs[95][5] = -7;  // a validation document
  loom::test::write_megatron(big, docs);
  expect_error([&] { (void)open_megatron(big, 100, "90,9,1")->scan_tokens(); }, {"token 5 of sequence 95 is -7"});
  // A separate validation dataset is scanned too.
  const std::string train = (d.path / "train").string();
  loom::test::write_megatron(train, loom::test::megatron_docs<int64_t>(10, 20, 100));
  expect_error([&] { (void)open_megatron(train, 100, "", {big})->scan_tokens(); }, {big + ".bin", "sequence 95"});
}

// End to end: `loom check` reads every token and says how many, and refuses
// a dataset with a bad token far into it, naming it, before any training.
TEST(Megatron, CheckScansEveryTokenBeforeARun) {
  TmpDir d;
  auto docs = loom::test::megatron_docs<int32_t>(2000, 100, 500);
  const std::string prefix = (d.path / "mg").string();
  loom::test::write_megatron(prefix, docs);
  const std::string cfg = (d.path / "m.toml").string();
  std::ofstream(cfg) << "[run]\nname = \"m\"\nout_dir = \"" << (d.path / "run").string() << "\"\ndevice = \"cpu\"\n"
                     << "[model]\nhidden = 32\nnum_layers = 1\nnum_heads = 2\nnum_kv_heads = 2\nffn_hidden = 64\n"
                     << "vocab_size = 500\nmax_seq_len = 16\n"
                     << "[train]\nsteps = 3\nmicro_batch = 2\nseq_len = 16\nvalidation_every = 0\n"
                     << "[data]\nplugin = \"megatron\"\nprefix = \"" << prefix << "\"\nsplit = \"1\"\n";
  auto check = [&] {
    const std::string cmd = loom::cat(LOOM_CLI, " check ", cfg, " > ", (d.path / "out.txt").string(), " 2>&1");
    const int rc = std::system(cmd.c_str());
    std::ifstream in(d.path / "out.txt");
    return std::make_pair(rc, std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()));
  };
  auto [rc, out] = check();
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("data: 200000 tokens of 1 Megatron dataset(s): the train documents scanned in "), std::string::npos)
      << out;
  docs[1700][42] = -2;
  loom::test::write_megatron(prefix, docs);
  std::tie(rc, out) = check();
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(out.find(prefix + ".bin': token 42 of sequence 1700 is -2"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(d.path / "run" / "metrics.jsonl"));
}

// Document starts (loom::DocumentStarts): with shuffle off the stream is the
// documents in order, so a sample's token at stream offset o begins a
// document exactly when o is a document's first offset; every document of
// its own length. next_with_starts gives the tokens next() gives.
TEST(Megatron, DocumentStartsAreTheIndexsDocuments) {
  TmpDir d;
  std::vector<std::vector<uint16_t>> docs;
  std::vector<uint64_t> first;  // stream offset of each document's first token
  uint64_t at = 0;
  for (size_t i = 0; i < 60; ++i) {
    const size_t len = 1 + (i * 7) % 23;  // lengths 1..23, one-token documents among them
    docs.emplace_back(len, static_cast<uint16_t>(i % 90));
    first.push_back(at);
    at += len;
  }
  loom::test::write_megatron(d.path / "docs", docs);
  MegatronOptions o;
  o.prefixes = {(d.path / "docs").string()};
  o.split = "1,0,0";
  o.shuffle = false;
  MegatronData a(loom::PluginInit{}, o), b(loom::PluginInit{}, o);
  DataSpec spec;
  spec.batch = 3;
  spec.seq_len = 11;
  spec.vocab_size = 96;
  a.open(spec);
  b.open(spec);
  const size_t row = static_cast<size_t>(spec.seq_len + 1);
  std::vector<int32_t> t(3 * row), u(3 * row);
  std::vector<uint8_t> s(3 * row);
  for (uint64_t g = 0; g < 4; ++g) {
    a.next_with_starts(Split::train, t.data(), s.data());
    b.next(Split::train, u.data());
    EXPECT_EQ(t, u);
    for (size_t i = 0; i < 3; ++i)
      for (size_t p = 0; p < row; ++p) {
        const uint64_t offset = (g * 3 + i) * static_cast<uint64_t>(spec.seq_len) + p;  // sample j starts at j * S
        const bool begins = std::find(first.begin(), first.end(), offset) != first.end();
        EXPECT_EQ(s[i * row + p], begins ? 1 : 0) << "sample " << g * 3 + i << " position " << p;
      }
  }
  EXPECT_EQ(a.starts_unavailable(), "");
}
