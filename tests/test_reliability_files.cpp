// Files changed under a running job (docs/RELIABILITY.md "Files"): a token
// shard or a Megatron .bin/.idx truncated in place (reads fault with SIGBUS
// on the mapping), rewritten in place with other bytes of the same size, or
// replaced by another file at the same path is refused with an error naming
// the file — at the faulting read, at the next epoch or validation pass, and
// before a checkpoint records a data position — never a crash and never
// training on the new bytes.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>

#include "data/megatron/indexed_dataset.hpp"
#include "data/megatron/megatron_source.hpp"
#include "data/tokens/tokens_source.hpp"
#include "loom/token_shard.hpp"
#include "megatron_writer.hpp"
#include "reliability_util.hpp"
#include "test_util.hpp"
#include "token_shard_writer.hpp"

namespace fs = std::filesystem;
using namespace loom::test;

namespace {

// Rewrites tokens in place (same inode, same size) with other valid tokens,
// as `dd conv=notrunc` would: nothing but the file's identity shows it.
void overwrite_in_place(const fs::path& p, off_t at = loom::kTokenShardHeaderBytes) {
  const int fd = ::open(p.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  std::vector<uint16_t> tokens(256, 5);
  const ssize_t bytes = static_cast<ssize_t>(tokens.size() * 2);
  ASSERT_EQ(::pwrite(fd, tokens.data(), static_cast<size_t>(bytes), at), bytes);
  ::close(fd);
}

loom::DataSpec spec(int64_t batch, int64_t seq) {
  loom::DataSpec s;
  s.batch = batch;
  s.seq_len = seq;
  s.vocab_size = 96;
  s.seed = 3;
  return s;
}

// Waits past the file system's timestamp granularity, so that a write after
// it gets a new modification time (as any write minutes into a run does).
void tick() { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }

}  // namespace

// Truncated in place while mapped: the read that faults is an error naming the file.
TEST(ReliabilityFiles, ShardTruncatedInPlaceIsAnErrorNotSigbus) {
  const fs::path dir = fresh_dir("files_truncate");
  const fs::path p = dir / "a.bin";
  write_tokens(p, token_pattern(100000, 96, 0, 7), 2, 96);
  loom::TokenShard shard(p.string());
  std::vector<int32_t> out(64);
  shard.copy(90000, 64, out.data());  // fine before
  ASSERT_EQ(::truncate(p.c_str(), 4096), 0);
  expect_error([&] { shard.copy(90000, 64, out.data()); }, {p.string(), "SIGBUS", "truncated or rewritten in place"});
  expect_error([&] { (void)shard[95000]; }, {p.string(), "SIGBUS"});
  // Reads within what is left still work, and the process is alive to say so.
  EXPECT_NO_THROW(shard.copy(0, 64, out.data()));
  expect_error([&] { shard.verify_unchanged(); }, {p.string(), "size changed from 201024 to 4096 bytes"});
}

// Same size, new bytes (in place) or a new file at the path: found by the identity check.
TEST(ReliabilityFiles, ShardRewrittenOrReplacedIsDetected) {
  const fs::path dir = fresh_dir("files_identity");
  const fs::path p = dir / "a.bin";
  write_tokens(p, token_pattern(5000, 96, 0, 7), 2, 96);
  {
    loom::TokenShard shard(p.string());
    EXPECT_NO_THROW(shard.verify_unchanged());
    tick();
    overwrite_in_place(p);
    expect_error([&] { shard.verify_unchanged(); }, {p.string(), "rewritten in place"});
  }
  {
    loom::TokenShard shard(p.string());
    tick();
    write_tokens(p, token_pattern(5000, 96, 1, 7), 2, 96);  // tmp + rename: a new inode at the same path
    expect_error([&] { shard.verify_unchanged(); }, {p.string(), "replaced by another file"});
  }
  {
    loom::TokenShard shard(p.string());
    fs::remove(p);
    expect_error([&] { shard.verify_unchanged(); }, {p.string(), "can no longer be found"});
  }
}

// The tokens source checks at every epoch, every validation pass and every
// state() (what a checkpoint records): each point refuses a changed file.
TEST(ReliabilityFiles, TokensSourceChecksAtEpochsValidationAndCheckpoints) {
  const fs::path dir = fresh_dir("files_source");
  const fs::path train = dir / "train.bin", val = dir / "val.bin";
  write_tokens(train, token_pattern(400, 96, 0, 7), 2, 96);  // 400 tokens: 12 windows of 33 per epoch
  write_tokens(val, token_pattern(200, 96, 0, 7), 2, 96);
  auto open = [&] {
    loom::data::TokensOptions o;
    o.train = {train.string()};
    o.val = {val.string()};
    auto s = std::make_unique<loom::data::TokensSource>(o);
    s->open(spec(4, 32));
    return s;
  };
  std::vector<int32_t> buf(4 * 33);
  {  // epoch boundary
    auto s = open();
    s->next(loom::Split::train, buf.data());
    tick();
    overwrite_in_place(train);
    s->next(loom::Split::train, buf.data());  // still epoch 0: windows 4..7 (the mapping shows the new bytes)
    s->next(loom::Split::train, buf.data());
    expect_error([&] { s->next(loom::Split::train, buf.data()); }, {train.string(), "changed on disk"});
  }
  write_tokens(train, token_pattern(400, 96, 0, 7), 2, 96);
  {  // checkpoint
    auto s = open();
    s->next(loom::Split::train, buf.data());
    EXPECT_NO_THROW((void)s->state());
    tick();
    overwrite_in_place(train);
    expect_error([&] { (void)s->state(); }, {train.string(), "changed on disk"});
  }
  write_tokens(train, token_pattern(400, 96, 0, 7), 2, 96);
  {  // validation pass
    auto s = open();
    s->reset(loom::Split::validation);
    tick();
    overwrite_in_place(val);
    expect_error([&] { s->reset(loom::Split::validation); }, {val.string(), "changed on disk"});
  }
}

// End to end: `loom train` on shards truncated or rewritten while it runs
// stops with exit code 1 and the file named (not 135/SIGBUS, not silence);
// the same for a Megatron .bin truncated under a run.
TEST(ReliabilityFiles, TrainingStopsWhenAShardChangesUnderIt) {
  for (const std::string how : {"truncate", "rewrite"}) {
    SCOPED_TRACE(how);
    const fs::path dir = fresh_dir("files_cli_" + how);
    const fs::path shard = dir / "train_0.bin";
    // truncate: a long epoch, so the faulting read comes first; rewrite: a
    // short epoch (20 windows), so the next epoch's check finds it.
    write_tokens(shard, token_pattern(how == "truncate" ? 400000 : 20 * 31 + 1, 96, 0, 7), 2, 96);
    const fs::path cfg = dir / "run.toml";
    std::ofstream(cfg) << tiny_config(dir / "run", 100000) << "train = \"" << shard.string() << "\"\n";
    std::string text = read_text(cfg);
    text.replace(text.find("plugin = \"synthetic\"\npattern = \"ramp\""), 37, "plugin = \"tokens\"");
    std::ofstream(cfg, std::ios::trunc) << text;
    Background p(std::string("'") + LOOM_CLI + "' train '" + cfg.string() + "' --set train.seq_len=30", dir / "log.txt");
    ASSERT_TRUE(wait_for([&] { return count_lines(dir / "run" / "metrics.jsonl") >= 3; }, 120)) << p.output();
    if (how == "truncate") ASSERT_EQ(::truncate(shard.c_str(), 2048), 0);
    else overwrite_in_place(shard);
    const ProcResult r = p.wait(120);
    EXPECT_EQ(r.signal, 0) << r.out;
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_CONTAINS(r.out, shard.string());
    EXPECT_CONTAINS(r.out, how == "truncate" ? "SIGBUS" : "changed on disk");
  }
  {
    const fs::path dir = fresh_dir("files_cli_megatron");
    write_megatron(dir / "mg", megatron_docs(4000, 100, 96));  // 400000 tokens: the faulting read comes first
    const fs::path cfg = dir / "run.toml";
    std::string text = tiny_config(dir / "run", 100000);
    text.replace(text.find("plugin = \"synthetic\"\npattern = \"ramp\""), 37,
                 "plugin = \"megatron\"\nprefix = \"" + (dir / "mg").string() + "\"\nsplit = \"1,0,0\"");
    std::ofstream(cfg) << text;
    Background p(std::string("'") + LOOM_CLI + "' train '" + cfg.string() + "' --set train.seq_len=30", dir / "log.txt");
    ASSERT_TRUE(wait_for([&] { return count_lines(dir / "run" / "metrics.jsonl") >= 3; }, 120)) << p.output();
    ASSERT_EQ(::truncate((dir / "mg.bin").c_str(), 4096), 0);
    const ProcResult r = p.wait(120);
    EXPECT_EQ(r.signal, 0) << r.out;
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_CONTAINS(r.out, (dir / "mg.bin").string());
    EXPECT_CONTAINS(r.out, "SIGBUS");
  }
}

// The Megatron reader has the same guard: a .bin or .idx truncated in place
// while mapped makes the faulting read an error naming that file.
TEST(ReliabilityFiles, MegatronFileTruncatedInPlaceIsAnErrorNotSigbus) {
  const fs::path dir = fresh_dir("files_megatron_truncate");
  const std::string prefix = (dir / "mg").string(), bin = prefix + ".bin", idx = prefix + ".idx";
  write_megatron(dir / "mg", megatron_docs(2000, 100, 96));  // .bin: 400000 bytes; .idx: sizes end at byte 8034
  loom::data::IndexedDataset ds(prefix);
  std::vector<int32_t> out(64);
  ds.read(1900, 0, 64, out.data(), 96);  // fine before
  ASSERT_EQ(::truncate(bin.c_str(), 4096), 0);
  expect_error([&] { ds.read(1900, 0, 64, out.data(), 96); }, {bin, "SIGBUS", "truncated or rewritten in place"});
  expect_error([&] { (void)ds.scan(0, 2000, 96); }, {bin, "SIGBUS"});
  EXPECT_NO_THROW(ds.read(0, 0, 64, out.data(), 96));  // what is left still reads
  expect_error([&] { ds.verify_unchanged(); }, {bin, "size changed from 400000 to 4096 bytes"});
  // The index's sizes and pointers are read through its mapping too.
  ASSERT_EQ(::truncate(idx.c_str(), 4096), 0);
  expect_error([&] { (void)ds.length(1900); }, {idx, "SIGBUS"});
  expect_error([&] { ds.read(1900, 0, 64, out.data(), 96); }, {idx, "SIGBUS"});
}

// The megatron source checks its files' identity at every epoch of a train
// dataset, every validation pass and every state() (checkpoint).
TEST(ReliabilityFiles, MegatronSourceChecksAtEpochsValidationAndCheckpoints) {
  const fs::path dir = fresh_dir("files_megatron_source");
  const std::string prefix = (dir / "mg").string(), bin = prefix + ".bin", idx = prefix + ".idx";
  auto fresh = [&] { write_megatron(dir / "mg", megatron_docs(40, 20, 96)); };
  // Documents [0, 30) train: 600 tokens, 18 samples of 33 an epoch; [30, 40) validate.
  auto open = [&] {
    loom::data::MegatronOptions o;
    o.prefixes = {prefix};
    o.split = "3,1,0";
    o.shuffle = false;
    auto s = std::make_unique<loom::data::MegatronSource>(o);
    s->open(spec(4, 32));
    return s;
  };
  std::vector<int32_t> buf(4 * 33);
  fresh();
  {  // epoch boundary
    auto s = open();
    s->next(loom::Split::train, buf.data());
    tick();
    overwrite_in_place(bin, 0);
    expect_error(
        [&] {
          for (int i = 0; i < 10; ++i) s->next(loom::Split::train, buf.data());  // epoch 1 begins at the 5th batch
        },
        {bin, "changed on disk", "rewritten in place"});
  }
  fresh();
  {  // checkpoint
    auto s = open();
    s->next(loom::Split::train, buf.data());
    EXPECT_NO_THROW((void)s->state());
    tick();
    overwrite_in_place(bin, 0);
    expect_error([&] { (void)s->state(); }, {bin, "changed on disk"});
  }
  fresh();
  {  // validation pass; the index replaced by another file
    auto s = open();
    s->reset(loom::Split::validation);
    fs::copy_file(idx, idx + ".new");
    fs::rename(idx + ".new", idx);
    expect_error([&] { s->reset(loom::Split::validation); }, {idx, "changed on disk", "replaced by another file"});
  }
}
