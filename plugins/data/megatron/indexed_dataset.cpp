#include "data/megatron/indexed_dataset.hpp"

#include <cerrno>
#include <cstring>
#include <utility>

#include <sys/stat.h>
#include <unistd.h>

#include "loom/data.hpp"
#include "loom/error.hpp"
#include "loom/ops/token_scan.hpp"

namespace loom::data {
namespace {

constexpr unsigned char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr uint64_t kHeader = 34;

template <typename T>
T get(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);  // the arrays start at offset 34: unaligned
  return v;
}

MappedFile map_file(const std::string& path, const char* what, const std::string& key) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 && errno == ENOENT)
    throw Error(cat("Megatron dataset ", what, " '", path, "' does not exist; ", key, " names PREFIX of PREFIX.bin ",
                    "and PREFIX.idx (as written by preprocess_data.py --output-prefix, plus _text_document)"));
  // The type is checked before open(): a FIFO would block it for ever.
  return MappedFile(path, cat("Megatron dataset ", what));
}

// The token at p of a dataset of dtype `code`, widened.
inline int64_t token_at(const unsigned char* p, int code) {
  switch (code) {
    case 1: return *p;
    case 2: return static_cast<int8_t>(*p);
    case 3: return get<int16_t>(p);
    case 4: return get<int32_t>(p);
    case 5: return get<int64_t>(p);
    default: return get<uint16_t>(p);
  }
}

}  // namespace

