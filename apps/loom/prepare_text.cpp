#include "prepare_text.hpp"

#include <algorithm>
#include <cmath>
#include <deque>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <new>
#include <set>
#include <system_error>

#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "loom/ops/byte_tokenizer.hpp"
#include "loom/ops/hash.hpp"
#include "parallel_tokenize.hpp"
#include "loom/ops/tokenizer.hpp"
#include "checkpoint/file_util.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"
#include "loom/token_shard.hpp"
#include "util/files.hpp"

namespace fs = std::filesystem;

namespace loom::data {
namespace {

struct Collector {
  std::vector<std::string> files;
  std::vector<std::pair<std::string, std::string>> skipped;
  std::set<fs::path> seen_files, seen_dirs;

  void add(const fs::path& p, bool explicit_input) {
    std::error_code ec;
    fs::file_status st = fs::status(p, ec);  // follows symlinks
    if (ec || !fs::exists(st)) {
      if (explicit_input)
        throw Error(cat("input '", p.string(), "' does not exist; give text files or directories of them"));
      skip(p, "a dangling symlink");
      return;
    }
    const fs::path canon = fs::canonical(p, ec);
    if (fs::is_directory(st)) {
      // Symlinked directories are followed once; the set breaks cycles.
      if (!seen_dirs.insert(ec ? p : canon).second) return;
      std::vector<fs::path> entries;
      for (auto& e : fs::directory_iterator(p, ec)) entries.push_back(e.path());
      if (ec) throw Error(cat("cannot list input directory '", p.string(), "': ", ec.message()));
      std::sort(entries.begin(), entries.end());
      for (auto& e : entries) add(e, false);
      return;
    }
    if (!fs::is_regular_file(st)) {
      skip(p, "not a regular file");
      return;
    }
    if (!seen_files.insert(ec ? p : canon).second) {
      log_debug(cat("prepare: '", p.string(), "' is the same file as one already read; reading it once"));
      return;
    }
    files.push_back(p.string());
  }
  void skip(const fs::path& p, std::string why) {
    log_warn(cat("prepare: skipping '", p.string(), "': ", why));
    skipped.emplace_back(p.string(), std::move(why));
  }
};

std::string read_file(const std::string& path) {
  // Collector let only regular files through; opened as one all the same, so
  // that a file swapped for a FIFO since cannot block the read.
  const int fd = open_regular_file(path, "input");
  struct stat st {};
  std::string s;
  if (::fstat(fd, &st) == 0) s.resize(static_cast<std::size_t>(st.st_size));
  std::size_t got = 0;
  while (got < s.size()) {
    const ssize_t n = ::read(fd, s.data() + got, s.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? std::strerror(errno) : "it is shorter than its size said";
      ::close(fd);
      throw Error(cat("error reading input '", path, "': ", why, "; check that nothing changes it while loom prepare "
                      "runs"));
    }
    got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return s;
}

struct Doc {
  uint32_t file;      // index into the used files
  uint64_t offset, size;
  bool val = false;
};

// Files are tokenized a batch of about this much text at a time: enough to
// keep every core busy, little enough to bound memory on a large corpus.
constexpr uint64_t kBatchBytes = uint64_t{64} << 20;

bool is_prepare_output(const std::string& name) {
  return name == "val.bin" || name == "prepare.json" ||
         (name.starts_with("train_") && (name.ends_with(".bin") || name.ends_with(".bin.tmp")));
}

// The folder inside OUT_DIR where a prepare writes its outputs before they
// replace the old ones. Hidden: a `train_*.bin` glob does not look inside it.
constexpr const char* kStagingName = ".prepare.tmp";

// Moves the new outputs (every file in `stage`, prepare.json last) into
// `out`, after removing the old ones the new set does not replace. Each
// rename replaces a file of the same name whole; the old prepare.json goes
// first, so a folder caught half-way has none.
void install_outputs(const fs::path& out, const fs::path& stage, const std::vector<fs::path>& old_outputs) {
  std::error_code ec;
  std::set<std::string> fresh;
  for (auto& e : fs::directory_iterator(stage, ec)) fresh.insert(e.path().filename().string());
  if (ec) throw Error(cat("cannot list '", stage.string(), "': ", ec.message()));
  auto remove_old = [&](const fs::path& p) {
    if (!fs::remove(p, ec) && ec)
      throw Error(cat("cannot remove the old output '", p.string(), "': ", ec.message(), "; the new outputs are in '",
                      stage.string(), "'"));
  };
  for (const fs::path& p : old_outputs)
    if (p.filename() == "prepare.json") remove_old(p);
  for (const fs::path& p : old_outputs)
    if (p.filename() != "prepare.json" && !fresh.count(p.filename().string())) remove_old(p);
  auto move_in = [&](const std::string& name) {
    fs::rename(stage / name, out / name, ec);
    if (ec)
      throw Error(cat("cannot move '", (stage / name).string(), "' to '", (out / name).string(), "': ", ec.message(),
                      "; the new outputs are in '", stage.string(), "'"));
  };
  for (const std::string& name : fresh)
    if (name != "prepare.json") move_in(name);
  if (fresh.count("prepare.json")) move_in("prepare.json");
  fs::remove(stage, ec);
}

// A validation window is seq_len + 1 tokens: this many serve a run at the
// default model.max_seq_len (2048). The run's seq_len is not known here.
constexpr uint64_t kValWindowTokens = 2049;

// What to say when val.bin is too small to validate a run on, "" when it is
// not: how many tokens it holds, the seq_len it serves, and the option that
// would give a usable split (a larger --val-fraction, more text, or none).
std::string small_val_warning(double fraction, const PrepareTextResult& r) {
  if (r.val_tokens >= kValWindowTokens) return "";
  const std::string what =
      r.val_tokens == 0
          ? cat("val.bin is empty (--val-fraction ", fraction, " of ", r.documents, " document",
                r.documents == 1 ? "" : "s", " is none)")
          : cat("val.bin holds only ", r.val_tokens, " tokens (", r.val_documents, " of ", r.documents,
                " documents): a run validates on it only with train.seq_len <= ", r.val_tokens - 1);
  const std::string docs_are =
      "documents are the input files and the parts of a file between lines holding only '%'";
  const uint64_t total = r.train_tokens + r.val_tokens;
  if (r.documents < 2)
    return cat(what, ". With one document no --val-fraction gives a validation split (", docs_are,
               "): give more documents, or --val-fraction 0 for no val.bin (and train.validation_every = 0)");
  // Documents needed for one window at the default max_seq_len, at this corpus's mean document length.
  const double mean = static_cast<double>(total) / static_cast<double>(r.documents);
  const uint64_t need = static_cast<uint64_t>(std::ceil(static_cast<double>(kValWindowTokens) / std::max(mean, 1.0)));
  if (need < r.documents && total >= 2 * kValWindowTokens) {
    // Rounded up to two digits, so that the suggestion is at least what is needed.
    const double f = std::ceil(static_cast<double>(need) / static_cast<double>(r.documents) * 100.0) / 100.0;
    if (f < 1.0 && f > fraction)
      return cat(what, ". --val-fraction ", f, " would put about ", kValWindowTokens,
                 " tokens there (enough for train.seq_len 2048); or give more text, or --val-fraction 0 for no val.bin");
  }
  return cat(what, ". The corpus holds ", total, " tokens in all, too few for a larger validation split: give more "
             "text, or --val-fraction 0 for no val.bin (and train.validation_every = 0)");
}

// Everything of prepare_text after the output folder's checks: loads the
// tokenizer, reads the inputs and writes the outputs into `stage`; the
// result names them where install_outputs puts them (in `out`).
PrepareTextResult prepare_into(const PrepareTextOptions& opt, const fs::path& out, const fs::path& stage);

}  // namespace

PrepareTextResult prepare_text(const PrepareTextOptions& opt) {
  if (!(opt.val_fraction >= 0.0 && opt.val_fraction < 1.0))
    throw Error(cat("--val-fraction ", opt.val_fraction, " is out of range; use a value in [0, 1), e.g. 0.05"));
  if (opt.shard_tokens == 0) throw Error("--shard-tokens must be at least 1 (default 16M)");
  if (opt.inputs.empty()) throw Error("no inputs: give at least one text file or directory");
  if (opt.out_dir.empty()) throw Error("no output directory given");

  // Refuse to mix with an earlier run's shards: a train_*.bin glob would pick
  // up stale files. With --force they are replaced, but only at the end: the
  // new outputs are written to a staging folder inside OUT_DIR and moved over
  // the old ones once everything succeeded, so a refused or failed prepare (a
  // bad tokenizer, a missing input, a full disk) leaves the old data as it was.
  std::error_code ec;
  const fs::path out(opt.out_dir);
  std::vector<fs::path> old_outputs;
  bool made_out = false;
  if (fs::exists(out, ec)) {
    if (!fs::is_directory(out, ec))
      throw Error(cat("output '", opt.out_dir, "' exists and is not a directory; choose a directory"));
    for (auto& e : fs::directory_iterator(out, ec))
      if (is_prepare_output(e.path().filename().string())) old_outputs.push_back(e.path());
    std::sort(old_outputs.begin(), old_outputs.end());
    if (!old_outputs.empty() && !opt.force)
      throw Error(cat("output directory '", opt.out_dir, "' already holds prepared data ('",
                      old_outputs.front().filename().string(), "'); pass --force to replace it or choose another directory"));
  } else {
    fs::create_directories(out, ec);
    if (ec) throw Error(cat("cannot create output directory '", opt.out_dir, "': ", ec.message()));
    made_out = true;
  }
  const fs::path stage = out / kStagingName;
  if (fs::exists(fs::symlink_status(stage, ec))) {
    log_info(cat("prepare: removing '", stage.string(), "', left by a prepare that did not finish"));
    fs::remove_all(stage, ec);
  }
  fs::create_directory(stage, ec);
  if (ec)
    throw Error(cat("cannot create the staging folder '", stage.string(), "': ", ec.message(),
                    "; check that the output directory is writable"));
  bool installing = false;
  try {
    PrepareTextResult res = prepare_into(opt, out, stage);
    installing = true;
    install_outputs(out, stage, old_outputs);
    return res;
  } catch (...) {
    // Nothing of the old outputs was touched before install_outputs; a
    // failure inside it keeps the staging folder (its message names it).
    if (!installing) {
      fs::remove_all(stage, ec);
      if (made_out) fs::remove(out, ec);  // only if empty
    }
    throw;
  }
}

namespace {

PrepareTextResult prepare_into(const PrepareTextOptions& opt, const fs::path& out, const fs::path& stage) {
  if (opt.tokenizer == "bytes" && !(opt.bos.empty() && opt.eos.empty()))
    throw Error("--bos and --eos name tokens of a tokenizer file; the byte-level tokenizer's are fixed (256, 257)");
  std::unique_ptr<Tokenizer> tok;
  try {
    tok = load_tokenizer(opt.tokenizer, {opt.bos, opt.eos});
  } catch (const std::bad_alloc&) {
    // Sizes are checked before they are allocated; what is left is a file
    // whose real contents do not fit (its text alone may be up to 1 GiB).
    std::error_code size_ec;
    const auto bytes = std::filesystem::file_size(opt.tokenizer, size_ec);
    throw Error(cat("out of memory loading tokenizer '", opt.tokenizer, "'",
                    size_ec ? std::string() : cat(" (", bytes, " bytes)"),
                    ": its contents do not fit in the memory loom prepare has here; check that it is the file meant"));
  }
  const uint32_t vocab = tok->vocab_size();
  const int width = vocab > 65536 ? 4 : 2;  // ids up to 65535 fit two bytes

  Collector col;
  for (auto& in : opt.inputs) col.add(fs::path(in), true);

  // Pass 1: validate each file and find its documents; keep only offsets.
  PrepareTextResult res;
  res.files_skipped = col.skipped;
  std::vector<Doc> docs;
  std::vector<uint64_t> doc_hash;
  std::vector<bool> repair;  // per used file: invalid UTF-8 replaced by U+FFFD
  for (auto& path : col.files) {
    std::string text = read_file(path);
    std::string why;
    bool fix = false;
    if (!is_utf8_text(text, &why)) {
      // A NUL byte means a binary file; other bad bytes are skipped too unless asked to repair them.
      if (!opt.replace_invalid_utf8 || text.find('\0') != std::string::npos) {
        const std::string hint = opt.replace_invalid_utf8 ? "" : "; --invalid-utf8 replace tokenizes it with U+FFFD for each bad sequence";
        log_warn(cat("prepare: skipping '", path, "': not UTF-8 text (", why, ")", hint));
        res.files_skipped.emplace_back(path, cat("not UTF-8 text (", why, ")"));
        continue;
      }
      std::string fixed;
      const std::size_t n = sanitize_utf8(text, fixed);
      log_warn(cat("prepare: '", path, "': ", n, " invalid UTF-8 sequence(s) replaced by U+FFFD (first: ", why, ")"));
      text = std::move(fixed);
      fix = true;
    }
    auto parts = split_documents(text);
    if (parts.empty()) {
      log_warn(cat("prepare: skipping '", path, "': no text in it"));
      res.files_skipped.emplace_back(path, "no text in it");
      continue;
    }
    const auto file_index = static_cast<uint32_t>(res.files_used.size());
    res.files_used.push_back(path);
    repair.push_back(fix);
    for (auto d : parts) {
      docs.push_back({file_index, static_cast<uint64_t>(d.data() - text.data()), d.size()});
      doc_hash.push_back(hash_bytes(opt.seed, d));
    }
  }
  if (docs.empty()) {
    std::string list;
    for (auto& [p, why] : res.files_skipped) list += cat("\n  ", p, ": ", why);
    throw Error(cat("no usable text in the inputs; every file was skipped:", list.empty() ? " (no files found)" : list));
  }
  res.documents = docs.size();

  // The val set: the round(fraction * n) documents with the smallest seeded
  // hash (ties by position), at least one when a fraction is asked for, and
  // never every document, so train is never empty.
  uint64_t n_val = 0;
  if (opt.val_fraction > 0 && docs.size() > 1) {
    n_val = static_cast<uint64_t>(std::llround(opt.val_fraction * static_cast<double>(docs.size())));
    n_val = std::clamp<uint64_t>(n_val, 1, docs.size() - 1);
  }
  {
    std::vector<uint64_t> order(docs.size());
    for (uint64_t i = 0; i < order.size(); ++i) order[i] = i;
    std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(n_val), order.end(),
                     [&](uint64_t a, uint64_t b) { return doc_hash[a] != doc_hash[b] ? doc_hash[a] < doc_hash[b] : a < b; });
    for (uint64_t i = 0; i < n_val; ++i) docs[order[i]].val = true;
  }

