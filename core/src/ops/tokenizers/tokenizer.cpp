// load_tokenizer's format detection, the UTF-8 repair shared by every
// tokenizer, and the byte-level tokenizer behind the Tokenizer interface.
#include "loom/ops/tokenizer.hpp"

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <sys/stat.h>

#include "loom/ops/byte_tokenizer.hpp"
#include "ops/tokenizers/bpe.hpp"
#include "ops/tokenizers/formats.hpp"
#include "loom/error.hpp"
#include "util/files.hpp"

namespace loom::data {

std::size_t sanitize_utf8(std::string_view in, std::string& out) {
  const auto* p = reinterpret_cast<const unsigned char*>(in.data());
  const std::size_t n = in.size();
  static constexpr char kReplacement[] = "\xEF\xBF\xBD";
  std::size_t replaced = 0;
  out.clear();
  out.reserve(n);
  std::size_t i = 0;
  while (i < n) {
    // Copy the ASCII run in one go: most text is mostly ASCII.
    std::size_t a = i;
    while (a < n && p[a] < 0x80) ++a;
    out.append(in.data() + i, a - i);
    if (a == n) break;
    i = a;
    const unsigned char c = p[i];
    int len = 0;
    unsigned char lo = 0x80, hi = 0xbf;  // the valid range of the second byte
    if (c >= 0xc2 && c <= 0xdf) len = 2;
    else if (c == 0xe0) { len = 3; lo = 0xa0; }
    else if ((c >= 0xe1 && c <= 0xec) || c == 0xee || c == 0xef) len = 3;
    else if (c == 0xed) { len = 3; hi = 0x9f; }  // no surrogates
    else if (c == 0xf0) { len = 4; lo = 0x90; }
    else if (c >= 0xf1 && c <= 0xf3) len = 4;
    else if (c == 0xf4) { len = 4; hi = 0x8f; }  // nothing above U+10FFFF
    if (len == 0) {  // a continuation byte without a lead, C0, C1, F5..FF
      out += kReplacement;
      ++replaced;
      ++i;
      continue;
    }
    std::size_t j = i + 1;
    bool ok = j < n && p[j] >= lo && p[j] <= hi;
    if (ok) {
      ++j;
      for (int k = 2; k < len; ++k, ++j)
        if (j >= n || (p[j] & 0xc0) != 0x80) { ok = false; break; }
    }
    if (!ok) {
      // The maximal ill-formed subpart [i, j) becomes one replacement; the
      // byte that broke the sequence is looked at again as a new start.
      out += kReplacement;
      ++replaced;
      i = j;
      continue;
    }
    out.append(in.data() + i, static_cast<std::size_t>(len));
    i += static_cast<std::size_t>(len);
  }
  return replaced;
}

namespace {

class BytesTokenizer final : public Tokenizer {
 public:
  std::string kind() const override { return ByteTokenizer::name; }
  uint32_t vocab_size() const override { return ByteTokenizer::vocab; }
  uint32_t bos() const override { return ByteTokenizer::bos; }
  uint32_t eos() const override { return ByteTokenizer::eos; }
  void encode(std::string_view text, std::vector<uint32_t>& out) const override {
    for (unsigned char c : text) out.push_back(c);
  }
  std::string piece(uint32_t id) const override {
    const int32_t i = static_cast<int32_t>(id);
    return ByteTokenizer::decode(&i, 1);
  }
};

}  // namespace

std::unique_ptr<Tokenizer> make_byte_tokenizer() { return std::make_unique<BytesTokenizer>(); }

void Tokenizer::encode_document(std::string_view doc, std::vector<uint32_t>& out) const {
  out.push_back(bos());
  try {
    encode(doc, out);
  } catch (const RegexGaveUp& e) {
    // The piece PCRE2 was given lies inside the document (a tokenizer that
    // copies text first maps its pointer back); else the document's start.
    const bool inside = e.at >= doc.data() && e.at <= doc.data() + doc.size();
    const uint64_t at = inside ? static_cast<uint64_t>(e.at - doc.data()) : 0;
    std::string pattern = e.pattern.size() > 200 ? e.pattern.substr(0, 200) + "..." : e.pattern;
    throw TokenizeInputError(
        cat(e.tokenizer, ": its pre-tokenizer pattern gave up searching the input from byte ", at,
            " of the document (PCRE2: ", e.reason, "); the pattern backtracks too much on the text there: fix the "
            "tokenizer file's pattern (", pattern, ") or remove that text from the input"),
        at);
  }
  out.push_back(eos());
}

std::string read_tokenizer_file(const std::string& path) {
  // A directory is named, with the tokenizer file it holds when there is one.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    std::string hint;
    for (const char* name : {"tokenizer.model", "tokenizer.json"})
      if (std::filesystem::is_regular_file(std::filesystem::path(path) / name, ec))
        hint += cat(hint.empty() ? "; e.g. --tokenizer " : " or ", (std::filesystem::path(path) / name).string());
    throw Error(cat("tokenizer '", path, "' is a directory; give the tokenizer file itself (a SentencePiece or tiktoken ",
                    "tokenizer.model, or an HF tokenizer.json)", hint));
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw Error(cat("cannot read tokenizer '", path, "': ", std::strerror(errno),
                    "; give a SentencePiece tokenizer.model, a tiktoken BPE file or an HF tokenizer.json"));
  // A regular file only (a FIFO would block the open for ever, /dev/zero
  // never ends), and a bounded read: a path that names something else fails
  // at once, naming it, instead of hanging or running out of memory.
  return read_bounded_file(path, "tokenizer", kMaxTokenizerFileBytes);
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path, const TokenizerOptions& opt) {
  if (path == "bytes") return make_byte_tokenizer();
  const std::string bytes = read_tokenizer_file(path);
  if (bytes.empty()) throw Error(cat("tokenizer '", path, "' is empty"));
  std::size_t first = 0;
  while (first < bytes.size() && std::strchr(" \t\r\n", bytes[first])) ++first;
  // '[' too: a JSON array is refused by the HF loader as JSON, not as "no format".
  if (first < bytes.size() && (bytes[first] == '{' || bytes[first] == '[')) return load_hf_tokenizer(path, bytes, opt);
  if (looks_like_tiktoken(bytes)) return load_tiktoken(path, bytes, opt);
  // A SentencePiece model is a serialized ModelProto whose first field is the
  // repeated `pieces` (field 1, length-delimited: tag byte 0x0a).
  if (static_cast<unsigned char>(bytes[0]) == 0x0a) return load_sentencepiece(path, bytes, opt);
  // A tiktoken file whose first line is damaged: its loader names that line,
  // as it names a bad line further on.
  if (looks_like_tiktoken_after_first_line(bytes)) return load_tiktoken(path, bytes, opt);
  throw Error(cat("tokenizer '", path, "' is none of the formats loom reads: not JSON (an HF tokenizer.json), ",
                  "not lines of \"<base64 token> <rank>\" (a tiktoken file such as Llama 3's tokenizer.model), ",
                  "and not a SentencePiece model (Llama 2's tokenizer.model)"));
}

}  // namespace loom::data