IndexedDataset::IndexedDataset(const std::string& prefix, const std::string& key) : prefix_(prefix) {
  const std::string ip = prefix + ".idx", bp = prefix + ".bin";
  // The usual slip: the prefix given with the file's extension.
  for (const char* ext : {".bin", ".idx"})
    if (prefix.size() > 4 && prefix.ends_with(ext) && ::access(ip.c_str(), F_OK) != 0) {
      const std::string bare = prefix.substr(0, prefix.size() - 4);
      if (::access((bare + ".idx").c_str(), F_OK) == 0)
        throw Error(cat("Megatron dataset prefix '", prefix, "' ends with ", ext, "; ", key, " names PREFIX of PREFIX.bin ",
                        "and PREFIX.idx: write \"", bare, "\""));
    }
  idx_ = map_file(ip, "index", key);
  bin_ = map_file(bp, "data file", key);
  auto bad = [&](const std::string& what) {
    return Error(cat("Megatron index '", ip, "' ", what, "; re-run preprocess_data.py or copy the file again"));
  };
  const unsigned char* idx = idx_.data();
  const uint64_t idx_bytes = idx_.size(), bin_bytes = bin_.size();
  if (idx_bytes < kHeader) throw bad(cat("is truncated: ", idx_bytes, " bytes, less than the 34-byte header"));
  // Everything below reads the index's mapping: a file truncated meanwhile faults.
  bool read = read_guarded([&] {
    if (std::memcmp(idx, kMagic, 9) != 0)
      throw Error(cat("'", ip, "' is not a Megatron index: bad magic (expected \"MMIDIDX\\0\\0\"); data.prefix must name ",
                      "a dataset written by Megatron's or PaddleNLP's preprocess_data.py"));
    const uint64_t version = get<uint64_t>(idx + 9);
    if (version != 1) throw bad(cat("has version ", version, "; loom reads version 1"));
    dtype_ = idx[17];
    n_ = get<uint64_t>(idx + 18);
    d_ = get<uint64_t>(idx + 26);
  });
  if (!read) throw_read_fault();
  switch (dtype_) {
    case 1: case 2: item_ = 1; break;
    case 3: case 8: item_ = 2; break;
    case 4: item_ = 4; break;
    case 5: item_ = 8; break;
    case 6: case 7:
      throw bad(cat("holds floating-point values (dtype code ", dtype_, "), not token ids"));
    default: throw bad(cat("has unknown dtype code ", dtype_, " (known: 1-8)"));
  }
  const uint64_t limit = (uint64_t{1} << 58);
  if (n_ > limit || d_ > limit) throw bad(cat("has an impossible header: ", n_, " sequences, ", d_, " document indices"));
  const uint64_t want = kHeader + 12 * n_ + 8 * d_;
  if (idx_bytes != want)
    throw bad(cat(idx_bytes < want ? "is truncated" : "is longer than its header says", ": header says ", n_,
                  " sequences and ", d_, " document indices (", want, " bytes) but the file has ", idx_bytes, " bytes"));
  if (n_ == 0) throw bad("holds no sequences");
  if (d_ < 1) throw bad("has no document indices (at least [0, N] expected)");
  // Sizes and pointers: every sequence lies inside PREFIX.bin, right after
  // the one before it (the writers lay them out back to back from byte 0),
  // and together they fill PREFIX.bin. A pointer that disagrees with the
  // sizes before it means a damaged index, and one that is merely in bounds
  // would read another sequence's tokens without a word. Found while reading
  // the mapping, thrown after it (a message is built outside the guarded read).
  uint64_t at = 0, expect = 0;
  int32_t len = 0;
  int64_t ptr = 0, doc = 0, prev = -1;
  enum { none, negative, past_end, disagree, short_cover, bad_doc, doc_end } fault = none;
  const unsigned char* sizes = idx + kHeader;
  const unsigned char* ptrs = sizes + 4 * n_;
  const unsigned char* docs = ptrs + 8 * n_;
  read = read_guarded([&] {
    for (uint64_t i = 0; i < n_; ++i) {
      len = get<int32_t>(sizes + 4 * i);
      ptr = get<int64_t>(ptrs + 8 * i);
      at = i;
      if (len < 0) { fault = negative; return; }
      const uint64_t end = static_cast<uint64_t>(ptr) + static_cast<uint64_t>(len) * static_cast<uint64_t>(item_);
      if (ptr < 0 || end > bin_bytes) { fault = past_end; return; }
      if (static_cast<uint64_t>(ptr) != expect) { fault = disagree; return; }
      expect = end;
      total_ += static_cast<uint64_t>(len);
    }
    if (expect != bin_bytes) { fault = short_cover; return; }
    for (uint64_t i = 0; i < d_; ++i) {
      doc = get<int64_t>(docs + 8 * i);
      at = i;
      if (doc < prev || doc < 0 || static_cast<uint64_t>(doc) > n_ || (i == 0 && doc != 0)) { fault = bad_doc; return; }
      prev = doc;
    }
    if (static_cast<uint64_t>(prev) != n_) fault = doc_end;
  });
  if (!read) throw_read_fault();
  switch (fault) {
    case none: break;
    case negative: throw bad(cat("gives sequence ", at, " a negative length (", len, ")"));
    case past_end: {
      const uint64_t end = static_cast<uint64_t>(ptr) + static_cast<uint64_t>(len) * static_cast<uint64_t>(item_);
      throw bad(cat("points past the end of '", bp, "': sequence ", at, " at byte ", ptr, " with ", len, " tokens of ",
                    item_, " bytes ends at ", end, ", the file has ", bin_bytes, " bytes (is the .bin truncated?)"));
    }
    case disagree:
      throw bad(cat("has sizes and pointers that disagree: sequence ", at, " starts at byte ", ptr, " of '", bp,
                    "' but the sizes before it end at byte ", expect));
    case short_cover:
      throw bad(cat("covers ", expect, " bytes of '", bp, "' but that file has ", bin_bytes,
                    " bytes; the .bin and .idx do not belong together (written by different runs, or one copied "
                    "incompletely)"));
    case bad_doc:
      throw bad(cat("has bad document indices: entry ", at, " is ", doc, " (they must rise from 0 to the sequence count ",
                    n_, ")"));
    case doc_end: throw bad(cat("has document indices ending at ", prev, ", not at the sequence count ", n_));
  }
}

const char* IndexedDataset::dtype_name() const {
  switch (dtype_) {
    case 1: return "uint8";
    case 2: return "int8";
    case 3: return "int16";
    case 4: return "int32";
    case 5: return "int64";
    case 8: return "uint16";
    default: return "?";
  }
}

uint32_t IndexedDataset::length(uint64_t seq) const {
  uint32_t len = 0;
  if (!read_guarded([&] { len = static_cast<uint32_t>(get<int32_t>(idx_.data() + kHeader + 4 * seq)); }))
    throw_read_fault();
  return len;
}

uint64_t IndexedDataset::tokens(uint64_t begin, uint64_t end) const {
  uint64_t sum = 0;
  const unsigned char* sizes = idx_.data() + kHeader;
  if (!read_guarded([&] {
        for (uint64_t i = begin; i < end; ++i) sum += static_cast<uint32_t>(get<int32_t>(sizes + 4 * i));
      }))
    throw_read_fault();
  return sum;
}

