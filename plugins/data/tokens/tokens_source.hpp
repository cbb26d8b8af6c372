// The `tokens` data source: token shards (loom/token_shard.hpp) cut into
// training windows. Lives in libloom so that other shard-based sources can
// reuse it; plugins/data/tokens registers it and reads its TOML table.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loom/data.hpp"
#include "loom/token_shard.hpp"

namespace loom::data {

struct TokensOptions {
  std::vector<std::string> train;  // glob patterns (at least one); files sorted within a pattern
  std::vector<std::string> val;    // glob patterns; empty = no validation split
  bool shuffle = true;             // permute windows each epoch (seeded); false = file order
  // The ids that begin and end each document, for shards that record none
  // (data.bos, data.eos); unset = the shards' own.
  std::optional<DocumentMarkers> markers;
};

// Expands glob patterns into files: sorted within each pattern, patterns in
// the given order, a file matched twice kept once. A pattern that matches
// nothing is an error naming `key`, the pattern and the working directory.
std::vector<std::string> expand_patterns(const std::vector<std::string>& patterns, const std::string& key);

// Sampling (per split):
//   * the split's shards, in order, are cut into windows of seq_len + 1 tokens
//     with stride seq_len; a window never crosses a shard boundary (the last
//     tokens of a shard that do not fill a window are not used);
//   * train: epoch e is a permutation of all windows (a function of seed and
//     e with shuffle, the identity without); the stream is epoch 0, 1, ...;
//     global batch g takes stream positions [g*batch*world, (g+1)*batch*world)
//     and rank r the `batch` consecutive ones starting at (g*batch*world + r*batch);
//   * validation: the windows in order, the same rank layout, wrapping around.
// state() carries the global window cursor, so a restore under another world
// size or batch continues from the same number of windows consumed.
// Files changed under the run are refused: each shard's identity (size,
// inode, times) is compared with the opened file at every train epoch, every
// validation pass and every state() (checkpoint); a read that faults because a
// shard was truncated in place is an error naming the file.
// Tokens are checked against the model's vocabulary and the shard header's as
// windows are read; scan_tokens() (TokenScan, for `loom check`) reads them all.
// Document starts (DocumentStarts): a token begins a document when it is the
// BOS id, or when the token before it in its shard is the EOS id (with one id
// for both, only the latter); the ids are the ones every shard records
// (loom prepare writes them), or data.bos / data.eos.
class TokensSource : public DataSource, public TokenScan, public DocumentStarts {
 public:
  explicit TokensSource(TokensOptions opt);

  void open(const DataSpec& spec) override;
  bool has_split(Split split) const override;
  void next(Split split, int32_t* tokens) override;
  void reset(Split split) override;
  std::string state() const override;
  void restore(const std::string& state) override;
  int64_t vocab_hint() const override;
  TokenScanReport scan_tokens() const override;
  std::string starts_unavailable() const override { return starts_unavailable_; }
  void next_with_starts(Split split, int32_t* tokens, uint8_t* starts) override;

  // Windows of one epoch of the train split and of the validation split.
  uint64_t train_windows() const { return train_.windows; }
  uint64_t val_windows() const { return val_.windows; }
  // Global train windows consumed so far (all ranks).
  uint64_t cursor() const { return cursor_; }

 private:
  struct Stream {
    std::vector<TokenShard> shards;
    std::vector<uint64_t> first_window;  // per shard, plus the total at the end
    uint64_t windows = 0;
  };
  Stream open_stream(const std::vector<std::string>& patterns, const std::string& key) const;
  void read(Split split, int32_t* tokens, uint8_t* starts);
  // Window w of the stream into out (seq_len + 1 tokens) and, when not null,
  // its document starts.
  void read_window(const Stream& s, uint64_t w, int32_t* out, uint8_t* starts) const;
  // The markers every shard of both splits records, or why there are none.
  void find_markers();
  void require_open(const char* what) const;
  // Every shard of the stream is still the file opened (TokenShard::verify_unchanged).
  void verify_unchanged(const Stream& s) const;

  TokensOptions opt_;
  DataSpec spec_;
  bool opened_ = false;
  Stream train_, val_;
  uint64_t seed_ = 0;
  uint64_t cursor_ = 0;      // global train windows consumed
  uint64_t val_cursor_ = 0;  // global validation windows consumed since reset
  uint64_t logged_epoch_ = 0;
  DocumentMarkers markers_;
  std::string starts_unavailable_;  // "" when markers_ holds
};

}  // namespace loom::data
