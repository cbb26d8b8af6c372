// Reads that never end (docs/RELIABILITY.md "Files"): every file Loom reads
// through a path a user gives is checked for its type before it is opened and
// read with a bound, so a FIFO, a device, a directory or a huge file is one
// clear error, at once — never a blocked open() or a read until memory runs
// out. Every command runs under `timeout 30`: exit code 124 would be a hang.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include "checkpoint/file_util.hpp"
#include "config/run_config.hpp"
#include "reliability_util.hpp"
#include "test_util.hpp"
#include "token_shard_writer.hpp"
#include "train/session.hpp"
#include "util/files.hpp"

namespace fs = std::filesystem;
using namespace loom::test;

namespace {

ProcResult loom_cmd(const std::string& args) { return run_shell(std::string("timeout 30 '") + LOOM_CLI + "' " + args); }

void make_fifo(const fs::path& p) { ASSERT_EQ(::mkfifo(p.c_str(), 0644), 0) << p; }

}  // namespace

TEST(ReliabilityReads, ConfigThatIsNotARegularFileIsRefusedAtOnce) {
  const fs::path dir = fresh_dir("reads_config");
  make_fifo(dir / "pipe.toml");
  for (const auto& [path, says] : std::vector<std::pair<std::string, std::string>>{
           {"/dev/zero", "is a character device, not a regular file"},
           {(dir / "pipe.toml").string(), "is a FIFO (named pipe), not a regular file"},
           {dir.string(), "is a directory"}}) {
    for (const char* cmd : {"check", "train"}) {
      SCOPED_TRACE(std::string(cmd) + " " + path);
      const ProcResult r = loom_cmd(std::string(cmd) + " '" + path + "'");
      EXPECT_EQ(r.code, 1) << r.out;
      EXPECT_CONTAINS(r.out, says);
      EXPECT_CONTAINS(r.out, path);
    }
  }
}

TEST(ReliabilityReads, HugeConfigIsRefusedWithTheLimit) {
  const fs::path dir = fresh_dir("reads_huge");
  {
    std::ofstream f(dir / "huge.toml");
    const std::string line(1023, '#');
    for (int i = 0; i < 17 * 1024; ++i) f << line << "\n";  // 17 MiB of comments
  }
  const ProcResult r = loom_cmd("check '" + (dir / "huge.toml").string() + "'");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, "is larger than 16 MiB");
  // A file under /proc (regular, reported size 0) is read to its end, not trusted by its size.
  EXPECT_EQ(loom::read_bounded_file("/proc/self/status", "status", 1 << 20).find("Name:"), 0u);
}

// data.train naming a FIFO (alone, or matched by a glob among real shards).
TEST(ReliabilityReads, DataShardThatIsAFifoIsRefusedAtOnce) {
  const fs::path dir = fresh_dir("reads_data");
  make_fifo(dir / "train_1.bin");
  write_tokens(dir / "train_0.bin", std::vector<uint32_t>(1000, 3), 2, 96);
  const fs::path cfg = dir / "run.toml";
  std::string text = tiny_config(dir / "run", 2);
  text.replace(text.find("plugin = \"synthetic\"\npattern = \"ramp\""), 37, "plugin = \"tokens\"");
  std::ofstream(cfg) << text;
  for (const std::string& pattern : {(dir / "train_1.bin").string(), (dir / "train_*.bin").string()}) {
    SCOPED_TRACE(pattern);
    const ProcResult r = loom_cmd("check '" + cfg.string() + "' --set 'data.train=\"" + pattern + "\"'");
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_CONTAINS(r.out, "token shard '" + (dir / "train_1.bin").string() + "' is a FIFO");
  }
}

// loom prepare --tokenizer naming a FIFO (open() would block for ever) or a
// device (/dev/zero: read until memory runs out): one error naming it, at
// once, and the output folder is not left behind.
TEST(ReliabilityReads, TokenizerThatIsNotARegularFileIsRefusedAtOnce) {
  const fs::path dir = fresh_dir("reads_tokenizer");
  make_fifo(dir / "tok.json");
  std::ofstream(dir / "in.txt") << "some text\n";
  for (const auto& [path, says] : std::vector<std::pair<std::string, std::string>>{
           {(dir / "tok.json").string(), "is a FIFO (named pipe), not a regular file"},
           {"/dev/zero", "is a character device, not a regular file"}}) {
    SCOPED_TRACE(path);
    const ProcResult r = loom_cmd("prepare text '" + (dir / "out").string() + "' '" + (dir / "in.txt").string() +
                                  "' --tokenizer '" + path + "'");
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_CONTAINS(r.out, "tokenizer '" + path + "' " + says);
    EXPECT_FALSE(fs::exists(dir / "out"));
  }
}

