// Outputs (docs/RELIABILITY.md "Files"): every write is checked; run.out_dir
// and checkpoint.dir are checked before step 1 — a file where a folder should
// be, a name too long, a read-only or full file system — each with a message
// naming the key and the path (never "internal error"); a previous run is
// never overwritten without run.overwrite = true; a run locks its folders, so
// a second run on them is refused while the first lives (and not after it
// died, even by kill -9). The full-disk and read-only cases mount a small
// tmpfs and need root: they skip with a message otherwise (CI runs as root).
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "reliability_util.hpp"
#include "token_shard_writer.hpp"

namespace fs = std::filesystem;
using namespace loom::test;

namespace {

// For Background (which bounds the time itself, and signals the pid it started).
std::string train_cmd(const fs::path& cfg, const std::string& sets = "") {
  return std::string("'") + LOOM_CLI + "' train '" + cfg.string() + "' " + sets;
}

// A run in the foreground, bounded: a run that is not refused as expected
// ends the test instead of hanging it.
ProcResult run_train(const fs::path& cfg, const std::string& sets = "") {
  return run_shell("timeout 300 " + train_cmd(cfg, sets));
}

fs::path write_config(const fs::path& dir, const fs::path& out, int64_t steps = 4) {
  const fs::path cfg = dir / "run.toml";
  std::ofstream(cfg) << tiny_config(out, steps);
  return cfg;
}

void expect_path_error(const ProcResult& r, const std::string& key, const std::string& path, const std::string& says) {
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, key + " = \"" + path + "\"");
  EXPECT_CONTAINS(r.out, says);
  EXPECT_FALSE(has(r.out, "internal error")) << r.out;
}

// A tmpfs of `size` mounted at `at` (unmounted at the end); skips without root.
class Tmpfs {
 public:
  Tmpfs(const fs::path& at, const std::string& options) : at_(at) {
    fs::create_directories(at);
    mounted_ = ::geteuid() == 0 && ::mount("tmpfs", at.c_str(), "tmpfs", 0, options.c_str()) == 0;
  }
  ~Tmpfs() {
    if (mounted_) ::umount2(at_.c_str(), MNT_DETACH);
  }
  bool ok() const { return mounted_; }

 private:
  fs::path at_;
  bool mounted_ = false;
};

#define NEED_ROOT_MOUNT(t)                                                                                  \
  if (!(t).ok()) GTEST_SKIP() << "needs root to mount a small tmpfs (CI runs as root); running as uid " << ::geteuid()

// Fills the file system holding `dir` until a write fails.
void fill(const fs::path& dir) {
  std::ofstream f(dir / "filler", std::ios::binary);
  const std::string block(4096, 'x');
  while (f.write(block.data(), block.size()) && f.flush()) {
  }
}

}  // namespace

TEST(ReliabilityOutputs, PathProblemsNameTheKeyAndThePath) {
  const fs::path dir = fresh_dir("outputs_paths");
  std::ofstream(dir / "a_file") << "not a folder";
  const fs::path cfg = write_config(dir, dir / "unused");
  // A file where a folder should be, for either key.
  expect_path_error(run_train(cfg, "--set run.out_dir=" + (dir / "a_file" / "run").string()), "run.out_dir",
                    (dir / "a_file" / "run").string(), "'" + (dir / "a_file").string() + "' is a file");
  expect_path_error(run_train(cfg, "--set checkpoint.dir=" + (dir / "a_file").string()), "checkpoint.dir",
                    (dir / "a_file").string(), "is a file, where a folder is needed");
  // A name longer than the file system allows.
  const std::string longname = (dir / std::string(300, 'n')).string();
  expect_path_error(run_train(cfg, "--set run.out_dir=" + longname), "run.out_dir", longname,
                    "is 300 characters long, more than the 255");
  // loom check says the same before a run.
  expect_path_error(run_shell(std::string("'") + LOOM_CLI + "' check '" + cfg.string() + "' --set run.out_dir=" +
                              (dir / "a_file" / "x").string()),
                    "run.out_dir", (dir / "a_file" / "x").string(), "is a file");
}

