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
#include <map>
#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/file_util.hpp"
#include "checkpoint/train_checkpoint.hpp"
#include "config/run_config.hpp"
#include "hf/hf_llama.hpp"
#include "hf/safetensors.hpp"
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

// Writes COMPLETE for meta.json as it is now: a hand edit that keeps the
// certificate valid, so only the checks past it can refuse the edit.
void recertify(const fs::path& step_dir, int64_t step) {
  const std::string t = read_text(step_dir / "meta.json");
  std::ofstream(step_dir / "COMPLETE", std::ios::trunc)
      << "{\"step\": " << step << ", \"meta_bytes\": " << t.size()
      << ", \"meta_crc32\": " << loom::ckpt::crc32(t.data(), t.size()) << "}\n";
}

// Edits meta.json (its JSON, keys in their order) and re-certifies it.
void edit_meta(const fs::path& step_dir, int64_t step, const std::function<void(nlohmann::ordered_json&)>& edit) {
  auto j = nlohmann::ordered_json::parse(read_text(step_dir / "meta.json"));
  edit(j);
  std::ofstream(step_dir / "meta.json", std::ios::trunc) << j.dump(2);
  recertify(step_dir, step);
}

// The parameter of units[u] whose name ends with `suffix`.
nlohmann::ordered_json& param_named(nlohmann::ordered_json& j, size_t u, const std::string& suffix) {
  for (auto& p : j["units"][u]["params"])
    if (p["name"].get<std::string>().ends_with(suffix)) return p;
  ADD_FAILURE() << "no parameter " << suffix;
  return j["units"][u]["params"][0];
}

std::string cli(const std::string& args) { return "timeout 120 '" + std::string(LOOM_CLI) + "' " + args; }

