#include "ops/tokenizers/bpe.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <queue>

#include "loom/error.hpp"

namespace loom::data {
namespace {

uint64_t hash_bytes64(const char* p, std::size_t n) {
  uint64_t h = 0x243f6a8885a308d3ull ^ (n * 0x9e3779b97f4a7c15ull);
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    h = (h ^ v) * 0x9e3779b97f4a7c15ull;
    h ^= h >> 29;
    p += 8;
    n -= 8;
  }
  if (n) {
    uint64_t v = 0;
    std::memcpy(&v, p, n);
    h = (h ^ v) * 0x9e3779b97f4a7c15ull;
  }
  h ^= h >> 32;
  h *= 0xd6e8feb86659fd93ull;
  return h ^ (h >> 32);
}

uint64_t hash_key(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdull;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ull;
  return k ^ (k >> 33);
}

uint64_t table_size(std::size_t n) {
  uint64_t s = 16;
  while (s < 2 * n) s <<= 1;
  return s;
}

std::atomic<uint64_t> g_serial{1};

std::size_t utf8_char_len(char lead) {
  const auto c = static_cast<unsigned char>(lead);
  return c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4;
}

// A direct-mapped per-thread cache of short words that are not one token:
// text repeats its words, and their merges are the expensive part.
struct WordCache {
  static constexpr std::size_t kSlots = 1 << 14, kMaxKey = 22, kMaxIds = 8;
  struct Entry {
    uint64_t hash = 0;
    uint8_t len = 0, n = 0;
    char key[kMaxKey];
    uint32_t ids[kMaxIds];
  };
  uint64_t owner = 0;
  std::vector<Entry> slots;
};
thread_local WordCache t_cache;

}  // namespace

void BytePairEncoder::add_token(std::string_view bytes, uint32_t id) {
  Slot s;
  s.offset = static_cast<uint32_t>(arena_.size());
  s.length = static_cast<uint32_t>(bytes.size());
  s.id = id;
  arena_.append(bytes);
  entries_.push_back(s);
}

void BytePairEncoder::add_merge(uint32_t left, uint32_t right, uint32_t rank, uint32_t merged) {
  pending_pairs_.push_back({(uint64_t{left} << 32) | right, Pair{rank, merged}});
}

void BytePairEncoder::finish_tokens(bool whole_word, const std::string& what, bool char_symbols) {
  whole_word_ = whole_word;
  char_symbols_ = char_symbols;
  serial_ = g_serial.fetch_add(1);
  const uint64_t size = table_size(entries_.size());
  slots_.assign(size, Slot{});
  mask_ = size - 1;
  count_ = 0;
  for (Slot s : entries_) {
    s.hash = hash_bytes64(arena_.data() + s.offset, s.length);
    uint64_t i = s.hash & mask_;
    bool dup = false;
    while (slots_[i].id != kNone) {
      const Slot& o = slots_[i];
      if (o.hash == s.hash && o.length == s.length &&
          std::memcmp(arena_.data() + o.offset, arena_.data() + s.offset, s.length) == 0) {
        dup = true;
        break;
      }
      i = (i + 1) & mask_;
    }
    if (dup)
      throw Error(cat(what, ": the token of ", s.length, " bytes with id ", s.id,
                      " appears twice in the vocabulary; the file is damaged"));
    slots_[i] = s;
    ++count_;
  }
  entries_.clear();
  entries_.shrink_to_fit();
  for (int c = 0; c < 256; ++c) {
    const char b = static_cast<char>(c);
    byte_ids_[c] = find(std::string_view(&b, 1));
    if (byte_ids_[c] == kNone && !char_symbols_)
      throw Error(cat(what, ": no token for the byte 0x", "0123456789abcdef"[c >> 4], "0123456789abcdef"[c & 15],
                      "; a byte-level BPE vocabulary must hold all 256 bytes"));
  }
}

