// Checkpoint format: round trips, crash leftovers, corruption and pruning.
#include <gtest/gtest.h>

#include "test_util.hpp"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/file_util.hpp"
#include "loom/error.hpp"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::ckpt;

namespace {

using loom::test::expect_error;

// Per-test scratch directory.
struct TmpDir : loom::test::TmpDir {
  TmpDir() : loom::test::TmpDir("loom_ckpt_") {}
};

// A complete one-rank checkpoint with a couple of tensors.
void save_simple(const std::string& root, int64_t step, float v = 1.0f) {
  static std::vector<float> a(100), b(7);
  for (size_t i = 0; i < a.size(); ++i) a[i] = v + static_cast<float>(i);
  for (size_t i = 0; i < b.size(); ++i) b[i] = -v * static_cast<float>(i);
  CheckpointWriter w(root, step, 0);
  w.add("params.layer.0", Tensor(a.data(), DType::f32, Device::cpu, {10, 10}));
  w.add("params.layer.1", Tensor(b.data(), DType::f32, Device::cpu, {7}));
  w.write_shard();
  CheckpointWriter::write_meta(root, step, R"({"world_size": 1, "step": )" + std::to_string(step) + "}");
  CheckpointWriter::mark_complete(root, step);
}

// Replaces the JSON header of a rank file by `edit`(header), with a valid
// header CRC (a hand edit that re-certifies it): only the field checks can
// refuse it. The data section moves with the header's length.
void edit_rank_header(const fs::path& file, const std::function<void(nlohmann::ordered_json&)>& edit) {
  const std::string bytes = read_file(file.string(), "shard");
  uint64_t hlen;
  std::memcpy(&hlen, bytes.data() + 8, 8);
  auto h = nlohmann::ordered_json::parse(bytes.substr(24, hlen));
  edit(h);
  const std::string nh = h.dump();
  const uint64_t nlen = nh.size();
  const uint32_t crc = crc32(nh.data(), nh.size());
  std::string out = bytes.substr(0, 8);
  out.append(reinterpret_cast<const char*>(&nlen), 8);
  out.append(reinterpret_cast<const char*>(&crc), 4);
  out.append(4, '\0');
  out += nh;
  const uint64_t old_start = (24 + hlen + 63) / 64 * 64, new_start = (24 + nlen + 63) / 64 * 64;
  out.append(new_start - out.size(), '\0');
  out += bytes.substr(old_start);
  std::ofstream(file, std::ios::binary | std::ios::trunc) << out;
}

std::vector<int64_t> steps_of(const std::string& root) {
  std::vector<int64_t> s;
  for (const auto& c : list_checkpoints(root)) s.push_back(c.step);
  return s;
}

void flip_byte(const fs::path& file, uint64_t offset_from_end) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-static_cast<std::streamoff>(offset_from_end), std::ios::end);
  char c;
  f.read(&c, 1);
  c ^= 0x5A;
  f.seekp(-static_cast<std::streamoff>(offset_from_end), std::ios::end);
  f.write(&c, 1);
}

}  // namespace

TEST(Crc32, KnownVectors) {
  EXPECT_EQ(crc32("", 0), 0u);
  EXPECT_EQ(crc32("123456789", 9), 0xCBF43926u);  // the standard check value
  const char* s = "The quick brown fox jumps over the lazy dog";
  EXPECT_EQ(crc32(s, std::strlen(s)), 0x414FA339u);
  // Chaining equals one pass (exercises both the 8-byte and the tail loop).
  EXPECT_EQ(crc32(s + 13, std::strlen(s) - 13, crc32(s, 13)), 0x414FA339u);
}

TEST(Checkpoint, NamesOfFilesAndDirectories) {
  EXPECT_EQ(step_dir_name(120), "step_00000120");
  EXPECT_EQ(rank_file_name(3), "rank_00003.bin");
}

