// tiktoken BPE files: one "<base64 of the token's bytes> <rank>" per line, the
// rank being the id. Llama 3's tokenizer.model is one (128000 ranks); its
// pre-tokenizer regex and its 256 special tokens live in Meta's code, not in
// the file, so loom knows them for that layout. Encoding follows tiktoken's
// encode_ordinary: regex matches become words, each word is one token if it is
// in the vocabulary, else byte pairs merged by lowest rank.
#include <cstring>

#include "ops/tokenizers/bpe.hpp"
#include "ops/tokenizers/formats.hpp"
#include "loom/error.hpp"

namespace loom::data {
namespace {

// Llama 3 (Meta's llama3 tokenizer.py).
constexpr uint32_t kLlama3Ranks = 128000;
constexpr uint32_t kLlama3Specials = 256;
constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kLlama3Named[] = {
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", "<|image|>"};

int b64_value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

bool b64_decode(std::string_view in, std::string& out) {
  out.clear();
  uint32_t acc = 0;
  int bits = 0;
  std::size_t i = 0;
  for (; i < in.size() && in[i] != '='; ++i) {
    const int v = b64_value(static_cast<unsigned char>(in[i]));
    if (v < 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += static_cast<char>((acc >> bits) & 0xff);
    }
  }
  for (; i < in.size(); ++i)
    if (in[i] != '=') return false;
  return !out.empty();
}

class TiktokenTokenizer final : public Tokenizer {
 public:
  TiktokenTokenizer(const std::string& path, const std::string& bytes, const TokenizerOptions& opt)
      : splitter_(kLlama3Pattern, false, cat("tiktoken file '", path, "'")) {
    // A file cut mid-line (a partial download) can end in a line that still
    // parses, with a shorter rank: say so rather than blame that rank.
    const bool cut = !bytes.empty() && bytes.back() != '\n';
    auto truncated = [&](std::size_t at_line, std::size_t last_line) {
      return cut && at_line == last_line
                 ? cat(" (the file ends without a newline in that line: it looks truncated; fetch it again)")
                 : std::string();
    };
    std::size_t last_line = 0, tokens = 0;
    for (std::size_t pos = 0; pos <= bytes.size();) {
      std::size_t end = bytes.find('\n', pos);
      if (end == std::string::npos) end = bytes.size();
      std::size_t len = end - pos;
      if (len > 0 && bytes[end - 1] == '\r') --len;
      tokens += len > 0;
      ++last_line;
      pos = end + 1;
    }
    // Sizes first, before anything is allocated from them. Ranks are 0..N-1
    // without gaps, one a line, so the rank table has one entry per token
    // line and a rank of N or more cannot be right (sizing the table from
    // one absurd rank of 10^9 would ask for tens of gigabytes). And loom
    // reads Llama 3's file only: more lines than its ranks are refused
    // before a table is made for them.
    if (tokens > kLlama3Ranks)
      throw Error(cat("tiktoken file '", path, "' has ", tokens, " token lines; loom knows the pre-tokenizer and special "
                      "tokens of Llama 3's (", kLlama3Ranks, " ranks), which the file itself does not carry. Convert "
                      "this vocabulary to an HF tokenizer.json (which records both) and pass that instead"));
    std::vector<std::string> by_rank(tokens);
    std::size_t beyond_line = 0;  // the first line whose rank is N or more
    uint64_t beyond_rank = 0;
    std::size_t line_no = 0, pos = 0;
    std::string tok;
    while (pos < bytes.size()) {
      std::size_t end = bytes.find('\n', pos);
      if (end == std::string::npos) end = bytes.size();
      std::string_view line(bytes.data() + pos, end - pos);
      pos = end + 1;
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
      if (line.empty()) continue;
      const std::size_t sp = line.find(' ');
      uint64_t rank = 0;
      bool ok = sp != std::string_view::npos && sp + 1 < line.size() && b64_decode(line.substr(0, sp), tok);
      for (std::size_t i = sp + 1; ok && i < line.size(); ++i) {
        ok = line[i] >= '0' && line[i] <= '9' && rank < (1u << 30);
        rank = rank * 10 + static_cast<uint64_t>(line[i] - '0');
      }
      if (!ok)
        throw Error(cat("tiktoken file '", path, "' line ", line_no, " is not \"<base64 token> <rank>\": '",
                        std::string(line.substr(0, 80)), "'", truncated(line_no, last_line)));
      if (rank >= tokens) {
        if (beyond_line == 0) {
          beyond_line = line_no;
          beyond_rank = rank;
        }
        continue;
      }
      if (!by_rank[rank].empty())
        throw Error(cat("tiktoken file '", path, "' line ", line_no, ": rank ", rank, " is given twice",
                        truncated(line_no, last_line)));
      by_rank[rank] = tok;
    }
    for (std::size_t r = 0; r < by_rank.size(); ++r)
      if (by_rank[r].empty())
        throw Error(cat("tiktoken file '", path, "' has no token of rank ", r, " (ranks must be 0..", by_rank.size() - 1,
                        " without gaps, one per line of its ", tokens, ")",
                        beyond_line > 0 ? cat("; line ", beyond_line, " gives rank ", beyond_rank, " instead, beyond ",
                                              tokens - 1)
                                        : std::string(),
                        "; the file is damaged", truncated(last_line, last_line)));
    if (by_rank.size() != kLlama3Ranks)
      throw Error(cat("tiktoken file '", path, "' has ", by_rank.size(), " ranks", truncated(last_line, last_line),
                      "; loom knows the pre-tokenizer and special ",
                      "tokens of Llama 3's (", kLlama3Ranks, " ranks), which the file itself does not carry. Convert ",
                      "this vocabulary to an HF tokenizer.json (which records both) and pass that instead"));
    base_ = static_cast<uint32_t>(by_rank.size());
    for (uint32_t r = 0; r < base_; ++r) bpe_.add_token(by_rank[r], r);
    bpe_.finish_tokens(true, cat("tiktoken file '", path, "'"));
    // tiktoken ranks a pair by the rank of the token it makes: every token of
    // two or more bytes is the merge of each split into two tokens.
    for (uint32_t r = 0; r < base_; ++r) {
      const std::string& t = by_rank[r];
      for (std::size_t k = 1; k < t.size(); ++k) {
        const uint32_t a = bpe_.find(std::string_view(t).substr(0, k));
        if (a == BytePairEncoder::kNone) continue;
        const uint32_t b = bpe_.find(std::string_view(t).substr(k));
        if (b != BytePairEncoder::kNone) bpe_.add_merge(a, b, r, r);
      }
    }
    bpe_.finish_pairs();
    for (uint32_t i = 0; i < kLlama3Specials; ++i)
      specials_.push_back(i < std::size(kLlama3Named) ? std::string(kLlama3Named[i])
                                                     : cat("<|reserved_special_token_", 2 + i - std::size(kLlama3Named), "|>"));
    bos_ = special_id(opt.bos.empty() ? "<|begin_of_text|>" : opt.bos, path, "--bos");
    eos_ = special_id(opt.eos.empty() ? "<|end_of_text|>" : opt.eos, path, "--eos");
  }
  std::string kind() const override { return "tiktoken"; }
  uint32_t vocab_size() const override { return base_ + static_cast<uint32_t>(specials_.size()); }
  uint32_t bos() const override { return bos_; }
  uint32_t eos() const override { return eos_; }
  void encode(std::string_view text, std::vector<uint32_t>& out) const override {
    splitter_.split(text, [&](std::string_view w) { bpe_.encode_word(w, out); });
  }
  std::string piece(uint32_t id) const override {
    if (id >= base_) return id - base_ < specials_.size() ? specials_[id - base_] : cat("<", id, ">");
    return cat("<rank ", id, ">");
  }

 private:
  uint32_t special_id(const std::string& name, const std::string& path, const char* flag) const {
    for (std::size_t i = 0; i < specials_.size(); ++i)
      if (specials_[i] == name) return base_ + static_cast<uint32_t>(i);
    throw Error(cat(flag, " '", name, "' is not a special token of the Llama 3 tiktoken file '", path,
                    "' (e.g. <|begin_of_text|>, <|end_of_text|>, <|eot_id|>)"));
  }

  RegexSplitter splitter_;
  BytePairEncoder bpe_;
  std::vector<std::string> specials_;
  uint32_t base_ = 0, bos_ = 0, eos_ = 0;
};

}  // namespace

namespace {

// "<base64> <rank>", an optional '\r' at its end.
bool is_tiktoken_line(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  const std::size_t sp = line.find(' ');
  if (sp == std::string_view::npos || sp == 0 || sp + 1 == line.size()) return false;
  for (std::size_t i = 0; i < sp; ++i)
    if (b64_value(static_cast<unsigned char>(line[i])) < 0 && line[i] != '=') return false;
  for (std::size_t i = sp + 1; i < line.size(); ++i)
    if (!(line[i] >= '0' && line[i] <= '9')) return false;
  return true;
}

}  // namespace

bool looks_like_tiktoken(const std::string& bytes) {
  return is_tiktoken_line(std::string_view(bytes).substr(0, bytes.find('\n')));
}

bool looks_like_tiktoken_after_first_line(const std::string& bytes) {
  const std::string_view all(bytes);
  std::size_t pos = all.find('\n');
  int lines = 0;
  while (pos != std::string_view::npos && pos + 1 < all.size() && lines < 3) {
    const std::size_t end = all.find('\n', pos + 1);
    if (!is_tiktoken_line(all.substr(pos + 1, end == std::string_view::npos ? std::string_view::npos : end - pos - 1)))
      return false;
    ++lines;
    pos = end;
  }
  // Two good lines at least: one could be chance.
  return lines >= 2;
}

std::unique_ptr<Tokenizer> load_tiktoken(const std::string& path, const std::string& bytes,
                                         const TokenizerOptions& opt) {
  return std::make_unique<TiktokenTokenizer>(path, bytes, opt);
}

}  // namespace loom::data