TEST(ReliabilityOutputs, ReadOnlyPlaceIsRefusedBeforeAnyWork) {
  const fs::path dir = fresh_dir("outputs_ro");
  Tmpfs ro(dir / "ro", "ro,size=1m");
  NEED_ROOT_MOUNT(ro);
  const fs::path cfg = write_config(dir, dir / "run");
  expect_path_error(run_train(cfg, "--set run.out_dir=" + (dir / "ro" / "run").string()), "run.out_dir",
                    (dir / "ro" / "run").string(), "read-only file system");
  expect_path_error(run_train(cfg, "--set checkpoint.dir=" + (dir / "ro" / "ck").string()),
                    "checkpoint.dir", (dir / "ro" / "ck").string(), "read-only file system");
}

// Full before the run starts: the write probe refuses, before step 1.
TEST(ReliabilityOutputs, FullDiskAtStartIsRefusedBeforeStepOne) {
  const fs::path dir = fresh_dir("outputs_full_start");
  Tmpfs t(dir / "mnt", "size=256k");
  NEED_ROOT_MOUNT(t);
  fill(dir / "mnt");
  const fs::path cfg = write_config(dir, dir / "mnt" / "run");
  const ProcResult r = run_train(cfg);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, "No space left on device");
  EXPECT_CONTAINS(r.out, (dir / "mnt" / "run").string());
  EXPECT_FALSE(has(r.out, "step 1/")) << r.out;
  EXPECT_FALSE(fs::exists(dir / "mnt" / "run" / "metrics.jsonl"));
}

// Full during the run: the metrics line or the checkpoint that does not fit
// stops the run with exit 1 and the file named; never exit 0 with empty files.
TEST(ReliabilityOutputs, DiskFillingDuringTheRunStopsItNamingTheFile) {
  {  // a checkpoint larger than the space left
    const fs::path dir = fresh_dir("outputs_full_ckpt");
    Tmpfs t(dir / "mnt", "size=1m");
    NEED_ROOT_MOUNT(t);
    const fs::path cfg = write_config(dir, dir / "mnt" / "run", 6);
    const ProcResult r = run_train(cfg, "--set checkpoint.every=2");
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_CONTAINS(r.out, "No space left on device");
    EXPECT_CONTAINS(r.out, (dir / "mnt" / "run" / "checkpoints" / "step_00000002").string());
    EXPECT_FALSE(fs::exists(dir / "mnt" / "run" / "checkpoints" / "step_00000002" / "COMPLETE"));
  }
  {  // the metrics file: the disk fills while the run writes it
    const fs::path dir = fresh_dir("outputs_full_metrics");
    Tmpfs t(dir / "mnt", "size=1m");
    NEED_ROOT_MOUNT(t);
    const fs::path cfg = write_config(dir, dir / "mnt" / "run", 1000000);
    Background p(train_cmd(cfg), dir / "log.txt");
    ASSERT_TRUE(wait_for([&] { return count_lines(dir / "mnt" / "run" / "metrics.jsonl") >= 3; }, 60)) << p.output();
    fill(dir / "mnt");
    const ProcResult r = p.wait(120);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_CONTAINS(r.out, "writing a metrics line to " + (dir / "mnt" / "run" / "metrics.jsonl").string() + " failed");
    EXPECT_CONTAINS(r.out, "No space left on device");
  }
}

// A fresh run never replaces a previous run's results unless told to.
TEST(ReliabilityOutputs, PreviousRunIsNeverOverwrittenWithoutRunOverwrite) {
  const fs::path dir = fresh_dir("outputs_overwrite");
  const fs::path cfg = write_config(dir, dir / "run", 4);
  ASSERT_EQ(run_train(cfg, "--set checkpoint.every=2").code, 0);
  const std::string metrics = read_text(dir / "run" / "metrics.jsonl");
  const std::string meta = read_text(dir / "run" / "checkpoints" / "step_00000004" / "meta.json");
  // checkpoint.resume = "none" over checkpoints; "auto" over metrics without any checkpoint.
  ProcResult r = run_train(cfg, "--set checkpoint.resume=none --set checkpoint.every=2");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, "holds a previous run");
  EXPECT_CONTAINS(r.out, "step_00000002, step_00000004");
  EXPECT_CONTAINS(r.out, "run.overwrite = true");
  EXPECT_EQ(read_text(dir / "run" / "metrics.jsonl"), metrics);
  EXPECT_EQ(read_text(dir / "run" / "checkpoints" / "step_00000004" / "meta.json"), meta);
  r = run_train(cfg, "--set checkpoint.dir=" + (dir / "elsewhere").string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, "no complete checkpoint to resume from");
  EXPECT_EQ(read_text(dir / "run" / "metrics.jsonl"), metrics);
  // The explicit choice replaces it: old checkpoints gone, metrics of the new run only.
  r = run_train(cfg, "--set checkpoint.resume=none --set run.overwrite=true --set train.steps=3");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(count_lines(dir / "run" / "metrics.jsonl"), 3);
  EXPECT_TRUE(loom::ckpt::list_checkpoints((dir / "run" / "checkpoints").string()).empty());
}

