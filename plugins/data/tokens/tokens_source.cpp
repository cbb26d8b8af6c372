#include "data/tokens/tokens_source.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include <glob.h>

#include <nlohmann/json.hpp>

#include "data/common/data_state.hpp"
#include "loom/ops/hash.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"

namespace loom::data {

namespace {

// The folder glob() could not list, and why (its error callback takes no
// context: one per thread is enough, glob() calls it before returning).
thread_local std::string t_glob_path;
thread_local int t_glob_errno = 0;
int note_glob_error(const char* path, int err) {
  t_glob_path = path;
  t_glob_errno = err;
  return 1;  // stop: GLOB_ERR's answer anyway
}

}  // namespace

std::vector<std::string> expand_patterns(const std::vector<std::string>& patterns, const std::string& key) {
  std::vector<std::string> files;
  std::set<std::string> seen;
  for (auto& pat : patterns) {
    glob_t g{};
    t_glob_path.clear();
    t_glob_errno = 0;
    const int rc = ::glob(pat.c_str(), GLOB_ERR, note_glob_error, &g);  // glob() sorts its matches
    if (rc == GLOB_NOMATCH || (rc == 0 && g.gl_pathc == 0)) {
      globfree(&g);
      std::error_code ec;
      throw Error(cat("data.", key, " = \"", pat, "\" matches no files (relative paths are taken from the working directory ",
                      std::filesystem::current_path(ec).string(), "); check the path, or create the shards with loom prepare"));
    }
    if (rc != 0) {
      globfree(&g);
      if (rc == GLOB_ABORTED && !t_glob_path.empty())
        throw Error(cat("data.", key, " = \"", pat, "\": the folder '", t_glob_path, "' ",
                        t_glob_errno == ENOENT  ? std::string("does not exist")
                        : t_glob_errno == ENOTDIR ? std::string("is not a folder")
                                                  : cat("cannot be listed (", std::strerror(t_glob_errno), ")"),
                        "; check the path (relative paths are taken from the working directory)"));
      throw Error(cat("data.", key, " = \"", pat, "\": cannot list the folders it names (",
                      rc == GLOB_NOSPACE ? "out of memory" : "a read error", "); check that they exist and are readable"));
    }
    for (std::size_t i = 0; i < g.gl_pathc; ++i) {
      std::string f = g.gl_pathv[i];
      if (seen.insert(f).second) files.push_back(std::move(f));
    }
    globfree(&g);
  }
  return files;
}

TokensSource::TokensSource(TokensOptions opt) : opt_(std::move(opt)) {
  if (opt_.train.empty())
    throw Error("data plugin 'tokens' needs `train`: a glob pattern or list of patterns of token shards, "
                "e.g. train = \"data/fortunes/train_*.bin\" (written by loom prepare text)");
}

TokensSource::Stream TokensSource::open_stream(const std::vector<std::string>& patterns, const std::string& key) const {
  Stream s;
  const uint64_t S = static_cast<uint64_t>(spec_.seq_len);
  s.first_window.push_back(0);
  for (auto& path : expand_patterns(patterns, key)) {
    TokenShard shard(path);
    if (shard.vocab() > 0 && static_cast<int64_t>(shard.vocab()) > kMaxVocabSize)
      throw Error(cat("token shard '", path, "' was written for a vocabulary of ", shard.vocab(),
                      " tokens, beyond what Loom supports (model.vocab_size is at most ", kMaxVocabSize,
                      ": token ids are int32); the shard's header may be damaged, or it was made with a tokenizer Loom "
                      "cannot train — use shards from the model's tokenizer (loom prepare text)"));
    if (shard.vocab() > 0 && static_cast<int64_t>(shard.vocab()) > spec_.vocab_size)
      throw Error(cat("token shard '", path, "' was written for a vocabulary of ", shard.vocab(),
                      " tokens but the model has vocab_size = ", spec_.vocab_size,
                      "; set model.vocab_size >= ", shard.vocab(), " or use shards from the model's tokenizer"));
    const uint64_t w = shard.size() >= 1 ? (shard.size() - 1) / S : 0;
    if (w == 0)
      log_warn(cat("token shard '", path, "' has ", shard.size(), " tokens, fewer than one window of seq_len + 1 = ",
                   S + 1, "; it is not used"));
    s.windows += w;
    s.first_window.push_back(s.windows);
    s.shards.push_back(std::move(shard));
  }
  if (s.windows == 0) {
    uint64_t tokens = 0, largest = 0;  // windows do not cross shards: the largest bounds seq_len
    for (const TokenShard& sh : s.shards) tokens += sh.size(), largest = std::max<uint64_t>(largest, sh.size());
    const std::string what = cat("data.", key, ": the ", s.shards.size(), " shard(s) matched by the pattern(s) hold ",
                                 tokens, " token(s) and no window of seq_len + 1 = ", S + 1, " tokens (the first is '",
                                 s.shards.front().path(), "')");
    if (key == "val")
      throw Error(cat(what, ": there is nothing to validate on. Give validation more text — loom prepare text "
                      "--val-fraction F puts a share F of the documents into val.bin (prepare says when it is too "
                      "small); ", largest > 1 ? cat("shorten train.seq_len to at most ", largest - 1, "; ") : std::string(),
                      "or leave data.val out (and set train.validation_every = 0)"));
    throw Error(cat(what, "; use a shorter train.seq_len or more data"));
  }
  return s;
}

void TokensSource::open(const DataSpec& spec) {
  if (spec.batch < 1 || spec.seq_len < 1 || spec.vocab_size < 1 || spec.world < 1 || spec.rank < 0 ||
      spec.rank >= spec.world)
    throw Error(cat("data plugin 'tokens': invalid spec (batch ", spec.batch, ", seq_len ", spec.seq_len, ", vocab_size ",
                    spec.vocab_size, ", rank ", spec.rank, " of ", spec.world, "); all must be positive and rank < world"));
  spec_ = spec;
  seed_ = spec.seed;
  train_ = open_stream(opt_.train, "train");
  val_ = opt_.val.empty() ? Stream{} : open_stream(opt_.val, "val");
  cursor_ = val_cursor_ = logged_epoch_ = 0;
  find_markers();
  opened_ = true;
  log_info(cat("tokens: ", train_.shards.size(), " train shard(s), ", train_.windows, " windows of ", spec.seq_len + 1,
               " tokens an epoch", opt_.val.empty() ? std::string() : cat("; validation: ", val_.windows, " windows")));
}

void TokensSource::require_open(const char* what) const {
  if (!opened_) throw Error(cat("data plugin 'tokens': ", what, " called before open()"));
}

bool TokensSource::has_split(Split split) const { return split == Split::train || !opt_.val.empty(); }

void TokensSource::find_markers() {
  starts_unavailable_.clear();
  if (opt_.markers) {
    markers_ = *opt_.markers;
    for (const auto& [what, id] : {std::pair{"data.bos", markers_.bos}, std::pair{"data.eos", markers_.eos}})
      if (static_cast<int64_t>(id) >= spec_.vocab_size)
        throw Error(cat(what, " = ", id, " is outside the model's vocabulary (model.vocab_size = ", spec_.vocab_size,
                        ")"));
    return;
  }
  const TokenShard* first = nullptr;
  for (const Stream* s : {&train_, &val_})
    for (const TokenShard& sh : s->shards) {
      if (!sh.has_markers()) {
        starts_unavailable_ = cat("token shard '", sh.path(), "' records no document markers (BOS and EOS ids; it was "
                                  "written before loom prepare recorded them, or by another tool): re-run loom prepare "
                                  "text, or give the ids as data.bos and data.eos");
        return;
      }
      if (!first) {
        first = &sh;
        markers_ = sh.markers();
      } else if (!(sh.markers() == markers_)) {
        starts_unavailable_ = cat("token shards '", first->path(), "' (BOS ", markers_.bos, ", EOS ", markers_.eos,
                                  ") and '", sh.path(), "' (BOS ", sh.markers().bos, ", EOS ", sh.markers().eos,
                                  ") record different document markers: they come from different tokenizers");
        return;
      }
    }
}

void TokensSource::read_window(const Stream& s, uint64_t w, int32_t* out, uint8_t* starts) const {
  const auto it = std::upper_bound(s.first_window.begin(), s.first_window.end(), w);
  const std::size_t k = static_cast<std::size_t>(it - s.first_window.begin()) - 1;
  const uint64_t S = static_cast<uint64_t>(spec_.seq_len);
  const uint64_t begin = (w - s.first_window[k]) * S;
  s.shards[k].copy(begin, S + 1, out, spec_.vocab_size);
  if (!starts) return;
  // The token before the window decides whether its first token follows an
  // EOS; a shard's first token has none before it (prepare cuts shards
  // anywhere: a shard may begin inside a document, which then begins no span
  // but the row's own).
  int32_t before = -1;
  if (begin > 0) s.shards[k].copy(begin - 1, 1, &before, spec_.vocab_size);
  const auto bos = static_cast<int32_t>(markers_.bos), eos = static_cast<int32_t>(markers_.eos);
  for (uint64_t p = 0; p <= S; ++p) {
    const int32_t prev = p == 0 ? before : out[p - 1];
    starts[p] = (out[p] == bos && bos != eos) || prev == eos ? 1 : 0;
  }
}

void TokensSource::next(Split split, int32_t* tokens) { read(split, tokens, nullptr); }

void TokensSource::next_with_starts(Split split, int32_t* tokens, uint8_t* starts) {
  require_open("next_with_starts()");
  if (!starts_unavailable_.empty()) throw Error(cat("data plugin 'tokens': ", starts_unavailable_));
  read(split, tokens, starts);
}

void TokensSource::read(Split split, int32_t* tokens, uint8_t* starts) {
  require_open("next()");
  const uint64_t B = static_cast<uint64_t>(spec_.batch), row = static_cast<uint64_t>(spec_.seq_len) + 1;
  const uint64_t per_step = B * static_cast<uint64_t>(spec_.world);
  const uint64_t first = static_cast<uint64_t>(spec_.rank) * B;
  if (split == Split::validation) {
    if (!has_split(split))
      throw Error("data plugin 'tokens' has no validation split: set data.val to a shard path or glob "
                  "(loom prepare text writes val.bin)");
    for (uint64_t i = 0; i < B; ++i)
      read_window(val_, (val_cursor_ + first + i) % val_.windows, tokens + i * row, starts ? starts + i * row : nullptr);
    val_cursor_ += per_step;
    return;
  }
  const uint64_t W = train_.windows;
  const uint64_t epoch = cursor_ / W;
  if (epoch > logged_epoch_) {
    // A new pass over the same files: they must still be the files this run
    // opened (a shard rewritten in place would be read as new bytes unnoticed).
    verify_unchanged(train_);
    log_info(cat("tokens: epoch ", epoch, " begins after ", cursor_, " windows"));
    logged_epoch_ = epoch;
  }
  for (uint64_t i = 0; i < B; ++i) {
    const uint64_t g = cursor_ + first + i;
    const uint64_t e = g / W, pos = g % W;
    const uint64_t w = opt_.shuffle ? IndexPermutation(W, seed_, e)(pos) : pos;
    read_window(train_, w, tokens + i * row, starts ? starts + i * row : nullptr);
  }
  cursor_ += per_step;
}

void TokensSource::reset(Split split) {
  if (split == Split::train)
    throw Error("data plugin 'tokens': reset() restarts the validation split only; the train position "
                "is set through restore()");
  verify_unchanged(val_);  // each evaluation is a new pass over the validation files
  val_cursor_ = 0;
}

void TokensSource::verify_unchanged(const Stream& s) const {
  for (const TokenShard& shard : s.shards) shard.verify_unchanged();
}

std::string TokensSource::state() const {
  require_open("state()");
  // A checkpoint records a position in these files: they must be the ones opened.
  verify_unchanged(train_);
  nlohmann::json files = nlohmann::json::array();
  for (auto& s : train_.shards) files.push_back({{"path", s.path()}, {"tokens", s.size()}});
  nlohmann::json j = {{"source", "tokens"},
                      {"version", 1},
                      {"cursor", cursor_},
                      {"epoch", cursor_ / train_.windows},
                      {"windows_per_epoch", train_.windows},
                      {"seed", seed_},
                      {"world", spec_.world},
                      {"batch", spec_.batch},
                      {"seq_len", spec_.seq_len},
                      {"shuffle", opt_.shuffle},
                      {"train_files", files}};
  return j.dump();
}

void TokensSource::restore(const std::string& state) {
  require_open("restore()");
  // Every field is read and checked before any is compared or taken: a
  // damaged field is told as that, and a refused state leaves the source as it was.
  const DataStateReader r(state, "tokens", 1);
  const ckpt::JsonFields& f = r.fields();
  struct File {
    std::string path;
    uint64_t tokens;
  };
  std::vector<File> files;
  const nlohmann::json& listed = r.array("train_files");
  for (std::size_t i = 0; i < listed.size(); ++i) {
    const std::string at = cat("train_files[", i, "]");
    files.push_back({f.string_at(listed[i], at, "path"), static_cast<uint64_t>(f.integer_at(listed[i], at, "tokens"))});
  }
  const int64_t seq_len = r.integer("seq_len", 1, kMaxDataDim);
  const bool shuffle = r.boolean("shuffle");
  const DataStateReader::Position at = r.position();
  const uint64_t cursor = at.cursor;
  const auto epoch = static_cast<uint64_t>(r.integer("epoch", 0, kMaxDataPosition));
  const auto windows = static_cast<uint64_t>(r.integer("windows_per_epoch", 1, kMaxDataPosition));

  bool same = files.size() == train_.shards.size();
  for (std::size_t i = 0; same && i < files.size(); ++i) same = files[i].tokens == train_.shards[i].size();
  if (!same) {
    std::string was, now;
    for (const File& x : files) was += cat(" ", x.path, " (", x.tokens, ")");
    for (auto& sh : train_.shards) now += cat(" ", sh.path(), " (", sh.size(), ")");
    throw Error(cat("the data changed since the checkpoint: its train shards were", was, "; now they are", now,
                    "; point data.train at the original shards, or start afresh (checkpoint.resume = \"none\")"));
  }
  if (seq_len != spec_.seq_len)
    throw Error(cat("the checkpoint's data position counts windows of seq_len ", seq_len, " but train.seq_len is now ",
                    spec_.seq_len, "; resume with train.seq_len = ", seq_len,
                    ", or start afresh (checkpoint.resume = \"none\")"));
  // The same shards and seq_len make the same windows: the position must lie in them.
  if (windows != train_.windows)
    r.fail("windows_per_epoch", windows,
           cat(train_.windows, ": the windows of seq_len + 1 = ", spec_.seq_len + 1, " tokens its train shards hold"));
  if (epoch != cursor / windows) {
    const bool fits = epoch < static_cast<uint64_t>(kMaxDataPosition) / windows;  // its windows are printable
    r.damaged(cat("\"cursor\" is ", cursor, " and \"epoch\" is ", epoch, ", which disagree: at ", windows,
                  " windows an epoch, window ", cursor, " lies in epoch ", cursor / windows,
                  fits ? cat(", and epoch ", epoch, " holds windows [", epoch * windows, ", ", (epoch + 1) * windows, ")")
                       : std::string()));
  }
  if (shuffle != opt_.shuffle)
    log_warn(cat("tokens: the checkpoint was taken with shuffle = ", shuffle, ", the run now has shuffle = ", opt_.shuffle,
                 "; continuing from the same window count in the new order"));
  if (at.seed != seed_)
    log_info(cat("tokens: continuing the checkpoint's window order (seed ", at.seed, ", not the run's seed ", seed_, ")"));
  seed_ = at.seed;
  cursor_ = cursor;
  DataStateReader::note_reshard("tokens", at, spec_.world, spec_.batch, "window");
  logged_epoch_ = cursor_ / train_.windows;
  val_cursor_ = 0;
}

TokenScanReport TokensSource::scan_tokens() const {
  require_open("scan_tokens()");
  TokenScanReport r;
  for (const Stream* s : {&train_, &val_})
    for (const TokenShard& shard : s->shards) {
      r.tokens += shard.scan(spec_.vocab_size);
      ++r.files;
    }
  r.what = cat(train_.shards.size(), " train shard(s)",
               val_.shards.empty() ? std::string() : cat(", ", val_.shards.size(), " validation shard(s)"));
  return r;
}

int64_t TokensSource::vocab_hint() const {
  int64_t v = 0;
  for (const Stream* s : {&train_, &val_})
    for (auto& sh : s->shards) {
      if (sh.vocab() == 0) return 0;  // one unknown makes the whole unknown
      v = std::max<int64_t>(v, sh.vocab());
    }
  return v;
}

}  // namespace loom::data