TEST(Checkpoint, RoundTripSeveralDtypesAndShapes) {
  TmpDir tmp;
  std::mt19937 rng(7);
  std::vector<float> f32(3 * 5 * 7);
  for (auto& x : f32) x = std::uniform_real_distribution<float>(-3, 3)(rng);
  std::vector<uint16_t> bf16(64);
  for (auto& x : bf16) x = static_cast<uint16_t>(rng());
  std::vector<int32_t> i32(2 * 3 * 4 * 5);
  for (auto& x : i32) x = static_cast<int32_t>(rng());
  std::vector<double> f64 = {1.5, -2.25, 1e300};
  std::vector<uint8_t> e4m3(13);  // odd size: the next tensor must still be aligned
  for (auto& x : e4m3) x = static_cast<uint8_t>(rng());
  float scalar = 42.0f;

  for (int rank = 0; rank < 2; ++rank) {
    CheckpointWriter w(tmp.str(), 120, rank);
    w.add("master.layer.3", Tensor(f32.data(), DType::f32, Device::cpu, {3, 5, 7}));
    w.add("params.layer.3", Tensor(bf16.data(), DType::bf16, Device::cpu, {8, 8}));
    w.add("data.position", Tensor(i32.data(), DType::i32, Device::cpu, {2, 3, 4, 5}));
    w.add("fp8.scale", Tensor(e4m3.data(), DType::e4m3, Device::cpu, {13}));
    w.add("adam.f64", Tensor(f64.data(), DType::f64, Device::cpu, {3}));
    w.add("step", Tensor(&scalar, DType::f32, Device::cpu, {}));
    w.add("empty", Tensor(nullptr, DType::f32, Device::cpu, {0, 4}));
    w.write_shard();
  }
  const std::string meta = R"({"world_size": 2, "strategy": "zero1", "rng": [1, 2, 3]})";
  CheckpointWriter::write_meta(tmp.str(), 120, meta);
  CheckpointWriter::mark_complete(tmp.str(), 120);

  auto info = find_step(tmp.str(), 120);
  EXPECT_TRUE(info.complete);
  for (int rank = 0; rank < 2; ++rank) {
    CheckpointReader r(info.dir, rank);
    EXPECT_EQ(r.meta(), meta);
    EXPECT_EQ(r.num_ranks(), 2);
    EXPECT_EQ(r.names().size(), 7u);
    EXPECT_TRUE(r.has("fp8.scale"));
    EXPECT_FALSE(r.has("nope"));
    EXPECT_EQ(r.info("params.layer.3").dtype, DType::bf16);
    EXPECT_EQ(r.info("data.position").shape, (std::vector<int64_t>{2, 3, 4, 5}));

    std::vector<float> f32b(f32.size());
    Tensor t1(f32b.data(), DType::f32, Device::cpu, {3, 5, 7});
    r.read("master.layer.3", t1);
    EXPECT_EQ(f32b, f32);
    std::vector<uint16_t> bf16b(bf16.size());
    Tensor t2(bf16b.data(), DType::bf16, Device::cpu, {8, 8});
    r.read("params.layer.3", t2);
    EXPECT_EQ(bf16b, bf16);
    std::vector<int32_t> i32b(i32.size());
    Tensor t3(i32b.data(), DType::i32, Device::cpu, {2, 3, 4, 5});
    r.read("data.position", t3);
    EXPECT_EQ(i32b, i32);
    std::vector<uint8_t> e4m3b(e4m3.size());
    Tensor t4(e4m3b.data(), DType::e4m3, Device::cpu, {13});
    r.read("fp8.scale", t4);
    EXPECT_EQ(e4m3b, e4m3);
    std::vector<double> f64b(3);
    Tensor t5(f64b.data(), DType::f64, Device::cpu, {3});
    r.read("adam.f64", t5);
    EXPECT_EQ(f64b, f64);
    float s2 = 0;
    Tensor t6(&s2, DType::f32, Device::cpu, {});
    r.read("step", t6);
    EXPECT_EQ(s2, 42.0f);
    Tensor t7(nullptr, DType::f32, Device::cpu, {0, 4});
    r.read("empty", t7);
  }
  // No tmp files are left behind.
  for (const auto& e : fs::directory_iterator(info.dir)) EXPECT_NE(e.path().extension(), ".tmp") << e.path();
}