// run.overwrite = true replaces the previous run only once the new run has
// something of its own: an error before its first checkpoint (here the step-0
// validation reading a damaged val shard) leaves the previous run as it was,
// and a replacing run killed before its first checkpoint leaves it too (its
// metrics put back by the next run in the folder).
TEST(ReliabilityOutputs, RunOverwriteKeepsThePreviousRunUntilTheNewOneHasACheckpoint) {
  const fs::path dir = fresh_dir("outputs_overwrite_late");
  const fs::path cfg = write_config(dir, dir / "run", 4);
  ASSERT_EQ(run_train(cfg, "--set checkpoint.every=2").code, 0);
  const fs::path ck = dir / "run" / "checkpoints";
  auto checkpoints = [&] {
    std::string all;
    for (const char* step : {"step_00000002", "step_00000004"})
      for (const char* f : {"meta.json", "COMPLETE", "rank_00000.bin"}) all += read_text(ck / step / f);
    return all;
  };
  auto snapshot = [&] { return read_text(dir / "run" / "metrics.jsonl") + checkpoints(); };
  const std::string metrics_before = read_text(dir / "run" / "metrics.jsonl");
  const std::string before = snapshot();
  ASSERT_EQ(count_lines(dir / "run" / "metrics.jsonl"), 4);
  // Token shards for the replacing run: a good train shard, a val shard holding a token past its vocab (96).
  const std::vector<uint32_t> t = token_pattern(4000, 96, 0, 7);
  write_tokens(dir / "train.bin", t, 2, 96);
  write_tokens(dir / "val.bin", t, 2, 96);
  set_token(dir / "val.bin", 100, 150);  // damaged in place: found when the step-0 validation reads it
  const fs::path tokens_cfg = dir / "tokens.toml";
  {
    std::string text = tiny_config(dir / "run", 6);
    text.replace(text.find("plugin = \"synthetic\"\npattern = \"ramp\""), 37, "plugin = \"tokens\"");
    std::ofstream(tokens_cfg) << text << "train = \"" << (dir / "train.bin").string() << "\"\nval = \""
                              << (dir / "val.bin").string() << "\"\n";
  }
  const std::string replace = " --set checkpoint.resume=none --set run.overwrite=true --set checkpoint.every=2";
  ProcResult r = run_train(tokens_cfg, replace + " --set train.validation_every=2 --set train.seq_len=30");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, (dir / "val.bin").string());
  EXPECT_CONTAINS(r.out, "is left as it was (2 checkpoint(s), metrics.jsonl)");
  EXPECT_FALSE(has(r.out, "replaced the previous run")) << r.out;
  EXPECT_EQ(snapshot(), before);
  EXPECT_FALSE(fs::exists(dir / "run" / "metrics.jsonl.replaced"));
  // Killed before its first checkpoint: the previous run's metrics wait aside; the next run puts them back.
  Background p(train_cmd(cfg, replace + " --set checkpoint.every=1000 --set train.steps=1000000"), dir / "log.txt");
  ASSERT_TRUE(wait_for(
      [&] {
        return fs::exists(dir / "run" / "metrics.jsonl.replaced") && count_lines(dir / "run" / "metrics.jsonl") >= 2;
      },
      120))
      << p.output();
  p.signal(SIGKILL);
  (void)p.wait(30);
  EXPECT_EQ(read_text(dir / "run" / "metrics.jsonl.replaced"), metrics_before);
  EXPECT_EQ(checkpoints(), before.substr(metrics_before.size()));
  r = run_train(cfg, "--set checkpoint.every=2 --set train.steps=6");  // resume = "auto": step 4 of the previous run
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_CONTAINS(r.out, "metrics.jsonl.replaced back to metrics.jsonl");
  EXPECT_CONTAINS(r.out, "step_00000004");
  EXPECT_EQ(count_lines(dir / "run" / "metrics.jsonl"), 6);
  EXPECT_FALSE(fs::exists(dir / "run" / "metrics.jsonl.replaced"));
  // A replacing run that writes its first checkpoint replaces the previous run, as asked.
  r = run_train(cfg, replace + " --set train.steps=3");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_CONTAINS(r.out, "replaced the previous run");
  const auto left = loom::ckpt::list_checkpoints(ck.string());  // steps 2 and 3 (the last) of the new run only
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(left[0].step + left[1].step, 5);
  EXPECT_EQ(count_lines(dir / "run" / "metrics.jsonl"), 3);
}

