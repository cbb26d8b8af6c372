// Tokenizers, part of the SDK (implemented in libloom, core/src/ops/tokenizers):
// the byte-level one, SentencePiece models (Llama 2, Mistral), tiktoken BPE
// files (Llama 3) and Hugging Face tokenizer.json files of byte-level BPE
// type. One interface, so that `loom prepare text` — or a data source that
// tokenizes as it reads (examples/plugins/jsonl) — does not care which it
// runs, and every one is safe to call from many threads at once (prepare
// tokenizes documents on all cores).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "loom/error.hpp"

namespace loom::data {

// An input a tokenizer cannot encode: its pre-tokenizer regex gave up on it
// (PCRE2's match, depth or JIT stack limit). The message names the tokenizer
// file and the byte of the document; `offset` is that byte, for the caller
// to name the input file and where in it the document starts.
class TokenizeInputError : public Error {
 public:
  TokenizeInputError(const std::string& message, uint64_t offset) : Error(message), offset(offset) {}
  uint64_t offset;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // "bytes", "sentencepiece", "tiktoken", "hf-bpe": written into prepare.json.
  virtual std::string kind() const = 0;
  // Every id this tokenizer produces (special tokens included) is < vocab_size().
  virtual uint32_t vocab_size() const = 0;
  virtual uint32_t bos() const = 0;
  virtual uint32_t eos() const = 0;
  // Appends the ids of `text` (valid UTF-8: see sanitize_utf8), without BOS or
  // EOS. Text that looks like a special token ("<s>", "<|eot_id|>") is encoded
  // as ordinary text: a corpus cannot inject control tokens. Thread-safe.
  virtual void encode(std::string_view text, std::vector<uint32_t>& out) const = 0;
  // What encodes: "libsentencepiece" or "loom-bpe" for SentencePiece models, the kind otherwise.
  virtual std::string engine() const { return kind(); }
  // A piece of an id, for messages and tests ("▁the", "<|begin_of_text|>").
  virtual std::string piece(uint32_t id) const = 0;
  // Appends BOS, the ids of `doc`, EOS: what prepare writes per document.
  // An input the tokenizer cannot encode throws TokenizeInputError with the
  // byte of `doc` where it gave up.
  void encode_document(std::string_view doc, std::vector<uint32_t>& out) const;
};

// Where BOS and EOS come from when the file does not say (an HF tokenizer.json
// without a tokenizer_config.json beside it): token strings, looked up in the
// vocabulary. Empty = the tokenizer's own.
struct TokenizerOptions {
  std::string bos, eos;
  // SentencePiece: always encode with libsentencepiece, not loom's BPE path
  // for BPE models (tests compare the two).
  bool sentencepiece_library = false;
};

// Loads a tokenizer file, recognising its format from its content: a JSON
// object (HF tokenizer.json), lines of "<base64> <rank>" (tiktoken), or a
// SentencePiece model (protobuf). Throws loom::Error naming the file and what
// is wrong or unsupported. "bytes" (no file) gives the byte-level tokenizer.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path, const TokenizerOptions& opt = {});

std::unique_ptr<Tokenizer> make_byte_tokenizer();

// Invalid UTF-8 replaced by U+FFFD, one per maximal ill-formed subpart (the
// Unicode recommendation, which Python's bytes.decode("utf-8", "replace")
// follows), so ids match the reference libraries fed the decoded string.
// Returns the number of replacements.
std::size_t sanitize_utf8(std::string_view in, std::string& out);

}  // namespace loom::data