TEST(Checkpoint, ReadRefusesDtypeAndShapeMismatch) {
  TmpDir tmp;
  save_simple(tmp.str(), 5);
  CheckpointReader r(find_step(tmp.str(), 5).dir, 0);
  std::vector<float> buf(100);
  Tensor wrong_shape(buf.data(), DType::f32, Device::cpu, {100});
  expect_error([&] { r.read("params.layer.0", wrong_shape); }, {"rank_00000.bin", "params.layer.0", "[10,10]", "[100]"});
  Tensor wrong_dtype(buf.data(), DType::bf16, Device::cpu, {10, 10});
  expect_error([&] { r.read("params.layer.0", wrong_dtype); }, {"rank_00000.bin", "params.layer.0", "fp32", "bf16"});
  expect_error([&] { r.info("params.layer.9"); }, {"rank_00000.bin", "params.layer.9", "params.layer.0"});
}

TEST(Checkpoint, WriterRefusals) {
  TmpDir tmp;
  float x = 0;
  CheckpointWriter w(tmp.str(), 1, 0);
  w.add("a", Tensor(&x, DType::f32, Device::cpu, {1}));
  expect_error([&] { w.add("a", Tensor(&x, DType::f32, Device::cpu, {1})); }, {"'a'", "twice"});
  expect_error([&] { w.add("g", Tensor(&x, DType::f32, Device::cuda, {1})); }, {"'g'", "host"});
  Tensor strided(&x, DType::f32, Device::cpu, {2, 2});
  strided.stride[0] = 4;
  expect_error([&] { w.add("s", strided); }, {"'s'", "contiguous"});
  expect_error([&] { CheckpointWriter::write_meta(tmp.str(), 1, "{not json"); }, {"step_00000001", "JSON"});
  // Marking complete before meta / shards exist is refused.
  expect_error([&] { CheckpointWriter::mark_complete(tmp.str(), 1); }, {"meta.json"});
  CheckpointWriter::write_meta(tmp.str(), 1, R"({"world_size": 2})");
  w.write_shard();
  expect_error([&] { CheckpointWriter::mark_complete(tmp.str(), 1); }, {"rank_00001.bin", "world_size 2"});
  EXPECT_FALSE(latest_complete(tmp.str()).has_value());
  CheckpointWriter w1(tmp.str(), 1, 1);
  w1.write_shard();
  CheckpointWriter::mark_complete(tmp.str(), 1);
  ASSERT_TRUE(latest_complete(tmp.str()).has_value());
  // A complete checkpoint is never overwritten in place.
  expect_error([&] { w.write_shard(); }, {"step_00000001", "complete"});
}

TEST(Checkpoint, StaleHigherRankShardsAreDroppedOnComplete) {
  TmpDir tmp;
  float x = 1;
  // An interrupted save of step 3 with four ranks, then a resave with two.
  for (int r = 0; r < 4; ++r) {
    CheckpointWriter w(tmp.str(), 3, r);
    w.add("a", Tensor(&x, DType::f32, Device::cpu, {1}));
    w.write_shard();
  }
  for (int r = 0; r < 2; ++r) {
    CheckpointWriter w(tmp.str(), 3, r);
    w.add("a", Tensor(&x, DType::f32, Device::cpu, {1}));
    w.write_shard();
  }
  CheckpointWriter::write_meta(tmp.str(), 3, R"({"world_size": 2})");
  CheckpointWriter::mark_complete(tmp.str(), 3);
  CheckpointReader r(find_step(tmp.str(), 3).dir, 0);
  EXPECT_EQ(r.num_ranks(), 2);
  EXPECT_FALSE(fs::exists(tmp.path / "step_00000003" / "rank_00003.bin"));
}