// One run per folder at a time; the lock goes with the process, even on kill -9.
TEST(ReliabilityOutputs, SecondRunOnTheSameFolderIsRefusedWhileTheFirstLives) {
  const fs::path dir = fresh_dir("outputs_lock");
  const fs::path cfg = write_config(dir, dir / "run", 1000000);
  Background first(train_cmd(cfg, "--set checkpoint.every=5"), dir / "first.txt");
  ASSERT_TRUE(wait_for([&] { return fs::exists(dir / "run" / "checkpoints" / "step_00000005" / "COMPLETE"); }, 60))
      << first.output();
  ProcResult r = run_train(cfg);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, "run.out_dir = \"" + (dir / "run").string() + "\" is in use by another run (pid " +
                             std::to_string(first.pid()));
  // Another out_dir, the same checkpoint.dir: refused too, naming that key.
  r = run_train(cfg, "--set run.out_dir=" + (dir / "run2").string() + " --set checkpoint.dir=" +
                                   (dir / "run" / "checkpoints").string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, "checkpoint.dir = \"" + (dir / "run" / "checkpoints").string() + "\" is in use by another run");
  first.signal(SIGKILL);
  (void)first.wait(30);
  // Killed without a word: nothing stale is left to clean; the next run resumes.
  const auto ck = loom::ckpt::latest_complete((dir / "run" / "checkpoints").string());
  ASSERT_TRUE(ck.has_value());
  r = run_train(cfg, "--set checkpoint.every=5 --set train.steps=" + std::to_string(ck->step + 2));
  EXPECT_EQ(r.code, 0) << r.out;
}

// A run killed after its last checkpoint leaves metrics lines the checkpoint
// does not include: the resumed run drops them, so each step appears once.
TEST(ReliabilityOutputs, ResumeKeepsMetricsConsistentWithTheCheckpoint) {
  const fs::path dir = fresh_dir("outputs_trim");
  const fs::path cfg = write_config(dir, dir / "run", 1000000);
  Background first(train_cmd(cfg, "--set checkpoint.every=5"), dir / "first.txt");
  ASSERT_TRUE(wait_for([&] { return count_lines(dir / "run" / "metrics.jsonl") >= 12; }, 60)) << first.output();
  first.signal(SIGKILL);
  (void)first.wait(30);
  const auto ck = loom::ckpt::latest_complete((dir / "run" / "checkpoints").string());
  ASSERT_TRUE(ck.has_value());
  const int64_t until = ck->step + 3;
  const ProcResult r = run_train(cfg, "--set train.steps=" + std::to_string(until));
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream in(dir / "run" / "metrics.jsonl");
  int64_t expect = 1;
  for (std::string line; std::getline(in, line);) {
    EXPECT_EQ(nlohmann::json::parse(line)["step"].get<int64_t>(), expect) << line;
    ++expect;
  }
  EXPECT_EQ(expect, until + 1);
}

// The files a run creates in its folders (the lock, the write probe, a file's
// temporary twin before its rename) are its own: a symbolic or hard link
// planted under one of those names — in a shared folder, by mistake or not —
// never lets the run truncate or overwrite the file it leads to. The run
// either replaces the link with a file of its own or refuses, naming it.
TEST(ReliabilityOutputs, FilesARunCreatesNeverWriteThroughAPlantedLink) {
  const fs::path dir = fresh_dir("outputs_links");
  const fs::path out = dir / "out", precious = dir / "precious.txt";
  const fs::path cfg = write_config(dir, out, 2);
  const std::string ck = (out / "checkpoints").string();
  for (const std::string name : {"out/.loom.write_test", "out/.loom.lock", "out/config.toml.tmp",
                                 "out/checkpoints/.loom.lock", "out/checkpoints/.loom.write_test",
                                 "out/checkpoints/.loom.write_test.rank_0"}) {
    for (const bool hard : {false, true}) {
      SCOPED_TRACE(name + (hard ? " as a hard link" : " as a symbolic link"));
      fs::remove_all(out);
      fs::create_directories(out / "checkpoints");
      std::ofstream(precious) << "precious";
      if (hard) fs::create_hard_link(precious, dir / name);
      else fs::create_symlink(precious, dir / name);
      const ProcResult r = run_train(cfg, "--set checkpoint.every=2");
      EXPECT_EQ(read_text(precious), "precious") << r.out;
      if (r.code != 0) {
        EXPECT_EQ(r.code, 1) << r.out;
        EXPECT_CONTAINS(r.out, (dir / name).string());
        EXPECT_FALSE(has(r.out, "internal error")) << r.out;
      }
      fs::remove(dir / name);
    }
  }
}

