// The byte-level BPE shared by the tiktoken and HF tokenizer.json loaders:
// tokens are byte strings, a word (one pre-tokenized piece) starts as its
// bytes and the adjacent pair of lowest rank is merged until no pair has one
// (ties: the leftmost). tiktoken ranks a pair by the rank of the merged token,
// HF by the merge's line in `merges`; both become one table
// (left id, right id) -> (rank, merged id), so one loop serves both.
//
// Also here: the regex pre-tokenizer (PCRE2, JIT-compiled) that cuts text
// into words.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "loom/error.hpp"

namespace loom::data {

class BytePairEncoder {
 public:
  static constexpr uint32_t kNone = 0xffffffffu;

  // Build: every token (raw bytes, id), finish_tokens(), the merges (which
  // may use find()), finish_pairs().
  void add_token(std::string_view bytes, uint32_t id);
  // `whole_word`: a word that is itself a token is emitted as that token
  // without merging (tiktoken always; HF when its model says ignore_merges).
  // `char_symbols`: a word starts as its UTF-8 characters, every one of which
  // the caller guarantees is a token (SentencePiece); otherwise as its bytes,
  // and finish_tokens throws (with `what` naming the file) when a byte has no token.
  void finish_tokens(bool whole_word, const std::string& what, bool char_symbols = false);
  void add_merge(uint32_t left, uint32_t right, uint32_t rank, uint32_t merged);
  void finish_pairs();

  uint32_t find(std::string_view bytes) const;  // kNone if absent
  bool has_pair(uint32_t left, uint32_t right) const { return pair(left, right).merged != kNone; }
  uint32_t byte_token(unsigned char c) const { return byte_ids_[c]; }
  std::size_t size() const { return count_; }

  // Appends the ids of one word. Thread-safe (a small per-thread cache).
  void encode_word(std::string_view word, std::vector<uint32_t>& out) const;

 private:
  struct Pair {
    uint32_t rank = kNone, merged = kNone;
  };
  Pair pair(uint32_t left, uint32_t right) const;
  // The word's initial symbols (bytes, or characters in char mode) into ids[0, cap); returns their count.
  std::size_t symbols(std::string_view word, uint32_t* ids, std::size_t cap) const;
  void merge_small(std::string_view word, std::vector<uint32_t>& out) const;
  void merge_heap(std::string_view word, std::vector<uint32_t>& out) const;

  // Tokens: open addressing over (hash, offset, length, id); bytes in one arena.
  struct Slot {
    uint64_t hash = 0;
    uint32_t offset = 0, length = 0, id = kNone;
  };
  std::string arena_;
  std::vector<Slot> entries_;  // added, not yet hashed (finish() builds slots_)
  std::vector<Slot> slots_;
  uint64_t mask_ = 0;
  std::size_t count_ = 0;
  // Pairs: open addressing on the key (left << 32 | right).
  struct PairSlot {
    uint64_t key = ~uint64_t{0};
    Pair value;
  };
  std::vector<PairSlot> pairs_;
  std::vector<std::pair<uint64_t, Pair>> pending_pairs_;
  uint64_t pair_mask_ = 0;
  uint32_t byte_ids_[256] = {};
  bool whole_word_ = true;
  bool char_symbols_ = false;
  uint64_t serial_ = 0;  // tells this encoder's per-thread cache from another's
};

// What RegexSplitter throws when PCRE2 gives up on a text (its match, depth
// or heap limit, or the JIT stack): the tokenizer file, the pattern, PCRE2's
// reason and where in the text, as a pointer, so that a caller that split a
// document into pieces can say which byte of the document it was
// (Tokenizer::encode_document does: TokenizeInputError).
struct RegexGaveUp : Error {
  RegexGaveUp(const std::string& message, std::string tokenizer, std::string pattern, std::string reason, const char* at)
      : Error(message), tokenizer(std::move(tokenizer)), pattern(std::move(pattern)), reason(std::move(reason)), at(at) {}
  std::string tokenizer, pattern, reason;
  const char* at;
};

// Cuts text into words with a regex: every match is a word; what lies between
// matches is dropped (tiktoken) or kept as words of its own (HF's "Isolated"
// split). `\s` and `\S` in the pattern mean Unicode White_Space, as in the
// Rust regex crate (tiktoken) and Oniguruma (HF); PCRE2's own \s differs.
class RegexSplitter {
 public:
  RegexSplitter(const std::string& pattern, bool keep_gaps, const std::string& what);
  ~RegexSplitter();
  RegexSplitter(const RegexSplitter&) = delete;
  RegexSplitter& operator=(const RegexSplitter&) = delete;
  // Calls fn(word) for each word of `text` (valid UTF-8), in order.
  // An empty match makes no word but still cuts: the text before it is a
  // gap of its own (as the tokenizers library's Isolated split does), and
  // the search moves on one character while that character stays in the
  // next gap -- never dropped.
  template <typename Fn>
  void split(std::string_view text, Fn&& fn) const {
    std::size_t pos = 0, gap = 0;  // search from pos; text from gap on is not yet handed out
    while (pos < text.size()) {
      std::size_t b, e;
      if (!next(text, pos, b, e)) break;
      if (keep_gaps_ && b > gap) fn(text.substr(gap, b - gap));
      if (e > b) fn(text.substr(b, e - b));
      gap = e;
      pos = e > b ? e : b + utf8_len(text, b);
    }
    if (keep_gaps_ && gap < text.size()) fn(text.substr(gap));
  }
  // The pattern as PCRE2 compiled it (after the \s rewrite), for messages.
  const std::string& compiled_pattern() const { return pattern_; }

 private:
  bool next(std::string_view text, std::size_t from, std::size_t& b, std::size_t& e) const;
  static std::size_t utf8_len(std::string_view text, std::size_t at);
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string pattern_;
  std::string what_;  // the tokenizer file, for messages
  bool keep_gaps_;
};

// `\s` / `\S` rewritten as explicit Unicode White_Space classes (exposed for tests).
std::string rewrite_whitespace_classes(const std::string& pattern, const std::string& what);

}  // namespace loom::data
