// The loaders behind load_tokenizer (one file each), called with the file's
// bytes already read.
#pragma once
#include <memory>
#include <string>

#include "data/tokenizers/tokenizer.hpp"

namespace loom::data {

std::string read_tokenizer_file(const std::string& path);
bool looks_like_tiktoken(const std::string& bytes);
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path, const std::string& bytes,
                                              const TokenizerOptions& opt);
std::unique_ptr<Tokenizer> load_tiktoken(const std::string& path, const std::string& bytes,
                                         const TokenizerOptions& opt);
std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path, const std::string& bytes,
                                             const TokenizerOptions& opt);

}  // namespace loom::data