TEST(Checkpoint, IncompleteCheckpointsAreIgnoredAndRefused) {
  TmpDir tmp;
  EXPECT_TRUE(list_checkpoints(tmp.str()).empty());
  EXPECT_TRUE(list_checkpoints((tmp.path / "does_not_exist").string()).empty());
  EXPECT_FALSE(latest_complete(tmp.str()).has_value());
  save_simple(tmp.str(), 100);
  save_simple(tmp.str(), 200);
  // Step 300: shard and meta written, then the job died before COMPLETE.
  float x = 3;
  CheckpointWriter w(tmp.str(), 300, 0);
  w.add("a", Tensor(&x, DType::f32, Device::cpu, {1}));
  w.write_shard();
  CheckpointWriter::write_meta(tmp.str(), 300, "{}");
  // Unrelated entries in root are not checkpoints.
  fs::create_directories(tmp.path / "step_abc");
  fs::create_directories(tmp.path / "logs");
  // A checkpoint's name that is not a folder is not passed over: the save of
  // step 400 would fail on it (tests/test_reliability_checkpoints.cpp).
  std::ofstream(tmp.path / "step_00000400") << "a file, not a directory";
  expect_error([&] { list_checkpoints(tmp.str()); }, {"step_00000400", "a regular file", "not a checkpoint folder"});
  fs::remove(tmp.path / "step_00000400");

  auto all = list_checkpoints(tmp.str());
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].step, 100);
  EXPECT_EQ(all[2].step, 300);
  EXPECT_FALSE(all[2].complete);
  auto latest = latest_complete(tmp.str());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 200);
  EXPECT_TRUE(latest->complete);
  expect_error([&] { CheckpointReader r(all[2].dir, 0); }, {"step_00000300", "incomplete", "100, 200"});
}

TEST(Checkpoint, FindStepErrorsListCompleteOnes) {
  TmpDir tmp;
  save_simple(tmp.str(), 10);
  save_simple(tmp.str(), 20);
  CheckpointWriter w(tmp.str(), 30, 0);
  w.write_shard();
  EXPECT_EQ(find_step(tmp.str(), 20).step, 20);
  expect_error([&] { find_step(tmp.str(), 15); }, {"step 15", tmp.str(), "10, 20"});
  expect_error([&] { find_step(tmp.str(), 30); }, {"step_00000030", "incomplete", "10, 20"});
  TmpDir empty;
  expect_error([&] { find_step(empty.str(), 1); }, {"step 1", "none"});
}

TEST(Checkpoint, TruncatedShardIsRefused) {
  TmpDir tmp;
  save_simple(tmp.str(), 7);
  fs::path f = tmp.path / "step_00000007" / "rank_00000.bin";
  fs::resize_file(f, fs::file_size(f) - 1);
  expect_error([&] { CheckpointReader r((tmp.path / "step_00000007").string(), 0); },
               {"rank_00000.bin", "params.layer.1", "truncated", "cannot be used"});
  // Truncated inside the header itself.
  fs::resize_file(f, 30);
  expect_error([&] { CheckpointReader r((tmp.path / "step_00000007").string(), 0); }, {"rank_00000.bin", "header"});
  fs::resize_file(f, 5);
  expect_error([&] { CheckpointReader r((tmp.path / "step_00000007").string(), 0); }, {"rank_00000.bin", "too short"});
}

TEST(Checkpoint, FlippedDataByteFailsCrc) {
  TmpDir tmp;
  save_simple(tmp.str(), 8);
  fs::path dir = tmp.path / "step_00000008";
  // The last tensor's data (7 floats) is the file's tail.
  flip_byte(dir / "rank_00000.bin", 5);
  CheckpointReader r(dir.string(), 0);
  std::vector<float> a(100), b(7);
  Tensor ta(a.data(), DType::f32, Device::cpu, {10, 10});
  r.read("params.layer.0", ta);  // untouched tensor still reads
  Tensor tb(b.data(), DType::f32, Device::cpu, {7});
  expect_error([&] { r.read("params.layer.1", tb); },
               {"rank_00000.bin: tensor 'params.layer.1' is corrupt (CRC mismatch)", "the checkpoint cannot be used"});
}

