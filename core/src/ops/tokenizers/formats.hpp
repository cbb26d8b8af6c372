// The loaders behind load_tokenizer (one file each), called with the file's
// bytes already read.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "loom/ops/tokenizer.hpp"

namespace loom::data {

// Far above any real tokenizer file (Llama 3's tokenizer.json is 9 MB, the
// largest vocabularies' tens of MB), far below what would exhaust memory.
inline constexpr std::size_t kMaxTokenizerFileBytes = std::size_t{1} << 30;
// The bytes of a tokenizer file: a regular file (symlinks followed) of at
// most kMaxTokenizerFileBytes; anything else is a loom::Error naming the path.
std::string read_tokenizer_file(const std::string& path);
// The first line is "<base64> <rank>".
bool looks_like_tiktoken(const std::string& bytes);
// The first line is not, but the (up to 3) lines after it are: a tiktoken
// file with a damaged first line.
bool looks_like_tiktoken_after_first_line(const std::string& bytes);
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path, const std::string& bytes,
                                              const TokenizerOptions& opt);
std::unique_ptr<Tokenizer> load_tiktoken(const std::string& path, const std::string& bytes,
                                         const TokenizerOptions& opt);
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path, const std::string& bytes,
                                             const TokenizerOptions& opt);

}  // namespace loom::data