void BytePairEncoder::finish_pairs() {
  const uint64_t psize = table_size(pending_pairs_.size());
  pairs_.assign(psize, PairSlot{});
  pair_mask_ = psize - 1;
  for (auto& [key, value] : pending_pairs_) {
    uint64_t i = hash_key(key) & pair_mask_;
    while (pairs_[i].key != ~uint64_t{0} && pairs_[i].key != key) i = (i + 1) & pair_mask_;
    // A pair listed twice keeps its first (lowest) rank, as HF's merge map does.
    if (pairs_[i].key == key) continue;
    pairs_[i].key = key;
    pairs_[i].value = value;
  }
  pending_pairs_.clear();
  pending_pairs_.shrink_to_fit();
}

uint32_t BytePairEncoder::find(std::string_view bytes) const {
  const uint64_t h = hash_bytes64(bytes.data(), bytes.size());
  for (uint64_t i = h & mask_;; i = (i + 1) & mask_) {
    const Slot& s = slots_[i];
    if (s.id == kNone) return kNone;
    if (s.hash == h && s.length == bytes.size() && std::memcmp(arena_.data() + s.offset, bytes.data(), s.length) == 0)
      return s.id;
  }
}

BytePairEncoder::Pair BytePairEncoder::pair(uint32_t left, uint32_t right) const {
  const uint64_t key = (uint64_t{left} << 32) | right;
  for (uint64_t i = hash_key(key) & pair_mask_;; i = (i + 1) & pair_mask_) {
    const PairSlot& s = pairs_[i];
    if (s.key == key) return s.value;
    if (s.key == ~uint64_t{0}) return {};
  }
}

void BytePairEncoder::encode_word(std::string_view word, std::vector<uint32_t>& out) const {
  if (word.empty()) return;
  if (word.size() == 1) {
    out.push_back(byte_ids_[static_cast<unsigned char>(word[0])]);
    return;
  }
  if (char_symbols_ && word.size() <= 4 && utf8_char_len(word[0]) == word.size()) {
    out.push_back(find(word));  // one character
    return;
  }
  if (whole_word_) {
    const uint32_t id = find(word);
    if (id != kNone) {
      out.push_back(id);
      return;
    }
  }
  if (word.size() > WordCache::kMaxKey) {
    if (word.size() <= 64) merge_small(word, out);
    else merge_heap(word, out);
    return;
  }
  WordCache& c = t_cache;
  if (c.owner != serial_) {
    c.slots.assign(WordCache::kSlots, WordCache::Entry{});
    c.owner = serial_;
  }
  const uint64_t h = hash_bytes64(word.data(), word.size());
  WordCache::Entry& e = c.slots[h & (WordCache::kSlots - 1)];
  if (e.n > 0 && e.hash == h && e.len == word.size() && std::memcmp(e.key, word.data(), word.size()) == 0) {
    out.insert(out.end(), e.ids, e.ids + e.n);
    return;
  }
  const std::size_t before = out.size();
  merge_small(word, out);
  const std::size_t n = out.size() - before;
  if (n <= WordCache::kMaxIds) {
    e.hash = h;
    e.len = static_cast<uint8_t>(word.size());
    e.n = static_cast<uint8_t>(n);
    std::memcpy(e.key, word.data(), word.size());
    std::copy(out.begin() + static_cast<std::ptrdiff_t>(before), out.end(), e.ids);
  }
}

// Words of up to 64 bytes: arrays on the stack, the lowest-ranked pair found
// by a scan (what tiktoken does; short words make the scan cheaper than a heap).
std::size_t BytePairEncoder::symbols(std::string_view word, uint32_t* ids, std::size_t cap) const {
  std::size_t m = 0;
  if (!char_symbols_) {
    for (std::size_t i = 0; i < word.size() && m < cap; ++i) ids[m++] = byte_ids_[static_cast<unsigned char>(word[i])];
    return m;
  }
  for (std::size_t i = 0; i < word.size() && m < cap;) {
    const std::size_t n = std::min<std::size_t>(utf8_char_len(word[i]), word.size() - i);
    ids[m++] = find(word.substr(i, n));
    i += n;
  }
  return m;
}