TEST(Checkpoint, GarbageAndCorruptHeadersAreRefused) {
  TmpDir tmp;
  save_simple(tmp.str(), 9);
  fs::path dir = tmp.path / "step_00000009";
  fs::path f = dir / "rank_00000.bin";
  std::string good = read_file(f.string(), "shard");

  // A byte flipped inside the JSON header: the header CRC catches it even if it still parses.
  std::string s = good;
  size_t pos = s.find("params.layer.0");
  s[pos + 13] = '7';
  std::ofstream(f, std::ios::binary | std::ios::trunc) << s;
  expect_error([&] { CheckpointReader r(dir.string(), 0); }, {"rank_00000.bin", "header is corrupt"});

  // Random garbage.
  std::string garbage(4096, '\0');
  std::mt19937 rng(1);
  for (auto& c : garbage) c = static_cast<char>(rng());
  std::ofstream(f, std::ios::binary | std::ios::trunc) << garbage;
  expect_error([&] { CheckpointReader r(dir.string(), 0); }, {"rank_00000.bin", "bad magic", "cannot be used"});

  // Right magic, absurd header length.
  s = good;
  uint64_t huge = 1ull << 40;
  std::memcpy(s.data() + 8, &huge, 8);
  std::ofstream(f, std::ios::binary | std::ios::trunc) << s;
  expect_error([&] { CheckpointReader r(dir.string(), 0); }, {"rank_00000.bin", "header length"});

  // Valid CRC over a header that is not JSON.
  s = good;
  uint64_t hlen;
  std::memcpy(&hlen, s.data() + 8, 8);
  for (uint64_t i = 0; i < hlen; ++i) s[24 + i] = 'x';
  uint32_t c = crc32(s.data() + 24, hlen);
  std::memcpy(s.data() + 16, &c, 4);
  std::ofstream(f, std::ios::binary | std::ios::trunc) << s;
  expect_error([&] { CheckpointReader r(dir.string(), 0); }, {"rank_00000.bin", "not valid JSON"});
}

TEST(Checkpoint, MissingTensorAndMissingShard) {
  TmpDir tmp;
  save_simple(tmp.str(), 11);
  CheckpointReader r(find_step(tmp.str(), 11).dir, 0);
  float x;
  Tensor t(&x, DType::f32, Device::cpu, {1});
  expect_error([&] { r.read("optimizer.m.layer.0", t); }, {"rank_00000.bin", "optimizer.m.layer.0", "no tensor"});
  expect_error([&] { CheckpointReader r1(find_step(tmp.str(), 11).dir, 1); }, {"rank_00001.bin", "no shard for rank 1"});
}

TEST(Checkpoint, PruneKeepsNewestCompleteOnes) {
  TmpDir tmp;
  for (int s : {10, 20, 30, 40}) save_simple(tmp.str(), s);
  // Incomplete: one older than the newest complete (a crashed save), one newer (maybe in progress).
  for (int s : {25, 50}) {
    CheckpointWriter w(tmp.str(), s, 0);
    w.write_shard();
  }
  EXPECT_TRUE(prune(tmp.str(), 0, checkpoint_damage).empty());  // 0 keeps everything
  EXPECT_EQ(list_checkpoints(tmp.str()).size(), 6u);

  auto removed = prune(tmp.str(), 2, checkpoint_damage);
  EXPECT_EQ(removed.size(), 3u);  // 10, 20 and the incomplete 25
  std::vector<int64_t> left;
  for (const auto& c : list_checkpoints(tmp.str())) left.push_back(c.step);
  EXPECT_EQ(left, (std::vector<int64_t>{30, 40, 50}));
  // Nothing but checkpoints and no trash remains.
  for (const auto& e : fs::directory_iterator(tmp.path))
    EXPECT_EQ(e.path().filename().string().rfind("step_", 0), 0u) << e.path();

  prune(tmp.str(), 1, checkpoint_damage);
  left.clear();
  for (const auto& c : list_checkpoints(tmp.str())) left.push_back(c.step);
  EXPECT_EQ(left, (std::vector<int64_t>{40, 50}));  // newest complete and the newer incomplete one stay
  prune(tmp.str(), 1, checkpoint_damage);
  EXPECT_EQ(list_checkpoints(tmp.str()).size(), 2u);
  EXPECT_EQ(latest_complete(tmp.str())->step, 40);
  // The survivors still read.
  CheckpointReader r(find_step(tmp.str(), 40).dir, 0);
  EXPECT_EQ(r.names().size(), 2u);
}