  // Shard names are zero-padded wide enough for every shard, so a sorted glob
  // is the write order. The token count is not known before tokenizing; a
  // token covers at least one byte, so bytes + BOS/EOS (+1 for a
  // SentencePiece dummy prefix) per document bound it.
  uint64_t train_bound = 0;
  for (auto& d : docs) {
    res.text_bytes += d.size;
    if (d.val) res.val_documents++;
    else {
      res.train_documents++;
      train_bound += d.size + 3;
    }
  }
  const uint64_t n_shards = (train_bound + opt.shard_tokens - 1) / opt.shard_tokens;
  int digits = 3;
  for (uint64_t x = n_shards > 0 ? n_shards - 1 : 0; x >= 1000; x /= 10) ++digits;

  // Pass 2: re-read the used files in order and tokenize their documents on
  // every core, a batch of files at a time; output keeps document order.
  std::vector<uint32_t> train_buf, val_buf;
  nlohmann::json shard_list = nlohmann::json::array();
  // Every shard records the ids that delimit its documents (document masking).
  const DocumentMarkers markers{tok->bos(), tok->eos()};
  auto flush_train = [&](bool final) {
    while (train_buf.size() >= opt.shard_tokens || (final && !train_buf.empty())) {
      const uint64_t n = std::min<uint64_t>(train_buf.size(), opt.shard_tokens);
      char name[64];
      std::snprintf(name, sizeof name, "train_%0*llu.bin", digits, static_cast<unsigned long long>(res.train_shards.size()));
      write_token_shard((stage / name).string(), train_buf.data(), n, width, vocab, markers);
      res.train_shards.push_back((out / name).string());
      res.train_tokens += n;
      shard_list.push_back({{"file", name}, {"tokens", n}});
      train_buf.erase(train_buf.begin(), train_buf.begin() + static_cast<std::ptrdiff_t>(n));
    }
  };
  ParallelTokenizer pt(*tok, opt.threads, opt.progress, res.text_bytes);
  res.threads = pt.threads();
  std::size_t di = 0;
  // The batch's files, kept while their documents are tokenized; a deque, so
  // that adding a file never moves the others (short ones live inside the
  // string object, and the documents point into them).
  std::deque<std::string> texts;
  std::vector<DocRef> batch;
  uint64_t batch_bytes = 0;
  auto run_batch = [&] {
    pt.run(batch, train_buf, val_buf);
    batch.clear();
    texts.clear();
    batch_bytes = 0;
    flush_train(false);
  };
  for (uint32_t f = 0; f < res.files_used.size(); ++f) {
    std::string text = read_file(res.files_used[f]);
    if (repair[f]) {
      std::string fixed;
      sanitize_utf8(text, fixed);
      text = std::move(fixed);
    }
    texts.push_back(std::move(text));
    const std::string& t = texts.back();
    for (; di < docs.size() && docs[di].file == f; ++di) {
      const Doc& d = docs[di];
      if (d.offset + d.size > t.size())
        throw Error(cat("input '", res.files_used[f], "' changed while it was being read; run loom prepare again"));
      batch.push_back({std::string_view(t.data() + d.offset, d.size), d.val, &res.files_used[f], d.offset, repair[f]});
      batch_bytes += d.size;
    }
    if (batch_bytes >= kBatchBytes) run_batch();
  }
  run_batch();
  res.tokenize_seconds = pt.finish();
  flush_train(true);
  res.val_tokens = val_buf.size();
  if (opt.val_fraction > 0) {
    res.val_shard = (out / "val.bin").string();
    write_token_shard((stage / "val.bin").string(), val_buf.data(), val_buf.size(), width, vocab, markers);
    res.val_warning = small_val_warning(opt.val_fraction, res);
    if (!res.val_warning.empty()) log_warn(cat("prepare: ", res.val_warning));
  }
  res.tokenizer = tok->kind();
  res.vocab = vocab;
  res.bos = tok->bos();
  res.eos = tok->eos();
  res.token_width = width;

