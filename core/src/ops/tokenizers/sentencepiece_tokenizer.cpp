// SentencePiece models (Llama 2, Mistral) through Debian's libsentencepiece.
// The library loads every model and is the reference. For the common case —
// a BPE model with the identity normaliser (Llama 2, Mistral, ...) — encoding
// runs on loom's BPE engine instead (bpe.hpp), which gives the library's ids
// (tests/test_tokenizers.cpp checks both paths against the Python package)
// several times faster: the library's 0.1.97 merges a whole document in one
// heap, where no merge can cross the start of a "▁"-word, so words can be
// merged one at a time and cached. Any other model (unigram, a normalisation
// rule, user-defined or unused pieces) is encoded by the library.
#include <sentencepiece_processor.h>

#include <cmath>
#include <cstring>
#include <map>

#include "ops/tokenizers/bpe.hpp"
#include "ops/tokenizers/formats.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"

namespace loom::data {
namespace {

constexpr const char* kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's escaped space

// The few fields of the ModelProto the BPE path needs, read from the
// protobuf wire format (the library exposes no ModelProto without protobuf headers).
struct SpModel {
  struct Piece {
    std::string text;
    float score = 0;
    int type = 1;  // NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6
  };
  std::vector<Piece> pieces;
  int model_type = 1;  // UNIGRAM 1, BPE 2, WORD 3, CHAR 4
  bool whitespace_suffix = false;
  std::string normalizer = "nmt_nfkc";
  bool charsmap = false, dummy_prefix = true, remove_extra_ws = true, escape_ws = true;
};

struct Wire {
  const unsigned char* p;
  const unsigned char* end;
  bool varint(uint64_t& v) {
    v = 0;
    for (int shift = 0; p < end && shift < 64; shift += 7) {
      const unsigned char b = *p++;
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  }
  // Calls fn(field, wire type, value, bytes) for each field; false on damage.
  template <typename Fn>
  bool fields(Fn&& fn) {
    while (p < end) {
      uint64_t key = 0, v = 0;
      if (!varint(key)) return false;
      const int field = static_cast<int>(key >> 3), type = static_cast<int>(key & 7);
      std::string_view bytes;
      if (type == 0) {
        if (!varint(v)) return false;
      } else if (type == 1 || type == 5) {
        const std::size_t n = type == 1 ? 8 : 4;
        if (static_cast<std::size_t>(end - p) < n) return false;
        std::memcpy(&v, p, n);
        p += n;
      } else if (type == 2) {
        if (!varint(v) || v > static_cast<uint64_t>(end - p)) return false;
        bytes = std::string_view(reinterpret_cast<const char*>(p), v);
        p += v;
      } else {
        return false;
      }
      fn(field, type, v, bytes);
    }
    return true;
  }
};

bool parse_model(const std::string& bytes, SpModel& m) {
  Wire w{reinterpret_cast<const unsigned char*>(bytes.data()), reinterpret_cast<const unsigned char*>(bytes.data()) + bytes.size()};
  bool ok = true;
  auto sub = [&](std::string_view b, auto&& fn) {
    Wire s{reinterpret_cast<const unsigned char*>(b.data()), reinterpret_cast<const unsigned char*>(b.data()) + b.size()};
    ok = s.fields(fn) && ok;
  };
  ok = w.fields([&](int field, int type, uint64_t v, std::string_view b) {
         (void)v;
         if (field == 1 && type == 2) {
           SpModel::Piece piece;
           sub(b, [&](int f, int t, uint64_t x, std::string_view y) {
             if (f == 1 && t == 2) piece.text = std::string(y);
             else if (f == 2 && t == 5) std::memcpy(&piece.score, &x, 4);
             else if (f == 3 && t == 0) piece.type = static_cast<int>(x);
           });
           m.pieces.push_back(std::move(piece));
         } else if (field == 2 && type == 2) {
           sub(b, [&](int f, int t, uint64_t x, std::string_view) {
             if (f == 3 && t == 0) m.model_type = static_cast<int>(x);
             else if (f == 24 && t == 0) m.whitespace_suffix = x != 0;
           });
         } else if (field == 3 && type == 2) {
           sub(b, [&](int f, int t, uint64_t x, std::string_view y) {
             if (f == 1 && t == 2) m.normalizer = std::string(y);
             else if (f == 2 && t == 2) m.charsmap = !y.empty();
             else if (f == 3 && t == 0) m.dummy_prefix = x != 0;
             else if (f == 4 && t == 0) m.remove_extra_ws = x != 0;
             else if (f == 5 && t == 0) m.escape_ws = x != 0;
           });
         }
       }) && ok;
  return ok;
}

std::size_t char_len(char lead) {
  const auto c = static_cast<unsigned char>(lead);
  return c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4;
}

// A BPE model with the identity normaliser, encoded on the BPE engine. Returns
// null (with the reason) when the model needs the library.
class SpBpe {
 public:
  // `path` names the file in what is thrown: a model the library loaded but
  // whose pieces this path cannot take (a NaN score, a byte piece that is
  // not <0xHH>) is refused naming the piece, not met deep inside.
  static std::unique_ptr<SpBpe> make(const std::string& path, const std::string& bytes, std::string& why) {
    SpModel m;
    if (!parse_model(bytes, m)) return why = "the model's protobuf could not be read", nullptr;
    if (m.model_type != 2) return why = "not a BPE model", nullptr;
    if (m.normalizer != "identity" || m.charsmap) return why = cat("normaliser '", m.normalizer, "'"), nullptr;
    if (m.remove_extra_ws || !m.escape_ws || m.whitespace_suffix) return why = "whitespace options", nullptr;
    auto e = std::make_unique<SpBpe>();
    e->dummy_prefix_ = m.dummy_prefix;
    std::map<float, uint32_t, std::greater<float>> by_score;  // dense ranks, highest score first
    for (uint32_t id = 0; id < m.pieces.size(); ++id) {
      const auto& p = m.pieces[id];
      if (p.type == 4 || p.type == 5) return why = "user-defined or unused pieces", nullptr;
      if (p.type == 1) {
        // Merges are ranked by score: a NaN has no place in that order.
        if (!std::isfinite(p.score))
          throw Error(cat("SentencePiece model '", path, "': piece ", id, " ('", p.text, "') has the score ", p.score,
                          "; a BPE model ranks its merges by finite scores (the file is damaged)"));
        e->bpe_.add_token(p.text, id);
        by_score.emplace(p.score, 0);
        // A piece with "▁" after another character would let a merge cross
        // the start of a word; the word-by-word split below relies on none.
        for (std::size_t k = p.text.find(kSpace, 1); k != std::string::npos; k = p.text.find(kSpace, k + 1))
          if (k < 3 || p.text.compare(k - 3, 3, kSpace) != 0) return why = cat("piece '", p.text, "' spans a word start"), nullptr;
      } else if (p.type == 6) {
        // A byte piece is "<0xHH>" (SentencePiece writes no other).
        const auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                                                   : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
        if (p.text.size() != 6 || p.text.compare(0, 3, "<0x") != 0 || p.text[5] != '>' || hex(p.text[3]) < 0 ||
            hex(p.text[4]) < 0)
          throw Error(cat("SentencePiece model '", path, "': piece ", id, " ('", p.text, "') is a byte piece, which "
                          "SentencePiece writes as <0xHH>; the file is damaged"));
        e->byte_fallback_ = true;
        e->byte_ids_[hex(p.text[3]) * 16 + hex(p.text[4])] = id;
      } else if (p.type == 2) {
        e->unk_ = id;
      }
    }
    uint32_t rank = 0;
    for (auto& [score, r] : by_score) r = rank++;
    e->bpe_.finish_tokens(false, cat("SentencePiece model '", path, "'"), true);
    for (uint32_t id = 0; id < m.pieces.size(); ++id) {
      const auto& p = m.pieces[id];
      if (p.type != 1) continue;
      const std::string_view t = p.text;
      for (std::size_t k = char_len(t[0]); k < t.size(); k += char_len(t[k])) {
        const uint32_t a = e->bpe_.find(t.substr(0, k));
        if (a == BytePairEncoder::kNone) continue;
        const uint32_t b = e->bpe_.find(t.substr(k));
        if (b != BytePairEncoder::kNone) e->bpe_.add_merge(a, b, by_score.at(p.score), id);
      }
    }
    e->bpe_.finish_pairs();
    return e;
  }