TEST(Checkpoint, PruneWithoutCompleteCheckpointsRemovesNothing) {
  TmpDir tmp;
  for (int s : {1, 2}) {
    CheckpointWriter w(tmp.str(), s, 0);
    w.write_shard();
  }
  EXPECT_TRUE(prune(tmp.str(), 1, checkpoint_damage).empty());
  EXPECT_EQ(list_checkpoints(tmp.str()).size(), 2u);
}

TEST(Checkpoint, PruneFinishesAnInterruptedDelete) {
  TmpDir tmp;
  save_simple(tmp.str(), 1);
  save_simple(tmp.str(), 2);
  fs::create_directories(tmp.path / ".step_00000001.deleting" / "junk");
  fs::remove_all(tmp.path / "step_00000001");
  prune(tmp.str(), 1, checkpoint_damage);
  EXPECT_FALSE(fs::exists(tmp.path / ".step_00000001.deleting"));
  EXPECT_TRUE(fs::exists(tmp.path / "step_00000002" / "COMPLETE"));
}

TEST(AtomicFile, AbandonedWriteLeavesOldFileIntact) {
  TmpDir tmp;
  std::string p = (tmp.path / "x.json").string();
  write_file_atomic(p, "old");
  {
    AtomicFile f(p);
    f.write("new but never committed");
  }
  EXPECT_EQ(read_file(p, "x"), "old");
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  expect_error([&] { read_file((tmp.path / "missing").string(), "thing"); }, {"thing", "missing"});
}

