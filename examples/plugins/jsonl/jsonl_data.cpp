// "jsonl": a data source of text documents in JSON Lines files, tokenized as
// they are read with the SDK's tokenizers (loom/ops/tokenizer.hpp): one JSON
// object per line, its "text" field one document. Nothing is prepared ahead:
// point it at the .jsonl files and train.
//
// [data]
// plugin    = "jsonl"
// train     = ["corpus/part-0.jsonl", "corpus/part-1.jsonl"]   # or one path; required
// val       = "corpus/val.jsonl"                               # optional: a validation split
// tokenizer = "bytes"            # or a tokenizer file: tokenizer.json, tiktoken, SentencePiece
// field     = "text"             # the key that holds each document's text
//
// The stream: the documents of the split's files in order, each BOS + the
// ids of its text + EOS (what `loom prepare` writes), one epoch after
// another. Global window w is tokens [w * seq_len, w * seq_len + seq_len + 1)
// of that stream (inputs and targets share all but one token, as the
// `tokens` plugin's windows); global batch g holds windows [g*batch*world,
// (g+1)*batch*world) and rank r its `batch` consecutive ones, so ranks never
// share a window and a resume under another world size continues from the
// same count. Validation: the val files' stream from its beginning, laid out
// over ranks the same way (a second pass follows the first if validation asks
// for more); reset() goes back to the beginning.
//
// Resume: state() records the window count and where in the files its first
// token lies (file, byte offset and number of its line, tokens to skip in
// that document, epoch), so restore() seeks there instead of re-reading the
// corpus. The files must not change between the two (their sizes are kept
// and compared).
//
// Document starts: the source implements loom::DocumentStarts (each BOS
// begins a document), so the run's train.reset_attention_mask,
// reset_position_ids and eod_mask_loss see its documents.
//
// A line that is not a JSON object with a string "text" is refused, naming
// the file and the line; blank lines are passed over.
#include <algorithm>
#include <cstdint>
#include <deque>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <loom/data.hpp>
#include <loom/error.hpp>
#include <loom/log.hpp>
#include <loom/ops/tokenizer.hpp>
#include <loom/plugin.hpp>

namespace {

using loom::cat;
using loom::Error;

std::vector<std::string> paths(const loom::ConfigTable& cfg, std::string_view key) {
  std::vector<std::string> v;
  try {
    v = cfg.get_string_list(key);
  } catch (const Error&) {
    v = {cfg.get_string(key, "")};
  }
  for (const std::string& p : v)
    if (p.empty()) cfg.fail(key, cat("data.", key, " holds an empty path: name a .jsonl file"));
  return v;
}

// Where a token of the stream comes from: enough to read on from there.
struct Position {
  uint64_t epoch = 0, file = 0, offset = 0, line = 0;  // the line's byte offset and 1-based number
};

// The endless token stream of one split's files. Tokens are indexed from the
// start of epoch 0; the reader keeps those from the oldest still asked for.
class Stream {
 public:
  Stream(std::vector<std::string> files, std::vector<uint64_t> bytes, const loom::data::Tokenizer& tok,
         std::string field, int64_t vocab)
      : files_(std::move(files)), bytes_(std::move(bytes)), tok_(tok), field_(std::move(field)), vocab_(vocab) {}

  const std::vector<std::string>& files() const { return files_; }
  const std::vector<uint64_t>& bytes() const { return bytes_; }

  // Copies tokens [first, first + n) into out, and (when starts is not null)
  // 1 where a document begins, 0 elsewhere. Requests never go back before
  // the first token of an earlier request's line (the caller asks in order).
  void copy(uint64_t first, uint64_t n, int32_t* out, uint8_t* starts) {
    fill_to(first + n);
    if (first < base_)
      throw Error(cat("jsonl: token ", first, " was asked for after token ", base_, "; windows are read in order"));
    for (uint64_t i = 0; i < n; ++i) {
      out[i] = tokens_[first - base_ + i];
      if (starts) starts[i] = starts_[first - base_ + i];
    }
    drop_before(first);
  }

  // The position of the line holding token t, and how many of its tokens
  // come before t. Reads up to t if needed.
  std::pair<Position, uint64_t> locate(uint64_t t) {
    fill_to(t + 1);
    auto it = std::upper_bound(lines_.begin(), lines_.end(), t,
                               [](uint64_t v, const Line& l) { return v < l.first_token; });
    const Line& l = *(it - 1);
    return {l.at, t - l.first_token};
  }