void BytePairEncoder::merge_small(std::string_view word, std::vector<uint32_t>& out) const {
  uint32_t ids[64], ranks[64];
  std::size_t m = symbols(word, ids, 64);
  Pair p[64];
  for (std::size_t i = 0; i + 1 < m; ++i) {
    p[i] = pair(ids[i], ids[i + 1]);
    ranks[i] = p[i].rank;
  }
  while (m > 1) {
    std::size_t best = 0;
    uint32_t best_rank = kNone;
    for (std::size_t i = 0; i + 1 < m; ++i)
      if (ranks[i] < best_rank) {
        best_rank = ranks[i];
        best = i;
      }
    if (best_rank == kNone) break;
    ids[best] = p[best].merged;
    for (std::size_t i = best + 1; i + 1 < m; ++i) {
      ids[i] = ids[i + 1];
      p[i] = p[i + 1];
      ranks[i] = ranks[i + 1];
    }
    --m;
    if (best + 1 < m) {
      p[best] = pair(ids[best], ids[best + 1]);
      ranks[best] = p[best].rank;
    }
    if (best > 0) {
      p[best - 1] = pair(ids[best - 1], ids[best]);
      ranks[best - 1] = p[best - 1].rank;
    }
  }
  out.insert(out.end(), ids, ids + m);
}