  void encode(std::string_view text, std::vector<uint32_t>& out) const {
    if (text.empty()) return;  // the library gives nothing, not even the dummy prefix
    thread_local std::string norm;
    norm.clear();
    if (dummy_prefix_) norm += kSpace;
    for (char c : text) {
      if (c == ' ') norm += kSpace;
      else norm += c;
    }
    const std::string_view s = norm;
    std::size_t start = 0, unk_end = std::string_view::npos;
    bool prev_space = false;
    auto flush = [&](std::size_t end) {
      if (end > start) bpe_.encode_word(s.substr(start, end - start), out);
    };
    for (std::size_t i = 0; i < s.size();) {
      const std::size_t n = std::min(char_len(s[i]), s.size() - i);
      const std::string_view ch = s.substr(i, n);
      const bool space = ch == kSpace;
      if (space && !prev_space && i > start) {  // a word starts: no merge crosses here
        flush(i);
        start = i;
      }
      if (!space && bpe_.find(ch) == BytePairEncoder::kNone) {
        // A character outside the vocabulary: its UTF-8 bytes (byte fallback) or <unk>; nothing merges with it.
        // A run of such characters is one <unk>, as the library merges adjacent unknown pieces.
        flush(i);
        if (byte_fallback_)
          for (char b : ch) out.push_back(byte_ids_[static_cast<unsigned char>(b)]);
        else if (unk_end != i)
          out.push_back(unk_);
        unk_end = i + n;
        start = i + n;
      }
      prev_space = space;
      i += n;
    }
    flush(s.size());
  }