  nlohmann::json skipped = nlohmann::json::array();
  for (auto& [p, why] : res.files_skipped) skipped.push_back({{"path", p}, {"reason", why}});
  nlohmann::json manifest = {
      {"format", "loom-token-shards"},
      {"tokenizer", res.tokenizer},
      {"tokenizer_engine", tok->engine()},
      {"tokenizer_file", opt.tokenizer == "bytes" ? nlohmann::json(nullptr) : nlohmann::json(opt.tokenizer)},
      {"vocab", vocab},
      {"bos", res.bos},
      {"eos", res.eos},
      {"token_width", width},
      {"invalid_utf8", opt.replace_invalid_utf8 ? "replace" : "skip"},
      {"seed", opt.seed},
      {"val_fraction", opt.val_fraction},
      {"shard_tokens", opt.shard_tokens},
      {"inputs", opt.inputs},
      {"files_used", res.files_used},
      {"files_skipped", skipped},
      {"documents", res.documents},
      {"train", {{"documents", res.train_documents}, {"tokens", res.train_tokens}, {"shards", shard_list}}},
      {"val", opt.val_fraction > 0 ? nlohmann::json{{"documents", res.val_documents}, {"tokens", res.val_tokens},
                                                    {"file", "val.bin"}}
                                   : nlohmann::json(nullptr)},
  };
  res.manifest = (out / "prepare.json").string();
  // tmp + fsync + rename, never writing through a link planted under the tmp name.
  ckpt::write_file_atomic((stage / "prepare.json").string(), manifest.dump(2) + "\n");
  return res;
}

}  // namespace

}  // namespace loom::data