// Only the writer's name is a checkpoint (step_dir_name): a second folder for
// the same step ("step_4" beside "step_00000004", as `cp -r` makes, or
// "step_000000004") is not listed, not resumed from, not counted toward
// keep_last and never pruned, even when it is damaged and the good one is old.
TEST(Checkpoint, OnlyTheCanonicalNameIsACheckpoint) {
  TmpDir tmp;
  save_simple(tmp.str(), 2);
  save_simple(tmp.str(), 4);
  for (const char* alias : {"step_4", "step_000000004", "step_9"}) {
    fs::copy(tmp.path / "step_00000004", tmp.path / alias, fs::copy_options::recursive);
    fs::resize_file(tmp.path / alias / "rank_00000.bin", 100);  // a damaged copy
  }
  std::ofstream(tmp.path / "step_7") << "a file under a short name is not a checkpoint's name either";
  EXPECT_EQ(steps_of(tmp.str()), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(latest_complete(tmp.str())->dir, (tmp.path / "step_00000004").string());
  EXPECT_EQ(find_step(tmp.str(), 4).dir, (tmp.path / "step_00000004").string());
  expect_error([&] { find_step(tmp.str(), 9); }, {"no checkpoint for step 9", "2, 4"});
  save_simple(tmp.str(), 6);
  // keep_last = 3 keeps every good checkpoint: the aliases take no place.
  EXPECT_TRUE(prune(tmp.str(), 3, checkpoint_damage).empty());
  EXPECT_EQ(steps_of(tmp.str()), (std::vector<int64_t>{2, 4, 6}));
  // keep_last = 2 removes step 2 only; the aliases stay as they were.
  EXPECT_EQ(prune(tmp.str(), 2, checkpoint_damage), (std::vector<std::string>{(tmp.path / "step_00000002").string()}));
  for (const char* alias : {"step_4", "step_000000004", "step_9", "step_7"}) EXPECT_TRUE(fs::exists(tmp.path / alias)) << alias;
  EXPECT_EQ(fs::file_size(tmp.path / "step_4" / "rank_00000.bin"), 100u);
  // A folder given directly under another spelling is still checked against its marker.
  fs::copy(tmp.path / "step_00000006", tmp.path / "step_5", fs::copy_options::recursive);
  expect_error([&] { CheckpointReader r((tmp.path / "step_5").string(), 0); }, {"named for step 5 but holds step 6"});
}

// Pruning counts only checkpoints that can be counted on: a damaged one
// (here meta.json changed after its marker, and a truncated rank file) never
// takes a good one's place, so keep_last good checkpoints remain; the damaged
// ones are left in place, not deleted.
TEST(Checkpoint, PruneNeverKeepsFewerGoodCheckpointsBecauseOfDamagedOnes) {
  TmpDir tmp;
  for (int s : {10, 20, 30, 40}) save_simple(tmp.str(), s);
  fs::resize_file(tmp.path / "step_00000040" / "rank_00000.bin", 200);
  std::ofstream(tmp.path / "step_00000020" / "meta.json", std::ios::app) << " ";
  EXPECT_NE(checkpoint_damage(find_step(tmp.str(), 40)), "");
  EXPECT_NE(checkpoint_damage(find_step(tmp.str(), 20)), "");
  EXPECT_EQ(checkpoint_damage(find_step(tmp.str(), 30)), "");
  // Good: 10, 30. keep_last = 2 keeps both; the damaged 20 and 40 stay.
  EXPECT_TRUE(prune(tmp.str(), 2, checkpoint_damage).empty());
  EXPECT_EQ(steps_of(tmp.str()), (std::vector<int64_t>{10, 20, 30, 40}));
  // keep_last = 1: only 30 is needed; 10 (good, older) goes, the damaged ones stay.
  EXPECT_EQ(prune(tmp.str(), 1, checkpoint_damage), (std::vector<std::string>{(tmp.path / "step_00000010").string()}));
  EXPECT_EQ(steps_of(tmp.str()), (std::vector<int64_t>{20, 30, 40}));
  CheckpointReader r(find_step(tmp.str(), 30).dir, 0);
  EXPECT_EQ(r.names().size(), 2u);
}

// Every field of COMPLETE is type- and range-checked: another type, null, a
// negative, a fraction or a number too large is refused naming the marker,
// the key, the value as written and what was expected — never a JSON
// library's "type_error" (an internal error naming no file), never -1 shown
// as 18446744073709551615.
TEST(Checkpoint, EveryMarkerFieldIsTypeChecked) {
  TmpDir tmp;
  save_simple(tmp.str(), 4);
  const fs::path dir = tmp.path / "step_00000004", marker = dir / "COMPLETE";
  const auto good = nlohmann::ordered_json::parse(read_file(marker.string(), "marker"));
  const std::vector<std::string> bad_values = {"\"6372\"", "null", "-1", "1.5", "[]", "{}", "true",
                                               "18446744073709551615", "-9223372036854775808"};
  for (const char* key : {"step", "meta_bytes", "meta_crc32"}) {
    for (const std::string& v : bad_values) {
      SCOPED_TRACE(std::string(key) + " = " + v);
      auto c = good;
      c[key] = nlohmann::ordered_json::parse(v);
      std::ofstream(marker, std::ios::trunc) << c.dump();
      try {
        CheckpointReader r(dir.string(), 0);
        ADD_FAILURE() << "accepted";
      } catch (const CheckpointDamaged& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find(marker.string()), std::string::npos) << m;
        EXPECT_NE(m.find("\"" + std::string(key) + "\" is " + c[key].dump() + ", expected"), std::string::npos) << m;
        EXPECT_NE(m.find("cannot be used"), std::string::npos) << m;
      }
    }
    // Missing: the step always; the certificate's halves together (both missing is the old form).
    if (std::string(key) != "meta_crc32") {
      auto c = good;
      c.erase(key);
      std::ofstream(marker, std::ios::trunc) << c.dump();
      expect_error([&] { CheckpointReader r(dir.string(), 0); }, {marker.string(), "\"" + std::string(key) + "\" is missing"});
    }
  }
  // The CRC past 32 bits.
  auto c = good;
  c["meta_crc32"] = 4294967296ull;
  std::ofstream(marker, std::ios::trunc) << c.dump();
  expect_error([&] { CheckpointReader r(dir.string(), 0); }, {"\"meta_crc32\" is 4294967296, expected a CRC32"});
  // Not an object at all.
  std::ofstream(marker, std::ios::trunc) << "[4]";
  expect_error([&] { CheckpointReader r(dir.string(), 0); }, {marker.string(), "expected a JSON object"});
  std::ofstream(marker, std::ios::trunc) << good.dump();
  EXPECT_NO_THROW(CheckpointReader(dir.string(), 0));
}

