// Checkpoint integrity (docs/RELIABILITY.md "Checkpoints"): COMPLETE certifies
// meta.json (size and CRC32), meta.json certifies every rank file (its header
// CRC32), and every rank file records its rank and step. So a changed digit
// in meta.json (the step, the data position, a shape), a rank file from
// another step, another rank or another run, or a renamed step folder is
// refused at load with a message naming the file — never loaded as this
// checkpoint. Checkpoints of older looms (no certificate) still load.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/file_util.hpp"
#include "checkpoint/train_checkpoint.hpp"
#include "config/run_config.hpp"
#include "reliability_util.hpp"
#include "test_util.hpp"
#include "train/session.hpp"

namespace fs = std::filesystem;
using namespace loom::test;
using loom::ckpt::CheckpointReader;
using loom::ckpt::CheckpointWriter;

namespace {

loom::Config parse(const std::string& text, const std::vector<std::string>& ov = {}) {
  return loom::parse_config_string(text, "ckpt.toml", ov);
}

// Two runs' worth of checkpoints: `dir`/run with steps 2 and 4, and `dir`/other
// (another seed) with step 4.
void make_runs(const fs::path& dir) {
  for (const auto& [name, seed] : std::vector<std::pair<std::string, std::string>>{{"run", "7"}, {"other", "8"}}) {
    loom::Session s(parse(tiny_config(dir / name, 4), {"checkpoint.every=2", "checkpoint.keep_last=0",
                                                       "run.seed=" + seed}));
    s.train();
  }
}

void expect_resume_refused(const fs::path& dir, std::initializer_list<std::string> parts) {
  expect_error(
      [&] {
        loom::Session s(parse(tiny_config(dir / "run", 6)));
        s.initialise();
      },
      parts);
}

void replace_once(std::string& text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << from;
  text.replace(at, from.size(), to);
}

}  // namespace

// Any change to meta.json after COMPLETE was written is refused: the step,
// the data position, a shape, even whitespace.
TEST(ReliabilityCheckpoints, ChangedMetadataIsRefused) {
  const fs::path dir = fresh_dir("ckpt_meta");
  make_runs(dir);
  const fs::path meta = dir / "run" / "checkpoints" / "step_00000004" / "meta.json";
  const std::string original = read_text(meta);
  const auto j = nlohmann::json::parse(original);
  const std::vector<std::pair<std::string, std::string>> edits = {
      {"\"step\": 4", "\"step\": 5"},
      {"\"samples_seen\": " + std::to_string(j["samples_seen"].get<int64_t>()),
       "\"samples_seen\": " + std::to_string(j["samples_seen"].get<int64_t>() + 1)},
      {"\"world_size\": 1", "\"world_size\": 1 "},
  };
  for (const auto& [from, to] : edits) {
    SCOPED_TRACE(from);
    std::string t = original;
    replace_once(t, from, to);
    std::ofstream(meta, std::ios::trunc) << t;
    expect_resume_refused(dir, {meta.string(), "was changed after the checkpoint was written"});
    // loom convert reads through the same checks.
    const ProcResult r = run_shell(std::string("'") + LOOM_CLI + "' convert '" + meta.parent_path().string() +
                                   "' --to-hf '" + (dir / "hf").string() + "'");
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_CONTAINS(r.out, "was changed after the checkpoint was written");
  }
  std::ofstream(meta, std::ios::trunc) << original;
  EXPECT_NO_THROW(loom::ckpt::CheckpointSet(meta.parent_path().string()));
}

// A rank file from another step of the same run.
TEST(ReliabilityCheckpoints, RankFileFromAnotherStepIsRefused) {
  const fs::path dir = fresh_dir("ckpt_other_step");
  make_runs(dir);
  const fs::path root = dir / "run" / "checkpoints";
  fs::copy_file(root / "step_00000002" / "rank_00000.bin", root / "step_00000004" / "rank_00000.bin",
                fs::copy_options::overwrite_existing);
  expect_resume_refused(dir, {(root / "step_00000004" / "rank_00000.bin").string(), "belongs to step 2",
                              "not to step 4"});
}

