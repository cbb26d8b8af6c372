// Token shards: flat files of token ids, the input of the `tokens` data plugin
// and the output of `loom prepare`.
//
// Format (all integers little-endian):
//
//   offset  size  field
//   0       8     magic "LOOMTOKS"
//   8       4     format version (uint32) = 1
//   12      4     token width in bytes (uint32): 2 (ids < 65536) or 4
//   16      8     token count (uint64)
//   24      4     vocabulary size (uint32): every id is < vocab; 0 = unknown
//   28      4     flags (uint32): bit 0 = the shard records its document markers
//   32      4     BOS id (uint32), when bit 0 is set: the token that begins a document
//   36      4     EOS id (uint32), when bit 0 is set: the token that ends one
//   40      984   zero (reserved; readers of version 1 ignore it)
//   1024    count * width   the tokens, little-endian, unsigned
//
// The header is a fixed 1024 bytes so that the tokens start page-aligned
// enough for mmap and so that later versions can add fields without moving
// the data. The document markers (flags, BOS, EOS) came later within version
// 1: a shard written before them has zeros there and records none, which
// every reader of version 1 reads as such. `loom prepare` writes BOS, the
// document's ids, EOS per document and records both ids, so that the
// `tokens` data plugin can tell where each document begins (document
// masking, docs/CONFIG.md). The file size must be exactly 1024 + count * width: anything else
// means a truncated or overwritten file, and is refused at open.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace loom {

inline constexpr std::size_t kTokenShardHeaderBytes = 1024;
inline constexpr char kTokenShardMagic[8] = {'L', 'O', 'O', 'M', 'T', 'O', 'K', 'S'};
inline constexpr uint32_t kTokenShardVersion = 1;

// The ids that delimit the documents of a shard: every document is BOS, its
// tokens, EOS (bos == eos for tokenizers with one separator token).
struct DocumentMarkers {
  uint32_t bos = 0, eos = 0;
  bool operator==(const DocumentMarkers&) const = default;
};

// Writes `n` tokens as a shard of `width` bytes per token (2 or 4) with the
// given vocabulary size (0 = unknown). Every token must fit the width and, if
// vocab > 0, be < vocab. The data goes to `path`.tmp, is fsynced, then renamed
// over `path`, so a reader never sees a half-written shard under its real name.
void write_token_shard(const std::string& path, const uint32_t* tokens, uint64_t n, int width,
                       uint32_t vocab);
// The same, recording the document markers (each < vocab when vocab > 0).
void write_token_shard(const std::string& path, const uint32_t* tokens, uint64_t n, int width, uint32_t vocab,
                       const DocumentMarkers& markers);

// A read-only, memory-mapped shard. The header and the file size are checked
// at open; each failure is a loom::Error naming the file, what was expected
// and what was found. Tokens themselves are checked when they are read
// (copy()), so opening a large shard costs no scan; scan() reads them all
// (what `loom check` does before a run).
//
// The file must not change while it is mapped. Reads that fault because it
// was truncated in place (SIGBUS) become a loom::Error naming the file, and
// verify_unchanged() compares the file at the path with the one opened (device,
// inode, size, modification and change times), so a shard rewritten or
// replaced under a running job is refused instead of trained on.
class TokenShard {
 public:
  explicit TokenShard(const std::string& path);
  ~TokenShard();
  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&& other) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return count_; }   // number of tokens
  int width() const { return width_; }       // 2 or 4
  uint32_t vocab() const { return vocab_; }  // 0 = unknown
  // The document markers the header records; has_markers() is false for a
  // shard written without them.
  bool has_markers() const { return has_markers_; }
  const DocumentMarkers& markers() const { return markers_; }

  // Token i (no bounds check beyond a debug assertion; use copy() for checked reads).
  uint32_t operator[](uint64_t i) const;

  // Copies tokens [begin, begin + n) into `out` as int32. Throws loom::Error
  // naming the file if the range is outside the shard, and naming the file,
  // the token index and the token if a token is >= `limit` (the model
  // vocabulary; the default only rejects ids that do not fit an int32) or >=
  // the vocabulary the header declares (when vocab() > 0: such a token means
  // the shard is damaged, and the message says so rather than asking for a
  // larger model.vocab_size).
  void copy(uint64_t begin, uint64_t n, int32_t* out, int64_t limit = int64_t{1} << 31) const;

  // Reads every token and throws as copy() does at the first one outside the
  // vocabulary (`limit` and the header's); returns the number of tokens read.
  // A max-reduction over the mapping, at memory bandwidth.
  uint64_t scan(int64_t limit = int64_t{1} << 31) const;

  // Throws loom::Error naming the file and what differs when the file at
  // path() is no longer the one opened (a stat of the path; reads nothing).
  void verify_unchanged() const;

 private:
  void close() noexcept;
  [[noreturn]] void throw_changed_while_reading() const;

  // What identifies the opened file: a rewrite in place changes the times
  // (and usually the size), a replacement by rename changes the inode.
  struct Identity {
    uint64_t dev = 0, ino = 0, size = 0;
    int64_t mtime_ns = 0, ctime_ns = 0;
  };

  std::string path_;
  const unsigned char* map_ = nullptr;  // whole file
  std::size_t map_bytes_ = 0;
  uint64_t count_ = 0;
  int width_ = 0;
  uint32_t vocab_ = 0;
  bool has_markers_ = false;
  DocumentMarkers markers_;
  Identity id_;
};

}  // namespace loom