  // Continue from the line at `at`, whose first token is stream token `first_token`.
  void seek(const Position& at, uint64_t first_token) {
    tokens_.clear();
    starts_.clear();
    lines_.clear();
    base_ = end_ = pass_start_ = first_token;
    next_ = at;
    whole_pass_ = at.file == 0 && at.offset == 0;
    in_.reset();
  }

  // Reads the first window (seq_len + 1 tokens, from as many passes over the
  // files as that takes): an empty split, a missing file or a bad first line
  // is refused at open. Leaves the reader at the start.
  void probe(uint64_t window) {
    std::vector<int32_t> scratch(window);
    copy(0, window, scratch.data(), nullptr);
    seek({}, 0);
  }

 private:
  struct Line {
    uint64_t first_token;
    Position at;
  };

  void fill_to(uint64_t end) {
    while (end_ < end) read_line();
  }

  void drop_before(uint64_t first) {
    // Keep the line holding `first`: locate() may be asked about it.
    while (lines_.size() > 1 && lines_[1].first_token <= first) lines_.pop_front();
    const uint64_t keep = lines_.front().first_token;
    if (keep > base_ && keep - base_ > tokens_.size() / 2) {
      tokens_.erase(tokens_.begin(), tokens_.begin() + static_cast<std::ptrdiff_t>(keep - base_));
      starts_.erase(starts_.begin(), starts_.begin() + static_cast<std::ptrdiff_t>(keep - base_));
      base_ = keep;
    }
  }

  // Reads the next non-blank line (wrapping to the next epoch after the last
  // file) and appends its document's tokens.
  void read_line() {
    for (;;) {
      if (!in_) open_at(next_);
      std::string text;
      const uint64_t offset = next_.offset;
      if (!std::getline(*in_, text)) {
        in_.reset();
        next_.offset = 0;
        next_.line = 0;
        if (++next_.file == files_.size()) {
          // A whole pass from the first file's start found nothing: there is nothing to read, ever.
          if (whole_pass_ && end_ == pass_start_)
            throw Error(cat("jsonl: the files of this split hold no document (", files_.front(),
                            files_.size() > 1 ? ", ..." : "", "); give files with at least one line {\"", field_,
                            "\": \"...\"}"));
          next_.file = 0;
          ++next_.epoch;
          whole_pass_ = true;
          pass_start_ = end_;
        }
        continue;
      }
      ++next_.line;
      next_.offset = offset + text.size() + (in_->eof() ? 0 : 1);
      if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
      Position at = next_;
      at.offset = offset;
      append(parse(text, at.line), at);
      return;
    }
  }

  void open_at(const Position& p) {
    in_ = std::make_unique<std::ifstream>(files_[p.file], std::ios::binary);
    if (!*in_) throw Error(cat("jsonl: cannot open '", files_[p.file], "' (it was readable at open)"));
    in_->seekg(static_cast<std::streamoff>(p.offset));
    if (!*in_) throw Error(cat("jsonl: cannot seek to byte ", p.offset, " of '", files_[p.file], "'"));
  }

  std::string parse(const std::string& text, uint64_t line) const {
    const std::string where = cat(files_[next_.file], ":", line);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw Error(cat(where, ": not valid JSON (", e.what(), "); each line must be one JSON object like {\"", field_,
                      "\": \"...\"}"));
    }
    if (!j.is_object())
      throw Error(cat(where, ": a JSON ", j.type_name(), ", not an object; each line must be one JSON object like {\"",
                      field_, "\": \"...\"}"));
    const auto it = j.find(field_);
    if (it == j.end())
      throw Error(cat(where, ": the object has no \"", field_, "\" (data.field); each line must hold the document's "
                      "text under that key"));
    if (!it->is_string())
      throw Error(cat(where, ": \"", field_, "\" is a JSON ", it->type_name(), ", not a string"));
    return it->get<std::string>();
  }

  void append(const std::string& text, const Position& at) {
    ids_.clear();
    tok_.encode_document(text, ids_);
    lines_.push_back({end_, at});
    for (std::size_t i = 0; i < ids_.size(); ++i) {
      if (static_cast<int64_t>(ids_[i]) >= vocab_)
        throw Error(cat(files_[at.file], ":", at.line, ": the tokenizer gave id ", ids_[i], ", outside the model's "
                        "vocabulary of ", vocab_, " (model.vocab_size)"));
      tokens_.push_back(static_cast<int32_t>(ids_[i]));
      starts_.push_back(i == 0 ? 1 : 0);  // BOS begins the document
    }
    end_ += ids_.size();
  }