// A rank file of the same step and rank, from another run: the header CRC in meta.json tells.
TEST(ReliabilityCheckpoints, RankFileFromAnotherRunIsRefused) {
  const fs::path dir = fresh_dir("ckpt_other_run");
  make_runs(dir);
  fs::copy_file(dir / "other" / "checkpoints" / "step_00000004" / "rank_00000.bin",
                dir / "run" / "checkpoints" / "step_00000004" / "rank_00000.bin", fs::copy_options::overwrite_existing);
  expect_resume_refused(dir, {"rank_00000.bin is not the file this checkpoint was written with", "meta.json records"});
}

// A step folder renamed (to make an old checkpoint look newer) is refused.
TEST(ReliabilityCheckpoints, RenamedStepFolderIsRefused) {
  const fs::path dir = fresh_dir("ckpt_renamed");
  make_runs(dir);
  const fs::path root = dir / "run" / "checkpoints";
  fs::rename(root / "step_00000002", root / "step_00000006");
  expect_resume_refused(dir, {(root / "step_00000006").string(), "is named for step 6 but holds step 2"});
}

// Rank files swapped between ranks (written with the checkpoint layer directly, two ranks).
TEST(ReliabilityCheckpoints, RankFileOfAnotherRankIsRefused) {
  const fs::path dir = fresh_dir("ckpt_ranks");
  std::vector<float> a(8, 1.f), b(8, 2.f);
  for (int r = 0; r < 2; ++r) {
    CheckpointWriter w(dir.string(), 3, r);
    w.add("x", loom::Tensor(r ? b.data() : a.data(), loom::DType::f32, loom::Device::cpu, {8}));
    w.write_shard();
  }
  CheckpointWriter::write_meta(dir.string(), 3, "{\"world_size\": 2}");
  CheckpointWriter::mark_complete(dir.string(), 3);
  const fs::path step = dir / "step_00000003";
  EXPECT_NO_THROW(CheckpointReader(step.string(), 1));
  fs::rename(step / "rank_00000.bin", step / "tmp");
  fs::rename(step / "rank_00001.bin", step / "rank_00000.bin");
  fs::rename(step / "tmp", step / "rank_00001.bin");
  expect_error([&] { CheckpointReader(step.string(), 0); }, {"rank_00000.bin", "written by rank 1, not rank 0"});
  expect_error([&] { CheckpointReader(step.string(), 1); }, {"rank_00001.bin", "written by rank 0, not rank 1"});
}

// A checkpoint of an older loom (COMPLETE without a certificate, meta.json
// version 3 without rank file checksums) still resumes.
TEST(ReliabilityCheckpoints, LegacyCheckpointsStillLoad) {
  const fs::path dir = fresh_dir("ckpt_legacy");
  make_runs(dir);
  const fs::path step = dir / "run" / "checkpoints" / "step_00000004";
  auto meta = nlohmann::json::parse(read_text(step / "meta.json"));
  meta["version"] = 3;
  meta.erase("shard_header_crc32");
  std::ofstream(step / "meta.json", std::ios::trunc) << meta.dump(2);
  std::ofstream(step / "COMPLETE", std::ios::trunc) << "{\"step\": 4}\n";
  EXPECT_TRUE(CheckpointReader(step.string(), 0).legacy());
  loom::Session s(parse(tiny_config(dir / "run", 6)));
  s.initialise();
  EXPECT_EQ(s.step(), 4);
}

// The command: a refused checkpoint stops `loom train` with exit code 1
// before any step, and the checkpoint folder is left as it was.
TEST(ReliabilityCheckpoints, RefusedCheckpointStopsTheCommandAndStaysAsItWas) {
  const fs::path dir = fresh_dir("ckpt_cli");
  make_runs(dir);
  const fs::path meta = dir / "run" / "checkpoints" / "step_00000004" / "meta.json";
  std::string t = read_text(meta);
  replace_once(t, "\"step\": 4", "\"step\": 3");
  std::ofstream(meta, std::ios::trunc) << t;
  const fs::path cfg = dir / "run.toml";
  std::ofstream(cfg) << tiny_config(dir / "run", 6);
  const int lines = count_lines(dir / "run" / "metrics.jsonl");
  const ProcResult r = run_shell(std::string("'") + LOOM_CLI + "' train '" + cfg.string() + "'");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, "was changed after the checkpoint was written");
  EXPECT_EQ(read_text(meta), t);
  EXPECT_EQ(count_lines(dir / "run" / "metrics.jsonl"), lines);
  EXPECT_FALSE(fs::exists(dir / "run" / "checkpoints" / "step_00000006"));
}