// Unguarded: the callers read it inside their own guarded read.
uint64_t IndexedDataset::pointer(uint64_t seq) const {
  return static_cast<uint64_t>(get<int64_t>(idx_.data() + kHeader + 4 * n_ + 8 * seq));
}

void IndexedDataset::read(uint64_t seq, uint64_t offset, uint64_t n, int32_t* out, int64_t limit) const {
  if (seq >= n_ || offset + n > length(seq))
    throw Error(cat("Megatron dataset '", prefix_, "': read of tokens [", offset, ", ", offset + n, ") of sequence ", seq,
                    " is outside it"));
  uint64_t bad = n;
  int64_t bad_token = 0;
  const bool read = read_guarded([&] {
    const unsigned char* p = bin_.data() + pointer(seq) + offset * static_cast<uint64_t>(item_);
    for (uint64_t i = 0; i < n; ++i, p += item_) {
      const int64_t t = token_at(p, dtype_);
      if (t < 0 || t >= limit) {
        bad = i;
        bad_token = t;
        return;
      }
      out[i] = static_cast<int32_t>(t);
    }
  });
  if (!read) throw_read_fault();
  if (bad < n) throw_bad_token(seq, offset + bad, bad_token, limit);
}

uint64_t IndexedDataset::scan(uint64_t begin, uint64_t end, int64_t limit) const {
  if (begin >= end) return 0;
  const uint64_t count = tokens(begin, end);
  uint64_t bad = count, first = 0;
  const bool read = read_guarded([&] {
    // The sequences lie back to back in whole tokens from byte 0 of a
    // page-aligned mapping: one run of tokens, each aligned to its size.
    first = pointer(begin);
    const unsigned char* p = bin_.data() + first;
    switch (dtype_) {
      case 1: bad = first_token_outside(reinterpret_cast<const uint8_t*>(p), count, limit); break;
      case 2: bad = first_token_outside(reinterpret_cast<const int8_t*>(p), count, limit); break;
      case 3: bad = first_token_outside(reinterpret_cast<const int16_t*>(p), count, limit); break;
      case 4: bad = first_token_outside(reinterpret_cast<const int32_t*>(p), count, limit); break;
      case 5: bad = first_token_outside(reinterpret_cast<const int64_t*>(p), count, limit); break;
      default: bad = first_token_outside(reinterpret_cast<const uint16_t*>(p), count, limit); break;
    }
  });
  if (!read) throw_read_fault();
  if (bad == count) return count;
  // Which sequence holds it: the last in [begin, end) that starts at or
  // before its byte (sequences of length 0 start where the next one does).
  const uint64_t byte = first + bad * static_cast<uint64_t>(item_);
  uint64_t lo = begin, hi = end, seq_start = 0;
  int64_t t = 0;
  if (!read_guarded([&] {
        while (hi - lo > 1) {
          const uint64_t mid = lo + (hi - lo) / 2;
          if (pointer(mid) <= byte) lo = mid;
          else hi = mid;
        }
        seq_start = pointer(lo);
        t = token_at(bin_.data() + byte, dtype_);
      }))
    throw_read_fault();
  throw_bad_token(lo, (byte - seq_start) / static_cast<uint64_t>(item_), t, limit);
}

void IndexedDataset::verify_unchanged() const {
  idx_.verify_unchanged("sample order");
  bin_.verify_unchanged("sample order");
}

void IndexedDataset::throw_read_fault() const {
  if (idx_.shrunk()) idx_.throw_read_fault();
  bin_.throw_read_fault();
}

void IndexedDataset::throw_bad_token(uint64_t seq, uint64_t offset, int64_t t, int64_t limit) const {
  throw Error(cat("Megatron dataset '", prefix_, ".bin': token ", offset, " of sequence ", seq, " is ", t,
                  ", not in [0, ", limit, ") (the model's vocab_size); ",
                  t < 0 || t >= kMaxVocabSize
                      ? cat("no model.vocab_size can hold it (at most ", kMaxVocabSize,
                            ": token ids are int32): the data is damaged or was made with another tokenizer")
                      : cat("the data was made with another tokenizer, or model.vocab_size is too small (set it >= ",
                            t + 1, ")")));
}

}  // namespace loom::data