 private:
  BytePairEncoder bpe_;
  bool dummy_prefix_ = true, byte_fallback_ = false;
  uint32_t byte_ids_[256] = {};
  uint32_t unk_ = 0;
};

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(const std::string& path, const std::string& bytes, const TokenizerOptions& opt) : path_(path) {
    const auto st = sp_.LoadFromSerializedProto(bytes);
    if (!st.ok())
      throw Error(cat("tokenizer '", path, "' looks like a SentencePiece model but libsentencepiece cannot load it: ",
                      st.ToString(), "; check that the file is complete (Llama 2's tokenizer.model is 499723 bytes)"));
    const int n = sp_.GetPieceSize();
    if (n <= 0) throw Error(cat("SentencePiece model '", path, "' has no pieces"));
    vocab_ = static_cast<uint32_t>(n);
    bos_ = special(opt.bos, sp_.bos_id(), "BOS", "--bos");
    eos_ = special(opt.eos, sp_.eos_id(), "EOS", "--eos");
    if (!opt.sentencepiece_library) {
      std::string why;
      fast_ = SpBpe::make(path, bytes, why);
      if (!fast_) log_debug(cat("SentencePiece model '", path, "' is encoded by libsentencepiece: ", why));
    }
  }
  std::string kind() const override { return "sentencepiece"; }
  std::string engine() const override { return fast_ ? "loom-bpe" : "libsentencepiece"; }
  uint32_t vocab_size() const override { return vocab_; }
  uint32_t bos() const override { return bos_; }
  uint32_t eos() const override { return eos_; }
  void encode(std::string_view text, std::vector<uint32_t>& out) const override {
    if (fast_) return fast_->encode(text, out);
    // Encode() is const and keeps no state between calls: safe from many threads.
    thread_local std::vector<int> ids;
    ids.clear();
    const auto st = sp_.Encode(text, &ids);
    if (!st.ok())
      throw TokenizeInputError(cat("SentencePiece model '", path_, "' failed to encode the document: ", st.ToString()), 0);
    for (int id : ids) out.push_back(static_cast<uint32_t>(id));
  }
  std::string piece(uint32_t id) const override { return sp_.IdToPiece(static_cast<int>(id)); }

 private:
  // The model's own BOS/EOS unless the user names a piece; a model trained
  // without them (bos_id = -1) needs one named.
  uint32_t special(const std::string& name, int model_id, const char* what, const char* flag) const {
    if (!name.empty()) {
      const int id = sp_.PieceToId(name);
      if (id < 0 || sp_.IdToPiece(id) != name)
        throw Error(cat(flag, " '", name, "' is not a piece of SentencePiece model '", path_, "'"));
      return static_cast<uint32_t>(id);
    }
    if (model_id < 0)
      throw Error(cat("SentencePiece model '", path_, "' defines no ", what, " token (its ", what,
                      " id is -1); name one of its pieces with ", flag, " PIECE"));
    return static_cast<uint32_t>(model_id);
  }

  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
  std::unique_ptr<SpBpe> fast_;  // BPE models with the identity normaliser
  uint32_t vocab_ = 0, bos_ = 0, eos_ = 0;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path, const std::string& bytes,
                                              const TokenizerOptions& opt) {
  return std::make_unique<SentencePieceTokenizer>(path, bytes, opt);
}

}  // namespace loom::data