size_t occurrences(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// Every file of a folder with its bytes, to show a refused command changed nothing.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> m;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file() && e.path().filename() != ".loom.lock") m[e.path().string()] = read_text(e.path());
  return m;
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
// link to /dev/null, a FIFO, a dangling link, under the name of a step still
// to come — is refused before step 1 by every
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
  // (A short name such as step_7 is not a checkpoint's name at all: it is
  // warned about and left alone, AliasStepFoldersAreLeftAloneNeverCountedOrPruned.)
  for (const std::string& name : {std::string("step_00000006")}) {
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

// A second folder for a step under another spelling (`cp -r step_00000004
// step_4`, here with its rank file then truncated), or a file under a short
// name, is not a checkpoint of the run: it is warned about once, naming it,
// never resumed from, never counted toward keep_last and never pruned — so
// with keep_last = 3 every good checkpoint stays.
TEST(ReliabilityCheckpoints, AliasStepFoldersAreLeftAloneNeverCountedOrPruned) {
  const fs::path dir = fresh_dir("ckpt_alias");
  make_runs(dir);
  const fs::path root = dir / "run" / "checkpoints";
  fs::copy(root / "step_00000004", root / "step_4", fs::copy_options::recursive);
  fs::resize_file(root / "step_4" / "rank_00000.bin", 100);
  std::ofstream(root / "step_7") << "x";
  const fs::path cfg = dir / "run.toml";
  std::ofstream(cfg) << tiny_config(dir / "run", 6);
  const ProcResult r = run_shell(cli("train '" + cfg.string() + "' --set checkpoint.every=2 --set checkpoint.keep_last=3"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_CONTAINS(r.out, "resumed from " + (root / "step_00000004").string());
  EXPECT_EQ(occurrences(r.out, "holds 'step_4', which is not a checkpoint name Loom writes (step 4's is step_00000004)"),
            1u) << r.out;
  EXPECT_EQ(occurrences(r.out, "holds 'step_7', which is not a checkpoint name Loom writes"), 1u) << r.out;
  for (const char* kept : {"step_00000002", "step_00000004", "step_00000006", "step_4", "step_7"})
    EXPECT_TRUE(fs::exists(root / kept)) << kept;
  EXPECT_EQ(fs::file_size(root / "step_4" / "rank_00000.bin"), 100u);
  // The next save prunes one good checkpoint, never the alias in its place.
  std::ofstream(cfg, std::ios::trunc) << tiny_config(dir / "run", 8);
  const ProcResult r2 = run_shell(cli("train '" + cfg.string() + "' --set checkpoint.every=2 --set checkpoint.keep_last=3"));
  EXPECT_EQ(r2.code, 0) << r2.out;
  EXPECT_FALSE(fs::exists(root / "step_00000002"));
  for (const char* kept : {"step_00000004", "step_00000006", "step_00000008", "step_4", "step_7"})
    EXPECT_TRUE(fs::exists(root / kept)) << kept;
}

// resume = "auto" passing over a newer folder without its COMPLETE marker
// (an interrupted save) says so, naming it, before it resumes.
TEST(ReliabilityCheckpoints, AutoResumeNamesTheUnfinishedSaveItPassesOver) {
  const fs::path dir = fresh_dir("ckpt_unfinished");
  make_runs(dir);
  const fs::path root = dir / "run" / "checkpoints";
  fs::remove(root / "step_00000004" / "COMPLETE");
  const fs::path cfg = dir / "run.toml";
  std::ofstream(cfg) << tiny_config(dir / "run", 6);
  const ProcResult r = run_shell(cli("train '" + cfg.string() + "'"));
  EXPECT_EQ(r.code, 0) << r.out;
  const std::string warning = "passing over " + (root / "step_00000004").string() + " (no COMPLETE marker";
  EXPECT_CONTAINS(r.out, warning);
  EXPECT_CONTAINS(r.out, "resuming from " + (root / "step_00000002").string());
  EXPECT_LT(r.out.find(warning), r.out.find("resumed from " + (root / "step_00000002").string())) << r.out;
}

// The newest checkpoint damaged (a truncated rank file): "auto" refuses before
// any work, naming the file, the newest earlier checkpoint that validates and
// the exact way back to it; going back with checkpoint.resume = 2 is refused
// naming the later folder as damaged; the way given works; nothing is moved
// or changed by the refused runs.
TEST(ReliabilityCheckpoints, DamagedNewestCheckpointNamesTheWayBack) {
  const fs::path dir = fresh_dir("ckpt_way_back");
  make_runs(dir);
  const fs::path root = dir / "run" / "checkpoints", bad = root / "step_00000004";
  fs::resize_file(bad / "rank_00000.bin", 1000);
  const fs::path cfg = dir / "run.toml";
  std::ofstream(cfg) << tiny_config(dir / "run", 6) << "";
  const auto before = snapshot(dir / "run");
  const std::string train = "train '" + cfg.string() + "' --set checkpoint.every=2";
  const std::string mv = "mv '" + bad.string() + "' '" + (root / "damaged_step_00000004").string() + "'";
  for (const std::string& cmd : {train, "check '" + cfg.string() + "' --set checkpoint.every=2"}) {
    SCOPED_TRACE(cmd);
    const ProcResult r = run_shell(cli(cmd));
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_CONTAINS(r.out, (bad / "rank_00000.bin").string());
    EXPECT_CONTAINS(r.out, "the checkpoint cannot be used");
    EXPECT_CONTAINS(r.out, "The newest earlier checkpoint that validates is " + (root / "step_00000002").string());
    EXPECT_CONTAINS(r.out, mv);
    EXPECT_CONTAINS(r.out, "checkpoint.resume = \"auto\" (it resumes from step 2)");
    EXPECT_FALSE(has(r.out, "step 1 |")) << r.out;
  }
  const ProcResult back = run_shell(cli(train + " --set checkpoint.resume=2"));
  EXPECT_EQ(back.code, 1) << back.out;
  EXPECT_CONTAINS(back.out, bad.string() + " (damaged: ");
  EXPECT_CONTAINS(back.out, mv);
  EXPECT_EQ(snapshot(dir / "run"), before);
  // The way given: move the damaged folder aside, run again.
  ASSERT_EQ(run_shell(mv).code, 0);
  const ProcResult ok = run_shell(cli(train));
  EXPECT_EQ(ok.code, 0) << ok.out;
  EXPECT_CONTAINS(ok.out, "resumed from " + (root / "step_00000002").string());
  EXPECT_EQ(fs::file_size(root / "damaged_step_00000004" / "rank_00000.bin"), 1000u);
}

// `loom check` says what `loom train` would: a damaged checkpoint it would
// resume (above), and a truncated model.safetensors under model.init = "hf:".
TEST(ReliabilityCheckpoints, CheckRefusesTheHfWeightsTrainWould) {
  const fs::path dir = fresh_dir("ckpt_check_hf");
  make_runs(dir);
  const fs::path hf = dir / "hf";
  ASSERT_EQ(run_shell(cli("convert '" + (dir / "run" / "checkpoints" / "step_00000004").string() + "' --to-hf '" +
                          hf.string() + "'")).code, 0);
  const fs::path cfg = dir / "fresh.toml";
  std::ofstream(cfg) << tiny_config(dir / "fresh", 2);
  const std::string init = " --set 'model.init=hf:" + hf.string() + "'";
  EXPECT_EQ(run_shell(cli("check '" + cfg.string() + "'" + init)).code, 0);
  fs::resize_file(hf / "model.safetensors", fs::file_size(hf / "model.safetensors") / 2);
  for (const char* cmd : {"check", "train"}) {
    SCOPED_TRACE(cmd);
    const ProcResult r = run_shell(cli(std::string(cmd) + " '" + cfg.string() + "'" + init));
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_CONTAINS(r.out, (hf / "model.safetensors").string());
    EXPECT_FALSE(has(r.out, ": ok")) << r.out;
  }
}

// A refused resume creates nothing: checkpoint.dir naming a folder that is
// not there (a typo) with a step to resume is refused before the run's
// folders are made.
TEST(ReliabilityCheckpoints, RefusedResumeCreatesNoFolder) {
  const fs::path dir = fresh_dir("ckpt_nothing_made");
  const fs::path cfg = dir / "run.toml";
  std::ofstream(cfg) << tiny_config(dir / "run", 2);
  const ProcResult r = run_shell(cli("train '" + cfg.string() + "' --set 'checkpoint.dir=" + (dir / "typo").string() +
                                     "' --set checkpoint.resume=4"));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_CONTAINS(r.out, "no checkpoint for step 4 in " + (dir / "typo").string() + " (the folder does not exist)");
  EXPECT_FALSE(fs::exists(dir / "typo"));
  EXPECT_FALSE(fs::exists(dir / "run"));
}

// The marker's legacy form ({"step": 4}) cannot switch the certificate off:
// meta.json's format version decides. Here meta.json had two same-shaped
// matrices' offsets swapped; both commands refuse it, naming the marker.
TEST(ReliabilityCheckpoints, LegacyMarkerOnACertifiedFormatIsRefused) {
  const fs::path dir = fresh_dir("ckpt_legacy_marker");
  make_runs(dir);
  const fs::path step = dir / "run" / "checkpoints" / "step_00000004";
  edit_meta(step, 4, [](nlohmann::ordered_json& j) {
    auto& q = param_named(j, 1, "q_proj.weight");
    auto& o = param_named(j, 1, "o_proj.weight");
    std::swap(q["offset"], o["offset"]);
  });
  std::ofstream(step / "COMPLETE", std::ios::trunc) << "{\"step\": 4}\n";
  const std::vector<std::string> says = {(step / "COMPLETE").string(), "records the step only",
                                         "format version 5", "cannot be trusted"};
  expect_resume_refused(dir, {says[0], says[1], says[2], says[3]});
  const ProcResult r = run_shell(cli("convert '" + step.string() + "' --to-hf '" + (dir / "hf").string() + "'"));
  EXPECT_EQ(r.code, 1) << r.out;
  for (const std::string& s : says) EXPECT_CONTAINS(r.out, s);
  EXPECT_FALSE(fs::exists(dir / "hf"));
}

// Past the certificate (re-certified by hand), the layout is still held to
// the one the checkpoint's own model record derives: offsets swapped or
// overlapping, units swapped, two same-shaped parameters' names swapped —
// each refused naming the parameter or unit, by resume and convert.
TEST(ReliabilityCheckpoints, EditedLayoutIsRefusedEvenWhenRecertified) {
  const fs::path dir = fresh_dir("ckpt_layout");
  make_runs(dir);
  const fs::path step = dir / "run" / "checkpoints" / "step_00000004";
  const std::string meta = read_text(step / "meta.json"), marker = read_text(step / "COMPLETE");
  const std::vector<std::pair<std::function<void(nlohmann::ordered_json&)>, std::vector<std::string>>> cases = {
      {[](auto& j) { std::swap(param_named(j, 1, "q_proj.weight")["offset"], param_named(j, 1, "o_proj.weight")["offset"]); },
       {"parameter 'model.layers.0.self_attn.q_proj.weight' is at offset", "of unit layer.0"}},
      {[](auto& j) { param_named(j, 1, "k_proj.weight")["offset"] = param_named(j, 1, "q_proj.weight")["offset"]; },
       {"parameter 'model.layers.0.self_attn.k_proj.weight' is at offset", "overlap"}},
      {[](auto& j) { std::swap(j["units"][1], j["units"][2]); }, {"units[1] is unit layer.1 where", "has unit layer.0"}},
      {[](auto& j) { std::swap(param_named(j, 1, "q_proj.weight")["name"], param_named(j, 1, "o_proj.weight")["name"]); },
       {"parameter 'model.layers.0.self_attn.", "would be loaded in each other's place"}},
  };
  for (const auto& [edit, says] : cases) {
    SCOPED_TRACE(says[0]);
    std::ofstream(step / "meta.json", std::ios::trunc) << meta;
    edit_meta(step, 4, edit);
    expect_error([&] { loom::ckpt::CheckpointSet set(step.string()); }, {(step / "meta.json").string(), says[0], says[1]});
    const ProcResult r = run_shell(cli("convert '" + step.string() + "' --to-hf '" + (dir / "hf").string() + "'"));
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_CONTAINS(r.out, says[0]);
    EXPECT_FALSE(fs::exists(dir / "hf"));
  }
  std::ofstream(step / "meta.json", std::ios::trunc) << meta;
  std::ofstream(step / "COMPLETE", std::ios::trunc) << marker;
  EXPECT_NO_THROW(loom::ckpt::CheckpointSet(step.string()));
}

// Every field of meta.json the reader reads is type- and range-checked under
// a re-certified marker: another type, null, a negative, a huge number or a
// fraction is refused naming meta.json, the key, the value found and what was
// expected — never an internal error, never a wrapped-around number.
TEST(ReliabilityCheckpoints, EveryMetadataFieldIsTypeChecked) {
  const fs::path dir = fresh_dir("ckpt_meta_fields");
  make_runs(dir);
  const fs::path step = dir / "run" / "checkpoints" / "step_00000004";
  const std::string meta = read_text(step / "meta.json");
  using J = nlohmann::ordered_json;
  auto at = [](std::vector<std::string> path) {
    return [path](J& j, const J& v) {
      J* p = &j;
      for (const std::string& k : path)
        p = k[0] >= '0' && k[0] <= '9' ? &(*p)[static_cast<size_t>(std::stoul(k))] : &(*p)[k];
      *p = v;
    };
  };
  const std::vector<std::pair<std::string, std::function<void(J&, const J&)>>> fields = {
      {"version", at({"version"})},
      {"step", at({"step"})},
      {"world_size", at({"world_size"})},
      {"shard_header_crc32", at({"shard_header_crc32"})},
      {"shard_header_crc32[0]", at({"shard_header_crc32", "0"})},
      {"strategy", at({"strategy"})},
      {"precision", at({"precision"})},
      {"layers", at({"layers"})},
      {"dtypes", at({"dtypes"})},
      {"dtypes.params", at({"dtypes", "params"})},
      {"dtypes.optim_state", at({"dtypes", "optim_state"})},
      {"dtypes.master", at({"dtypes", "master"})},
      {"model", at({"model"})},
      {"model.hidden", at({"model", "hidden"})},
      {"model.num_layers", at({"model", "num_layers"})},
      {"model.num_heads", at({"model", "num_heads"})},
      {"model.num_kv_heads", at({"model", "num_kv_heads"})},
      {"model.ffn_hidden", at({"model", "ffn_hidden"})},
      {"model.vocab_size", at({"model", "vocab_size"})},
      {"model.rope_theta", at({"model", "rope_theta"})},
      {"model.norm_eps", at({"model", "norm_eps"})},
      {"model.tied_embeddings", at({"model", "tied_embeddings"})},
      {"units", at({"units"})},
      {"units[1]", at({"units", "1"})},
      {"units[1].name", at({"units", "1", "name"})},
      {"units[1].numel", at({"units", "1", "numel"})},
      {"units[1].shards", at({"units", "1", "shards"})},
      {"units[1].shards[0]", at({"units", "1", "shards", "0"})},
      {"units[1].shards[0][0]", at({"units", "1", "shards", "0", "0"})},
      {"units[1].shards[0][1]", at({"units", "1", "shards", "0", "1"})},
      {"units[1].shards[0][2]", at({"units", "1", "shards", "0", "2"})},
      {"units[1].params", at({"units", "1", "params"})},
      {"units[1].params[1]", at({"units", "1", "params", "1"})},
      {"units[1].params[1].name", at({"units", "1", "params", "1", "name"})},
      {"units[1].params[1].shape", at({"units", "1", "params", "1", "shape"})},
      {"units[1].params[1].shape[0]", at({"units", "1", "params", "1", "shape", "0"})},
      {"units[1].params[1].offset", at({"units", "1", "params", "1", "offset"})},
      {"data_plugin", at({"data_plugin"})},
      {"data_state", at({"data_state"})},
      {"precision_tensors", at({"precision_tensors"})},
      {"samples_seen", at({"samples_seen"})},
  };
  const std::vector<std::string> values = {"\"1\"", "null", "-1", "18446744073709551615", "2.5", "[]"};
  int checked = 0;
  for (const auto& [key, set] : fields) {
    for (const std::string& v : values) {
      const J value = J::parse(v);
      // Values of the right type that are no damage of this kind: any string
      // for a free-text field, and numbers a number field takes.
      const bool text = key == "strategy" || key == "precision" || key == "data_plugin" || key == "data_state" ||
                        key.ends_with(".name");
      if (text && value.is_string()) continue;
      if (key == "model.rope_theta" && (v == "2.5" || v == "18446744073709551615")) continue;
      // An empty list where a list belongs is of the right type (refused by the layout checks, in their words).
      const bool list = key == "shard_header_crc32" || key == "units" || key.ends_with("shards") ||
                        key.ends_with("params") || key.ends_with("shape") || key == "precision_tensors";
      if (list && v == "[]") continue;
      SCOPED_TRACE(key + " = " + v);
      std::ofstream(step / "meta.json", std::ios::trunc) << meta;
      edit_meta(step, 4, [&](J& j) { set(j, value); });
      try {
        loom::ckpt::CheckpointSet s(step.string());
        ADD_FAILURE() << "accepted";
      } catch (const loom::ckpt::CheckpointDamaged& e) {
        const std::string m = e.what();
        EXPECT_CONTAINS(m, (step / "meta.json").string());
        EXPECT_CONTAINS(m, "\"" + key + "\" is " + value.dump() + ", expected");
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 200);
  // The values the audit met, through the commands: named, with exit code 1.
  const std::vector<std::tuple<std::string, std::function<void(J&)>, std::string>> named = {
      {"world_size = 2^40", [](J& j) { j["world_size"] = int64_t{1} << 40; },
       "\"world_size\" is 1099511627776, expected an integer in [1, 1048576]"},
      {"layers = te", [](J& j) { j["layers"] = "te"; }, "\"layers\" is \"te\", expected one of: native, fused"},
  };
  for (const auto& [what, edit, says] : named) {
    SCOPED_TRACE(what);
    std::ofstream(step / "meta.json", std::ios::trunc) << meta;
    edit_meta(step, 4, edit);
    expect_resume_refused(dir, {(step / "meta.json").string(), says});
    const ProcResult r = run_shell(cli("convert '" + step.string() + "' --to-hf '" + (dir / "hf").string() + "'"));
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_CONTAINS(r.out, (step / "meta.json").string() + ": " + says);
    EXPECT_FALSE(has(r.out, "error: loom convert:")) << r.out;  // the prefix once
  }
  // A marker with a field of the wrong type: exit 1 naming it, not an internal error (exit 3).
  std::ofstream(step / "meta.json", std::ios::trunc) << meta;
  std::ofstream(step / "COMPLETE", std::ios::trunc) << "{\"step\": 4, \"meta_bytes\": \"6372\", \"meta_crc32\": 1}";
  const fs::path cfg = dir / "run.toml";
  std::ofstream(cfg) << tiny_config(dir / "run", 6);
  for (const std::string& cmd : {"train '" + cfg.string() + "'",
                                 "convert '" + step.string() + "' --to-hf '" + (dir / "hf").string() + "'"}) {
    const ProcResult r = run_shell(cli(cmd));
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_CONTAINS(r.out, (step / "COMPLETE").string() + ": \"meta_bytes\" is \"6372\", expected an integer >= 0");
    EXPECT_FALSE(has(r.out, "internal error")) << r.out;
  }
}

// `loom convert --to-hf DIR` into a folder that holds a model — here a
// sharded export with its index — is refused, naming the files and --force,
// and changes nothing; with --force the whole model is replaced (the old
// index and shards removed, other files kept), and the folder then loads the
// new weights.
TEST(ReliabilityCheckpoints, ConvertIntoAModelFolderNeedsForceAndThenReplacesItWhole) {
  const fs::path dir = fresh_dir("ckpt_convert_force");
  make_runs(dir);
  const std::string a = (dir / "run" / "checkpoints" / "step_00000004").string(),
                    b = (dir / "other" / "checkpoints" / "step_00000004").string();
  const fs::path hf = dir / "hf", fresh_b = dir / "hf_b";
  auto convert = [&](const std::string& from, const fs::path& to, const std::string& extra = "") {
    return run_shell(cli("convert '" + from + "' --to-hf '" + to.string() + "' --dtype fp32" + extra));
  };
  ASSERT_EQ(convert(a, hf).code, 0);
  ASSERT_EQ(convert(b, fresh_b).code, 0);
  // Run A's export, re-saved as two shards and an index (as save_pretrained shards it), beside a tokenizer.
  {
    loom::hf::SafeTensorsFile whole((hf / "model.safetensors").string());
    const std::vector<std::string>& names = whole.names();
    nlohmann::json map;
    for (int part = 0; part < 2; ++part) {
      const std::string file = "model-0000" + std::to_string(part + 1) + "-of-00002.safetensors";
      std::vector<loom::hf::SafeTensorsEntry> entries;
      for (size_t i = part * names.size() / 2; i < (part + 1) * names.size() / 2; ++i) {
        const auto& info = whole.info(names[i]);
        entries.push_back({names[i], info.shape, whole.raw(names[i]).data(), loom::DType::f32, loom::DType::f32});
        map[names[i]] = file;
      }
      loom::hf::write_safetensors((hf / file).string(), entries, {{"format", "pt"}});
    }
    std::ofstream(hf / "model.safetensors.index.json") << nlohmann::json{{"weight_map", map}}.dump();
  }
  fs::remove(hf / "model.safetensors");
  std::ofstream(hf / "tokenizer.json") << "{\"kept\": true}";
  const auto before = snapshot(hf);
  const ProcResult refused = convert(b, hf);
  EXPECT_EQ(refused.code, 1) << refused.out;
  for (const char* s : {"already holds a model", "config.json", "model-00001-of-00002.safetensors",
                        "model.safetensors.index.json", "--force"})
    EXPECT_CONTAINS(refused.out, s);
  EXPECT_FALSE(has(refused.out, "error: loom convert:")) << refused.out;
  EXPECT_EQ(snapshot(hf), before);
  const ProcResult forced = convert(b, hf, " --force");
  EXPECT_EQ(forced.code, 0) << forced.out;
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(hf)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"config.json", "model.safetensors", "tokenizer.json"}));
  EXPECT_EQ(read_text(hf / "model.safetensors"), read_text(fresh_b / "model.safetensors"));
  EXPECT_EQ(read_text(hf / "config.json"), read_text(fresh_b / "config.json"));
  EXPECT_EQ(read_text(hf / "tokenizer.json"), "{\"kept\": true}");
  // A file where the folder should be.
  std::ofstream(dir / "afile") << "x";
  const ProcResult file = convert(b, dir / "afile", " --force");
  EXPECT_EQ(file.code, 1) << file.out;
  EXPECT_CONTAINS(file.out, "is a file");
}