// Long words (a run of letters in base64 or minified code): a linked list of
// symbols and a heap of candidate pairs ordered by (rank, position), so a
// word of n bytes costs O(n log n) instead of the scan's O(n^2).
void BytePairEncoder::merge_heap(std::string_view word, std::vector<uint32_t>& out) const {
  std::vector<uint32_t> ids(word.size());
  const std::size_t n = symbols(word, ids.data(), ids.size());
  ids.resize(n);
  std::vector<int64_t> prev(n), next(n);
  for (std::size_t i = 0; i < n; ++i) {
    prev[i] = static_cast<int64_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int64_t>(i + 1) : -1;
  }
  struct Cand {
    uint32_t rank;
    uint32_t pos;
    uint32_t left, right;  // the ids the pair had when queued: a stale entry no longer matches
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> q;
  auto push = [&](int64_t i) {
    if (i < 0 || next[static_cast<std::size_t>(i)] < 0) return;
    const auto a = static_cast<std::size_t>(i), b = static_cast<std::size_t>(next[a]);
    const Pair p = pair(ids[a], ids[b]);
    if (p.merged != kNone) q.push({p.rank, static_cast<uint32_t>(a), ids[a], ids[b]});
  };
  for (std::size_t i = 0; i + 1 < n; ++i) push(static_cast<int64_t>(i));
  std::vector<bool> alive(n, true);
  while (!q.empty()) {
    const Cand c = q.top();
    q.pop();
    const std::size_t a = c.pos;
    if (!alive[a] || next[a] < 0) continue;
    const auto b = static_cast<std::size_t>(next[a]);
    if (ids[a] != c.left || ids[b] != c.right) continue;
    ids[a] = pair(c.left, c.right).merged;
    alive[b] = false;
    next[a] = next[b];
    if (next[b] >= 0) prev[static_cast<std::size_t>(next[b])] = static_cast<int64_t>(a);
    push(prev[a]);
    push(static_cast<int64_t>(a));
  }
  for (int64_t i = 0; i >= 0; i = next[static_cast<std::size_t>(i)]) out.push_back(ids[static_cast<std::size_t>(i)]);
}

// ---------------------------------------------------------------------------
// The regex pre-tokenizer.
// ---------------------------------------------------------------------------

namespace {
// Unicode White_Space, the set `\s` means in the regex engines whose results
// we must reproduce; PCRE2's \s (even with UCP) adds U+180E and friends.
constexpr const char* kWhiteSpace =
    "\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";
}  // namespace

std::string rewrite_whitespace_classes(const std::string& pattern, const std::string& what) {
  std::string out;
  bool in_class = false;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char d = pattern[i + 1];
      ++i;
      if (d == 's') {
        out += in_class ? std::string(kWhiteSpace) : cat("[", kWhiteSpace, "]");
      } else if (d == 'S') {
        if (in_class)
          throw Error(cat(what, ": the pre-tokenizer pattern uses \\S inside a character class, which loom "
                                "cannot rewrite to Unicode White_Space; pattern: ", pattern));
        out += cat("[^", kWhiteSpace, "]");
      } else {
        out += c;
        out += d;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

struct RegexSplitter::Impl {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Impl() {
    if (code) pcre2_code_free(code);
  }
};

namespace {
// Per thread: match data and a JIT stack large enough for lookaheads over
// long whitespace runs (the default 32 KiB is not).
struct MatchState {
  const void* owner = nullptr;
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mc = nullptr;
  pcre2_jit_stack* stack = nullptr;
  ~MatchState() { reset(); }
  void reset() {
    if (md) pcre2_match_data_free(md);
    if (mc) pcre2_match_context_free(mc);
    if (stack) pcre2_jit_stack_free(stack);
    md = nullptr;
    mc = nullptr;
    stack = nullptr;
    owner = nullptr;
  }
};
thread_local MatchState t_match;
}  // namespace

RegexSplitter::RegexSplitter(const std::string& pattern, bool keep_gaps, const std::string& what)
    : impl_(std::make_unique<Impl>()), pattern_(rewrite_whitespace_classes(pattern, what)), what_(what),
      keep_gaps_(keep_gaps) {
  int err = 0;
  PCRE2_SIZE off = 0;
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern_.data()), pattern_.size(),
                              PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
  if (!impl_->code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw Error(cat(what, ": PCRE2 cannot compile the pre-tokenizer pattern (", reinterpret_cast<const char*>(msg),
                    " at offset ", off, "): ", pattern));
  }
  // The JIT is several times faster; without it (an unsupported CPU) the
  // interpreter gives the same matches.
  impl_->jit = pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE) == 0;
}

RegexSplitter::~RegexSplitter() {
  if (t_match.owner == impl_.get()) t_match.reset();
}

std::size_t RegexSplitter::utf8_len(std::string_view text, std::size_t at) {
  const auto c = static_cast<unsigned char>(text[at]);
  const std::size_t n = c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4;
  return std::min(n, text.size() - at);
}

bool RegexSplitter::next(std::string_view text, std::size_t from, std::size_t& b, std::size_t& e) const {
  MatchState& st = t_match;
  if (st.owner != impl_.get()) {
    st.reset();
    st.md = pcre2_match_data_create_from_pattern(impl_->code, nullptr);
    st.mc = pcre2_match_context_create(nullptr);
    if (!st.md || !st.mc) throw Error(cat(what_, ": out of memory creating PCRE2 match data for its pre-tokenizer"));
    if (impl_->jit) {
      st.stack = pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, nullptr);
      if (!st.stack) throw Error(cat(what_, ": out of memory creating a PCRE2 JIT stack for its pre-tokenizer"));
      pcre2_jit_stack_assign(st.mc, nullptr, st.stack);
    }
    st.owner = impl_.get();
  }
  // The text is valid UTF-8 (sanitize_utf8), so PCRE2 need not check it again
  // on every call (which would make splitting quadratic).
  const int rc = pcre2_match(impl_->code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), from,
                             PCRE2_NO_UTF_CHECK, st.md, st.mc);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    const std::string reason = reinterpret_cast<const char*>(msg);
    // Named with the tokenizer file here; the caller that knows the document
    // (Tokenizer::encode_document) turns `at` into its byte, and the one that
    // knows the input file adds it.
    throw RegexGaveUp(cat(what_, ": its pre-tokenizer pattern gave up on the text at byte ", from, " of the piece it was ",
                          "given (PCRE2: ", reason, ")"),
                      what_, pattern_, reason, text.data() + from);
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.md);
  b = ov[0];
  e = ov[1];
  return true;
}

}  // namespace loom::data