// A name of the checkpoint series that is not a folder — a regular file, a
// link to /dev/null, a FIFO, a dangling link, under the canonical name of a
// step still to come or under a short one — is refused before step 1 by every
// start of `loom train` (resume auto, a fresh start replacing the run) and by
// Session::train, before metrics.jsonl is trimmed; `loom convert` listing the
// checkpoints refuses it too. Each message names the path and what to do.
TEST(ReliabilityCheckpoints, StepNameThatIsNotAFolderIsRefusedBeforeAnyWork) {
  const fs::path dir = fresh_dir("ckpt_step_not_folder");
  {
    loom::Session s(parse(tiny_config(dir / "run", 4), {"checkpoint.every=2", "checkpoint.keep_last=0"}));
    s.train();
  }
  const fs::path root = dir / "run" / "checkpoints", metrics = dir / "run" / "metrics.jsonl";
  // A line of a step after the newest checkpoint (a run killed after it): a resume would drop it.
  std::ofstream(metrics, std::ios::app) << "{\"step\": 5, \"loss\": 1.0}\n";
  const std::string metrics_before = read_text(metrics);
  const fs::path cfg = dir / "run.toml";
  std::ofstream(cfg) << tiny_config(dir / "run", 8);
  const std::vector<std::pair<std::string, std::function<void(const fs::path&)>>> kinds = {
      {"a regular file", [](const fs::path& p) { std::ofstream(p) << "x"; }},
      {"a symbolic link to /dev/null, which is a character device",
       [](const fs::path& p) { fs::create_symlink("/dev/null", p); }},
      {"a FIFO", [](const fs::path& p) { ASSERT_EQ(::mkfifo(p.c_str(), 0644), 0); }},
      {"which does not exist", [](const fs::path& p) { fs::create_symlink(p.string() + ".nowhere", p); }},
  };
  for (const std::string& name : {std::string("step_00000006"), std::string("step_7")}) {
    for (const auto& [what, make] : kinds) {
      SCOPED_TRACE(name + ": " + what);
      const fs::path bad = root / name;
      make(bad);
      for (const std::string& sets :
           {std::string(), std::string("--set checkpoint.resume=none --set run.overwrite=true")}) {
        const ProcResult r = run_shell("timeout 60 '" + std::string(LOOM_CLI) + "' train '" + cfg.string() + "' " +
                                       sets + " --set checkpoint.every=2");
        EXPECT_EQ(r.code, 1) << r.out;
        EXPECT_CONTAINS(r.out, "checkpoint.dir = ");
        EXPECT_CONTAINS(r.out, bad.string() + ", which is ");
        EXPECT_CONTAINS(r.out, what);
        EXPECT_CONTAINS(r.out, "not a checkpoint folder");
        EXPECT_CONTAINS(r.out, "Move it out of " + root.string() + " or remove it");
        EXPECT_FALSE(has(r.out, "step 1 |")) << r.out;
      }
      // The library's entry point refuses it as well, before it trims anything.
      expect_error(
          [&] {
            loom::Session s(parse(tiny_config(dir / "run", 8), {"checkpoint.every=2"}));
            s.train();
          },
          {bad.string(), "not a checkpoint folder"});
      const ProcResult c = run_shell("timeout 60 '" + std::string(LOOM_CLI) + "' convert '" + root.string() +
                                     "' --to-hf '" + (dir / "hf").string() + "'");
      EXPECT_EQ(c.code, 1) << c.out;
      EXPECT_CONTAINS(c.out, bad.string() + ", which is ");
      EXPECT_FALSE(fs::exists(dir / "hf"));
      // Nothing was touched: the metrics (the line after the checkpoint kept), the checkpoints.
      EXPECT_EQ(read_text(metrics), metrics_before);
      std::vector<std::string> left;
      for (const auto& e : fs::directory_iterator(root)) left.push_back(e.path().filename().string());
      std::sort(left.begin(), left.end());
      const std::vector<std::string> expect = {".loom.lock", "step_00000002", "step_00000004", name};
      EXPECT_EQ(left, expect);
      fs::remove(bad);
    }
  }
  // With the name gone, the run resumes and trains on.
  const ProcResult ok = run_shell("timeout 60 '" + std::string(LOOM_CLI) + "' train '" + cfg.string() + "'");
  EXPECT_EQ(ok.code, 0) << ok.out;
}
