#include "loom/ops/byte_tokenizer.hpp"

#include "loom/error.hpp"

namespace loom::data {

void ByteTokenizer::encode_document(std::string_view doc, std::vector<uint32_t>& out) {
  // No reserve(): an exact reserve per document would defeat the vector's
  // geometric growth and make appending a corpus quadratic.
  out.push_back(bos);
  for (unsigned char c : doc) out.push_back(c);
  out.push_back(eos);
}

std::string ByteTokenizer::decode(const int32_t* ids, std::size_t n) {
  std::string s;
  for (std::size_t i = 0; i < n; ++i) {
    if (ids[i] == static_cast<int32_t>(bos)) s += "<s>";
    else if (ids[i] == static_cast<int32_t>(eos)) s += "</s>";
    else if (ids[i] >= 0 && ids[i] < 256) s += static_cast<char>(ids[i]);
    else s += cat("<", ids[i], ">");
  }
  return s;
}

bool is_utf8_text(std::string_view b, std::string* why) {
  const auto* p = reinterpret_cast<const unsigned char*>(b.data());
  const std::size_t n = b.size();
  auto fail = [&](std::size_t at, const char* what) {
    if (why) *why = cat(what, " at byte offset ", at);
    return false;
  };
  for (std::size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    if (c == 0) return fail(i, "NUL byte");
    if (c < 0x80) { ++i; continue; }
    int len;
    uint32_t cp;
    if (c >= 0xc2 && c <= 0xdf) { len = 2; cp = c & 0x1f; }
    else if (c >= 0xe0 && c <= 0xef) { len = 3; cp = c & 0x0f; }
    else if (c >= 0xf0 && c <= 0xf4) { len = 4; cp = c & 0x07; }
    else return fail(i, "invalid UTF-8 lead byte");
    if (i + len > n) return fail(i, "truncated UTF-8 sequence");
    for (int k = 1; k < len; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return fail(i, "invalid UTF-8 continuation byte");
      cp = (cp << 6) | (p[i + k] & 0x3f);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000)) return fail(i, "overlong UTF-8 encoding");
    if (cp >= 0xd800 && cp <= 0xdfff) return fail(i, "UTF-8 encoded surrogate");
    if (cp > 0x10ffff) return fail(i, "code point above U+10FFFF");
    i += len;
  }
  return true;
}

namespace {
bool blank(std::string_view s) {
  for (char c : s)
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r' && c != '\f' && c != '\v') return false;
  return true;
}
}  // namespace

std::vector<std::string_view> split_documents(std::string_view text) {
  std::vector<std::string_view> docs;
  std::size_t doc_start = 0, line_start = 0;
  auto emit = [&](std::size_t end) {
    std::string_view d = text.substr(doc_start, end - doc_start);
    if (!blank(d)) docs.push_back(d);
  };
  while (line_start < text.size()) {
    std::size_t nl = text.find('\n', line_start);
    const std::size_t line_end = nl == std::string_view::npos ? text.size() : nl;
    std::string_view line = text.substr(line_start, line_end - line_start);
    const std::size_t next = nl == std::string_view::npos ? text.size() : nl + 1;
    if (line == "%" || line == "%\r") {
      emit(line_start);
      doc_start = next;
    }
    line_start = next;
  }
  emit(text.size());
  return docs;
}

}  // namespace loom::data
