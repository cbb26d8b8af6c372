// `loom prepare text`: UTF-8 text files -> token shards, with the byte-level
// tokenizer or a real one (SentencePiece, tiktoken, HF tokenizer.json).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace loom::data {

struct PrepareTextOptions {
  std::string out_dir;
  std::vector<std::string> inputs;  // files or directories (recursed)
  double val_fraction = 0.05;       // share of documents in val.bin, in [0, 1)
  uint64_t shard_tokens = uint64_t{16} << 20;
  uint64_t seed = 0;
  bool force = false;  // replace shards a previous prepare left in out_dir
  std::string tokenizer = "bytes";  // "bytes" or a tokenizer file (loom/ops/tokenizer.hpp)
  std::string bos, eos;             // token names overriding the tokenizer's own (rarely needed)
  int threads = 0;                  // tokenizing threads; 0 = every core
  bool replace_invalid_utf8 = false;  // tokenize files with invalid UTF-8 (U+FFFD for each bad sequence) instead of skipping them
  bool progress = true;             // a progress line (MB, MB/s) on stderr when it is a terminal
};

struct PrepareTextResult {
  std::vector<std::string> files_used;
  std::vector<std::pair<std::string, std::string>> files_skipped;  // path, reason
  uint64_t documents = 0, train_documents = 0, val_documents = 0;
  uint64_t train_tokens = 0, val_tokens = 0;
  std::vector<std::string> train_shards;  // full paths, in order
  std::string val_shard;                  // empty when val_fraction == 0
  std::string val_warning;                // why val.bin is too small to validate on, and what would fix it; "" if it is not
  std::string manifest;                   // out_dir/prepare.json
  std::string tokenizer;                  // kind: bytes, sentencepiece, tiktoken, hf-bpe
  uint32_t vocab = 0, bos = 0, eos = 0;
  int token_width = 2;                    // 4 when the vocabulary exceeds 65536
  uint64_t text_bytes = 0;                // bytes of document text tokenized
  double tokenize_seconds = 0;            // wall time of tokenizing (pass 2)
  int threads = 1;
};

// Collects the input files (directories recursed with entries sorted; files
// that are not UTF-8 text skipped with a warning; a file reached twice, e.g.
// through a symlink, read once), splits them into documents, assigns each
// document to train or val, and writes out_dir/train_NNN.bin, val.bin and
// prepare.json. Documents go to val by rank of a seeded hash of their content,
// so the split is deterministic, exact in size, and a duplicate document never
// lands on both sides.
PrepareTextResult prepare_text(const PrepareTextOptions& opt);

}  // namespace loom::data