  std::vector<std::string> files_;
  std::vector<uint64_t> bytes_;
  const loom::data::Tokenizer& tok_;
  std::string field_;
  int64_t vocab_;
  std::unique_ptr<std::ifstream> in_;
  Position next_;              // where the next line is read
  bool whole_pass_ = true;     // this pass over the files began at the first file's start
  uint64_t pass_start_ = 0;    // the stream token that pass began at
  uint64_t base_ = 0, end_ = 0;  // tokens_ holds stream tokens [base_, end_)
  std::vector<int32_t> tokens_;
  std::vector<uint8_t> starts_;
  std::deque<Line> lines_;     // the lines whose tokens are in tokens_ (the first may begin before base_)
  std::vector<uint32_t> ids_;
};

class JsonlData final : public loom::DataSource, public loom::DocumentStarts {
 public:
  explicit JsonlData(const loom::PluginInit& init) : seed_(init.seed) {
    const loom::ConfigTable& cfg = init.config;
    if (!cfg.has("train"))
      cfg.fail("train", "data.train is required: the .jsonl file(s) to train on, e.g. train = \"corpus.jsonl\"");
    train_files_ = paths(cfg, "train");
    if (cfg.has("val")) val_files_ = paths(cfg, "val");
    tokenizer_path_ = cfg.get_string("tokenizer", "bytes");
    field_ = cfg.get_string("field", "text");
    if (field_.empty()) cfg.fail("field", "data.field is empty: name the key that holds each line's text");
    cfg.finish();
    // Loaded here so that a bad tokenizer file is refused with the config, before any work.
    tok_ = loom::data::load_tokenizer(tokenizer_path_);
  }

  void open(const loom::DataSpec& spec) override {
    if (spec.batch < 1 || spec.seq_len < 1 || spec.world < 1 || spec.rank < 0 || spec.rank >= spec.world)
      throw Error(cat("jsonl: invalid spec (batch ", spec.batch, ", seq_len ", spec.seq_len, ", rank ", spec.rank,
                      " of ", spec.world, ")"));
    if (static_cast<int64_t>(tok_->vocab_size()) > spec.vocab_size)
      throw Error(cat("jsonl: the tokenizer '", tokenizer_path_, "' has ", tok_->vocab_size(),
                      " ids but model.vocab_size = ", spec.vocab_size, "; raise model.vocab_size to at least ",
                      tok_->vocab_size()));
    spec_ = spec;
    train_ = make_stream(train_files_, "train");
    train_->probe(static_cast<uint64_t>(spec.seq_len) + 1);
    if (!val_files_.empty()) {
      val_ = make_stream(val_files_, "val");
      val_->probe(static_cast<uint64_t>(spec.seq_len) + 1);
    }
    cursor_ = val_cursor_ = 0;
    opened_ = true;
    loom::log_info(cat("jsonl: ", train_files_.size(), " train file(s)", val_ ? cat(", ", val_files_.size(),
                       " validation file(s)") : std::string(), ", tokenizer ", tok_->kind(), " (", tok_->vocab_size(),
                       " ids)"));
  }

  bool has_split(loom::Split split) const override { return split == loom::Split::train || val_ != nullptr; }

  void next(loom::Split split, int32_t* tokens) override { read(split, tokens, nullptr); }

  // DocumentStarts: the same windows with the documents' starts.
  void next_with_starts(loom::Split split, int32_t* tokens, uint8_t* starts) override {
    read(split, tokens, starts);
  }

  void reset(loom::Split split) override {
    if (split == loom::Split::train)
      throw Error("jsonl: reset() restarts the validation split only; the train position is set through restore()");
    if (val_) val_->seek({}, 0);
    val_cursor_ = 0;
  }

  int64_t vocab_hint() const override { return tok_->vocab_size(); }

  std::string state() const override {
    if (!opened_) throw Error("jsonl: state() called before open()");
    // Where the next global window begins: the same on every rank.
    const auto [at, skip] = train_->locate(cursor_ * static_cast<uint64_t>(spec_.seq_len));
    nlohmann::json files = nlohmann::json::array();
    for (std::size_t i = 0; i < train_files_.size(); ++i)
      files.push_back({{"path", train_files_[i]}, {"bytes", train_->bytes()[i]}});
    return nlohmann::json{{"source", "jsonl"},       {"version", 1},        {"cursor", cursor_},
                          {"seq_len", spec_.seq_len}, {"files", files},      {"epoch", at.epoch},
                          {"file", at.file},          {"offset", at.offset}, {"line", at.line},
                          {"skip", skip}}
        .dump();
  }