// Every field of a rank file's header is type- and range-checked the same
// way, even under a header CRC recomputed after the edit.
TEST(Checkpoint, EveryRankHeaderFieldIsTypeChecked) {
  TmpDir tmp;
  save_simple(tmp.str(), 4);
  const fs::path dir = tmp.path / "step_00000004", file = dir / "rank_00000.bin";
  const std::string original = read_file(file.string(), "shard");
  edit_rank_header(file, [](nlohmann::ordered_json&) {});
  ASSERT_EQ(read_file(file.string(), "shard"), original);  // the helper itself changes nothing
  struct Case {
    std::string key;  // as the message names it
    std::function<void(nlohmann::ordered_json&, const nlohmann::ordered_json&)> set;
  };
  auto top = [](const char* k) { return [k](nlohmann::ordered_json& h, const nlohmann::ordered_json& v) { h[k] = v; }; };
  auto entry = [](const char* k) {
    return [k](nlohmann::ordered_json& h, const nlohmann::ordered_json& v) { h["tensors"][1][k] = v; };
  };
  const std::vector<Case> cases = {
      {"format", top("format")},
      {"rank", top("rank")},
      {"step", top("step")},
      {"tensors", top("tensors")},
      {"tensors[1]", [](auto& h, const auto& v) { h["tensors"][1] = v; }},
      {"tensors[1].name", entry("name")},
      {"tensors[1].dtype", entry("dtype")},
      {"tensors[1].shape", entry("shape")},
      {"tensors[1].shape[0]", [](auto& h, const auto& v) { h["tensors"][1]["shape"][0] = v; }},
      {"tensors[1].offset", entry("offset")},
      {"tensors[1].bytes", entry("bytes")},
      {"tensors[1].crc32", entry("crc32")},
  };
  for (const Case& k : cases) {
    for (const std::string& v : {std::string("\"1\""), std::string("null"), std::string("-1"),
                                 std::string("18446744073709551615"), std::string("2.5")}) {
      // A string where a string belongs, a list where a list belongs: not damage of this kind.
      if ((k.key.ends_with("name") || k.key.ends_with("dtype")) && v == "\"1\"") continue;
      SCOPED_TRACE(k.key + " = " + v);
      std::ofstream(file, std::ios::binary | std::ios::trunc) << original;
      const auto value = nlohmann::ordered_json::parse(v);
      edit_rank_header(file, [&](nlohmann::ordered_json& h) { k.set(h, value); });
      try {
        CheckpointReader r(dir.string(), 0);
        ADD_FAILURE() << "accepted";
      } catch (const CheckpointDamaged& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find(file.string()), std::string::npos) << m;
        EXPECT_NE(m.find("\"" + k.key + "\" is " + value.dump() + ", expected"), std::string::npos) << m;
      }
    }
  }
  // Values of the right type that are still wrong say so.
  std::ofstream(file, std::ios::binary | std::ios::trunc) << original;
  edit_rank_header(file, [](nlohmann::ordered_json& h) { h["format"] = 2; });
  expect_error([&] { CheckpointReader r(dir.string(), 0); }, {file.string(), "format 2, not 1"});
  std::ofstream(file, std::ios::binary | std::ios::trunc) << original;
  edit_rank_header(file, [](nlohmann::ordered_json& h) { h["tensors"][1]["shape"] = {4294967296ll, 4294967296ll}; });
  expect_error([&] { CheckpointReader r(dir.string(), 0); }, {file.string(), "too large"});
  std::ofstream(file, std::ios::binary | std::ios::trunc) << original;
  EXPECT_NO_THROW(CheckpointReader(dir.string(), 0));
}

// A marker without meta.json says what happened, not only that a file is missing.
TEST(Checkpoint, MarkerWithoutMetadataSaysSo) {
  TmpDir tmp;
  save_simple(tmp.str(), 4);
  fs::remove(tmp.path / "step_00000004" / "meta.json");
  try {
    CheckpointReader r((tmp.path / "step_00000004").string(), 0);
    ADD_FAILURE() << "accepted";
  } catch (const CheckpointDamaged& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("has its COMPLETE marker but no meta.json"), std::string::npos) << m;
    EXPECT_NE(m.find("put it back"), std::string::npos) << m;
  }
  EXPECT_NE(checkpoint_damage(find_step(tmp.str(), 4)), "");
}