// Metadata files a run reads: an HF folder's config.json, a checkpoint's meta.json.
TEST(ReliabilityReads, MetadataFilesThatAreFifosAreRefusedAtOnce) {
  const fs::path dir = fresh_dir("reads_meta");
  const fs::path hf = dir / "hf";
  fs::create_directories(hf);
  make_fifo(hf / "config.json");
  const fs::path cfg = dir / "run.toml";
  std::ofstream(cfg) << tiny_config(dir / "run", 2);
  ProcResult r = loom_cmd("check '" + cfg.string() + "' --set 'model.init=\"hf:" + hf.string() + "\"'");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, (hf / "config.json").string() + "' is a FIFO");

  // A checkpoint whose meta.json was replaced by a FIFO.
  r = loom_cmd("train '" + cfg.string() + "' --set checkpoint.every=2");
  ASSERT_EQ(r.code, 0) << r.out;
  const fs::path meta = dir / "run" / "checkpoints" / "step_00000002" / "meta.json";
  fs::remove(meta);
  make_fifo(meta);
  r = loom_cmd("train '" + cfg.string() + "' --set train.steps=4");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, meta.string() + "' is a FIFO");
}

TEST(ReliabilityReads, FileTypeNamesAndTheRegularFileCheck) {
  const fs::path dir = fresh_dir("reads_types");
  make_fifo(dir / "f");
  expect_error([&] { loom::require_regular_file((dir / "f").string(), "thing"); }, {"thing '", "is a FIFO"});
  expect_error([&] { loom::require_regular_file("/dev/null", "thing"); }, {"is a character device"});
  expect_error([&] { loom::require_regular_file(dir.string(), "thing"); }, {"is a directory"});
  expect_error([&] { loom::require_regular_file((dir / "missing").string(), "thing"); }, {"does not exist"});
  std::ofstream(dir / "ok") << "x";
  EXPECT_NO_THROW(loom::require_regular_file((dir / "ok").string(), "thing"));
  expect_error([&] { (void)loom::read_bounded_file((dir / "ok").string(), "thing", 0); }, {"larger than"});
}

// The class, not one file: every file of a checkpoint and of a run folder that
// Loom reads or appends to, replaced by a FIFO (open() would block for ever)
// or a link to a device, is one error naming that file, at once.
TEST(ReliabilityReads, EveryFileOfACheckpointOrRunFolderThatIsNotRegularIsRefusedAtOnce) {
  const fs::path dir = fresh_dir("reads_every");
  const fs::path cfg = dir / "run.toml";
  std::ofstream(cfg) << tiny_config(dir / "run", 2);
  ProcResult r = loom_cmd("train '" + cfg.string() + "' --set checkpoint.every=2");
  ASSERT_EQ(r.code, 0) << r.out;
  const fs::path run = dir / "run", step = run / "checkpoints" / "step_00000002";
  const fs::path saved = dir / "saved";
  fs::copy(run, saved, fs::copy_options::recursive);
  for (const std::string name : {"COMPLETE", "meta.json", "rank_00000.bin"}) {
    for (const bool fifo : {true, false}) {
      SCOPED_TRACE(name + (fifo ? " as a FIFO" : " as a link to /dev/zero"));
      fs::remove_all(run);
      fs::copy(saved, run, fs::copy_options::recursive);
      fs::remove(step / name);
      if (fifo) make_fifo(step / name);
      else fs::create_symlink("/dev/zero", step / name);
      for (const std::string cmd : {"train '" + cfg.string() + "' --set train.steps=4",
                                    "convert '" + step.string() + "' --to-hf '" + (dir / "hf").string() + "'"}) {
        r = loom_cmd(cmd);
        EXPECT_EQ(r.code, 1) << cmd << "\n" << r.out;
        EXPECT_CONTAINS(r.out, (step / name).string() + "' is " + (fifo ? "a FIFO" : "a character device"));
      }
    }
  }
  // Files of the run folder that a run appends to or `loom plot` reads.
  fs::remove_all(run);
  fs::create_directories(run);
  make_fifo(run / "metrics.jsonl");
  r = loom_cmd("train '" + cfg.string() + "'");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, (run / "metrics.jsonl").string() + ": it is a FIFO");
  r = loom_cmd("plot '" + run.string() + "' --out '" + (dir / "plot.png").string() + "'");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, (run / "metrics.jsonl").string() + "' is a FIFO");
}