// run.out_dir or checkpoint.dir inside a checkpoint (this run's or another's,
// existing or to be created there): refused before any work, naming the key and
// the checkpoint; the checkpoint stays as it was.
TEST(ReliabilityOutputs, OutputFoldersInsideACheckpointAreRefused) {
  const fs::path dir = fresh_dir("outputs_inside_ckpt");
  const fs::path cfg = write_config(dir, dir / "a", 4);
  ASSERT_EQ(run_train(cfg, "--set checkpoint.every=2").code, 0);
  const fs::path step = dir / "a" / "checkpoints" / "step_00000002";
  const auto before = read_text(step / "rank_00000.bin");
  for (const auto& [key, path] : std::vector<std::pair<std::string, fs::path>>{
           {"checkpoint.dir", step}, {"checkpoint.dir", step / "more"}, {"run.out_dir", step / "b"}}) {
    SCOPED_TRACE(key + " = " + path.string());
    const std::string other = key == "run.out_dir" ? "" : "--set 'run.out_dir=\"" + (dir / "c").string() + "\"'";
    const ProcResult r = run_train(cfg, "--set '" + key + "=\"" + path.string() + "\"' " + other);
    expect_path_error(r, key, path.string(), "'" + step.string() + "' is a checkpoint");
    EXPECT_CONTAINS(r.out, "checkpoint.dir = \"" + (dir / "a" / "checkpoints").string() + "\"");
    EXPECT_FALSE(fs::exists(path / "metrics.jsonl"));
    EXPECT_FALSE(fs::exists(step / "more"));
    EXPECT_FALSE(fs::exists(step / "b"));
  }
  EXPECT_EQ(read_text(step / "rank_00000.bin"), before);
  // A folder merely named like one, without a checkpoint's files, is an ordinary folder.
  fs::create_directories(dir / "step_7");
  EXPECT_EQ(run_train(cfg, "--set 'run.out_dir=\"" + (dir / "step_7" / "run").string() + "\"'").code, 0);
}

// A symbolic link to nowhere on the way to run.out_dir or checkpoint.dir —
// the folder itself, a folder above it, a link to such a link, a link whose
// target lies under a file — would only meet the link when the folder is
// created ("File exists", after start-up). `loom check` and `loom train`
// refuse it before any work, naming the key, the value, the link and where
// it leads; nothing is created.
TEST(ReliabilityOutputs, LinkToNowhereIsRefusedNamingItsTarget) {
  const fs::path dir = fresh_dir("outputs_dangling");
  const fs::path cfg = write_config(dir, dir / "unused");
  std::ofstream(dir / "a_file") << "x";
  struct Case {
    std::string name;
    fs::path link, target, value;  // `value` is what the key is set to
    std::string says;
  };
  const std::vector<Case> cases = {
      {"the folder itself", dir / "l1", dir / "nowhere", dir / "l1", "which does not exist"},
      {"a folder above it", dir / "l2", dir / "nowhere" / "deeper", dir / "l2" / "run", "which does not exist"},
      {"a relative target", dir / "l3", "nowhere_rel", dir / "l3" / "run", "(relative to " + dir.string() + ")"},
      {"a link to a link to nowhere", dir / "l4", dir / "l1", dir / "l4", "which does not exist"},
      {"a target under a file", dir / "l5", dir / "a_file" / "x", dir / "l5" / "run", "which cannot be followed"},
  };
  for (const Case& c : cases) fs::create_symlink(c.target, c.link);
  for (const Case& c : cases)
    for (const std::string key : {"run.out_dir", "checkpoint.dir"})
      for (const std::string cmd : {"check", "train"}) {
        SCOPED_TRACE(c.name + ", " + key + ", loom " + cmd);
        const std::string other = key == "run.out_dir" ? "" : "--set 'run.out_dir=\"" + (dir / "out").string() + "\"'";
        const ProcResult r = run_shell("timeout 300 '" + std::string(LOOM_CLI) + "' " + cmd + " '" + cfg.string() +
                                       "' --set '" + key + "=\"" + c.value.string() + "\"' " + other);
        expect_path_error(r, key, c.value.string(), "'" + c.link.string() + "' is a link to '" + c.target.string() + "'");
        EXPECT_CONTAINS(r.out, c.says);
        EXPECT_FALSE(has(r.out, "File exists")) << r.out;
        EXPECT_FALSE(has(r.out, "step 1/")) << r.out;
        EXPECT_FALSE(fs::exists(dir / "out" / "metrics.jsonl"));
      }
  for (const Case& c : cases) EXPECT_TRUE(fs::is_symlink(c.link)) << c.link;
  EXPECT_FALSE(fs::exists(dir / "nowhere"));
  EXPECT_FALSE(fs::exists(dir / "nowhere_rel"));
}

