// Megatron-LM indexed datasets (PREFIX.bin + PREFIX.idx), as written by
// Megatron's and PaddleNLP's tools/preprocess_data.py.
//
// PREFIX.idx, little-endian, unaligned:
//   offset 0   9 bytes   magic "MMIDIDX\0\0"
//          9   uint64    version = 1
//         17   uint8     dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
//                        6 float64, 7 float32, 8 uint16
//         18   uint64    N, the number of sequences
//         26   uint64    D, the number of document indices
//         34   int32[N]  sequence lengths in tokens
//    34 + 4N   int64[N]  byte offset of each sequence in PREFIX.bin
//   34 + 12N   int64[D]  document indices: the sequence each document starts
//                        at, then N (one document per sequence unless the text
//                        was split into sentences)
// PREFIX.bin: the tokens of every sequence, back to back.
//
// Everything is checked at open (sizes, pointers back to back filling PREFIX.bin, document
// indices), so a damaged file is refused by name before training starts.
//
// Both files are memory-mapped and must not change while they are: a read
// that faults because one was truncated in place (SIGBUS) is an error naming
// that file, and verify_unchanged() refuses a file rewritten in place or
// replaced (the SDK's loom/mapped_file.hpp).
#pragma once
#include <cstdint>
#include <string>

#include "loom/mapped_file.hpp"

namespace loom::data {

class IndexedDataset {
 public:
  // `key` is the config key that named the prefix ("data.prefix",
  // "data.val_prefix"), for the messages about a missing file.
  explicit IndexedDataset(const std::string& prefix, const std::string& key = "data.prefix");
  IndexedDataset(IndexedDataset&&) noexcept = default;
  IndexedDataset& operator=(IndexedDataset&&) = delete;
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  uint64_t sequences() const { return n_; }
  uint64_t documents() const { return d_ > 0 ? d_ - 1 : 0; }
  uint32_t length(uint64_t seq) const;    // tokens of a sequence
  // Tokens of sequences [begin, end).
  uint64_t tokens(uint64_t begin, uint64_t end) const;
  uint64_t tokens() const { return total_; }
  int dtype_code() const { return dtype_; }
  int item_size() const { return item_; }
  const char* dtype_name() const;

  // Copies tokens [offset, offset + n) of sequence `seq` into out as int32;
  // a token < 0 or >= limit is an error naming the file, sequence and token.
  void read(uint64_t seq, uint64_t offset, uint64_t n, int32_t* out, int64_t limit) const;

  // Reads every token of sequences [begin, end) and throws as read() does at
  // the first one < 0 or >= limit; returns the number of tokens read. A
  // min/max reduction over the mapping, at memory bandwidth.
  uint64_t scan(uint64_t begin, uint64_t end, int64_t limit) const;

  // Throws loom::Error naming the file and what changed when PREFIX.idx or
  // PREFIX.bin is no longer the file opened (a stat of each; reads nothing).
  void verify_unchanged() const;

 private:
  uint64_t pointer(uint64_t seq) const;
  // The error for a read that faulted: names whichever file shrank.
  [[noreturn]] void throw_read_fault() const;
  [[noreturn]] void throw_bad_token(uint64_t seq, uint64_t offset, int64_t t, int64_t limit) const;

  std::string prefix_;
  MappedFile idx_, bin_;
  uint64_t n_ = 0, d_ = 0, total_ = 0;
  int dtype_ = 0, item_ = 0;
};

}  // namespace loom::data