  void restore(const std::string& state) override {
    if (!opened_) throw Error("jsonl: restore() called before open()");
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(state);
    } catch (const nlohmann::json::exception&) {
      throw Error(cat("jsonl: the state '", state.substr(0, 60), "' is not JSON"));
    }
    auto count = [&](const char* key) -> uint64_t {
      const auto it = j.find(key);
      if (it == j.end() || !it->is_number_unsigned())
        throw Error(cat("jsonl: the state's \"", key, "\" is ", it == j.end() ? "missing" : it->dump(),
                        ", expected an integer >= 0"));
      return it->get<uint64_t>();
    };
    if (j.value("source", "") != "jsonl" || count("version") != 1)
      throw Error("jsonl: the state was not written by this plugin (version 1)");
    const uint64_t seq_len = count("seq_len"), cursor = count("cursor");
    if (seq_len != static_cast<uint64_t>(spec_.seq_len))
      throw Error(cat("jsonl: the checkpoint counts windows of seq_len ", seq_len, " but train.seq_len is now ",
                      spec_.seq_len, "; resume with train.seq_len = ", seq_len));
    const auto& files = j.at("files");
    bool same = files.is_array() && files.size() == train_files_.size();
    for (std::size_t i = 0; same && i < train_files_.size(); ++i)
      same = files[i].value("path", "") == train_files_[i] && files[i].value("bytes", uint64_t{0}) == train_->bytes()[i];
    if (!same)
      throw Error(cat("jsonl: the train files changed since the checkpoint (it lists ", files.dump(),
                      "); point data.train at the original files, or start afresh (checkpoint.resume = \"none\")"));
    Position at{count("epoch"), count("file"), count("offset"), count("line")};
    const uint64_t skip = count("skip"), first = cursor * seq_len;
    if (at.file >= train_files_.size() || at.offset > train_->bytes()[at.file] || skip > first)
      throw Error(cat("jsonl: the state's position (file ", at.file, ", byte ", at.offset, ", skip ", skip,
                      ") lies outside the train files"));
    at.line -= at.line > 0 ? 1 : 0;  // seek() reads the line at `offset` next, as line number line
    train_->seek(at, first - skip);
    cursor_ = cursor;
    val_cursor_ = 0;
  }

 private:
  std::unique_ptr<Stream> make_stream(const std::vector<std::string>& files, const char* key) const {
    std::vector<uint64_t> bytes;
    for (const std::string& f : files) {
      std::ifstream in(f, std::ios::binary | std::ios::ate);
      if (!in)
        throw Error(cat("jsonl: data.", key, " names '", f, "', which cannot be opened (relative paths are taken "
                        "from the working directory)"));
      bytes.push_back(static_cast<uint64_t>(in.tellg()));
    }
    return std::make_unique<Stream>(files, std::move(bytes), *tok_, field_, spec_.vocab_size);
  }

  void read(loom::Split split, int32_t* tokens, uint8_t* starts) {
    if (!opened_) throw Error("jsonl: next() called before open()");
    const bool train = split == loom::Split::train;
    if (!train && !val_) throw Error("jsonl has no validation split: set data.val to a .jsonl file");
    Stream& s = train ? *train_ : *val_;
    uint64_t& cursor = train ? cursor_ : val_cursor_;
    const uint64_t B = static_cast<uint64_t>(spec_.batch), S = static_cast<uint64_t>(spec_.seq_len);
    const uint64_t first = cursor + static_cast<uint64_t>(spec_.rank) * B;
    for (uint64_t i = 0; i < B; ++i)
      s.copy((first + i) * S, S + 1, tokens + i * (S + 1), starts ? starts + i * (S + 1) : nullptr);
    cursor += B * static_cast<uint64_t>(spec_.world);
  }

  uint64_t seed_;
  std::vector<std::string> train_files_, val_files_;
  std::string tokenizer_path_, field_;
  std::unique_ptr<loom::data::Tokenizer> tok_;
  loom::DataSpec spec_;
  bool opened_ = false;
  std::unique_ptr<Stream> train_, val_;
  uint64_t cursor_ = 0, val_cursor_ = 0;
};

}  // namespace

LOOM_PLUGIN(data, JsonlData, "jsonl", "1.0.0",
            "JSON Lines text ({\"text\": ...} per line), tokenized on the fly with the SDK's tokenizers")
