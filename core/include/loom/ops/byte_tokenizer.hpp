// The byte-level tokenizer: ids 0..255 are the bytes of UTF-8 text, 256 marks
// the beginning of a document and 257 its end. No training, no merges file,
// nothing to ship with a checkpoint: good for quick runs and tests.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom::data {

struct ByteTokenizer {
  static constexpr uint32_t bos = 256;
  static constexpr uint32_t eos = 257;
  static constexpr uint32_t vocab = 258;
  static constexpr const char* name = "bytes";

  // Appends BOS, the bytes of `doc`, EOS.
  static void encode_document(std::string_view doc, std::vector<uint32_t>& out);
  // Bytes back to text; BOS and EOS become "<s>" and "</s>" (for looking at samples).
  static std::string decode(const int32_t* ids, std::size_t n);
};

// True if `bytes` is text we tokenize: valid UTF-8 (no overlongs, surrogates or
// code points above U+10FFFF) with no NUL byte. Otherwise `why` says what and
// at which byte offset.
bool is_utf8_text(std::string_view bytes, std::string* why);

// Splits a file into documents. Lines that are exactly "%" (the fortune
// format; "%\r" too) separate documents; a file without such lines is one
// document. Documents that are empty or only whitespace are dropped.
std::vector<std::string_view> split_documents(std::string_view text);

}  // namespace loom::data