// /proc, /sys and /dev (and any folder on a kernel pseudo file system,
// wherever mounted) hold the kernel's view of processes, devices and
// settings, not files: an output folder there, given directly or through a
// link, is refused by `loom check` and `loom train` before any work, naming
// the key, the value and the file system. /dev/shm, a memory file system for
// files, is a place for them.
TEST(ReliabilityOutputs, PseudoFileSystemsAreNoPlaceForOutputs) {
  const fs::path dir = fresh_dir("outputs_pseudo");
  const fs::path cfg = write_config(dir, dir / "unused");
  fs::create_symlink("/sys/kernel", dir / "to_sys");
  const std::string tag = "loom_test_" + std::to_string(::getpid());
  struct Case {
    std::string value, says;
    bool train;  // also run `loom train` (not where a mistaken mkdir would change the system)
  };
  std::vector<Case> cases = {
      {"/proc/" + tag + "/run", "'/proc' is under /proc (a proc file system)", true},
      {"/proc/self/" + tag, "'/proc/self' (that is, '/proc/", true},
      {"/proc", "'/proc' is under /proc", false},
      {"/sys/" + tag, "'/sys' is under /sys (a sysfs file system)", true},
      {"/sys/kernel/" + tag + "/run", "'/sys/kernel' is under /sys", true},
      {"/sys/fs/cgroup/" + tag, "'/sys/fs/cgroup' is under /sys", false},
      {"/dev/" + tag + "/run", "'/dev' is under /dev", true},
      {(dir / "to_sys" / tag).string(), "'" + (dir / "to_sys").string() + "' (that is, '/sys/kernel') is under /sys", true},
  };
  std::error_code ec;
  if (fs::is_directory("/dev/pts", ec)) cases.push_back({"/dev/pts/" + tag, "'/dev/pts' is under /dev", false});
  for (const Case& c : cases)
    for (const std::string key : {"run.out_dir", "checkpoint.dir"})
      for (const std::string cmd : {"check", "train"}) {
        if (cmd == "train" && !c.train) continue;
        SCOPED_TRACE(key + " = " + c.value + ", loom " + cmd);
        const std::string other = key == "run.out_dir" ? "" : "--set 'run.out_dir=\"" + (dir / "out").string() + "\"'";
        const ProcResult r = run_shell("timeout 300 '" + std::string(LOOM_CLI) + "' " + cmd + " '" + cfg.string() +
                                       "' --set '" + key + "=\"" + c.value + "\"' " + other);
        expect_path_error(r, key, c.value, c.says);
        EXPECT_CONTAINS(r.out, "it is no storage");
        EXPECT_CONTAINS(r.out, "choose another " + key);
        EXPECT_FALSE(has(r.out, "step 1/")) << r.out;
      }
  // Nothing was made there (a run that went ahead would have made its folders).
  for (const char* top : {"/proc/", "/sys/", "/dev/", "/sys/kernel/"}) {
    EXPECT_FALSE(fs::exists(top + tag, ec)) << top << tag;
    fs::remove_all(top + tag, ec);
  }
  // /dev/shm is a file system for files: checked like any other folder.
  if (fs::is_directory("/dev/shm", ec) && ::access("/dev/shm", W_OK) == 0) {
    const fs::path shm = fs::path("/dev/shm") / tag;
    const ProcResult r = run_shell("timeout 300 '" + std::string(LOOM_CLI) + "' check '" + cfg.string() +
                                   "' --no-scan --set 'run.out_dir=\"" + shm.string() + "\"'");
    EXPECT_EQ(r.code, 0) << r.out;
    fs::remove_all(shm, ec);
  }
}
