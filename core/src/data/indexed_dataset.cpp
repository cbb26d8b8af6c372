#include "data/indexed_dataset.hpp"

#include <cerrno>
#include <cstring>
#include <utility>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config/run_config.hpp"
#include "loom/error.hpp"
#include "util/files.hpp"

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

}  // namespace

IndexedDataset::Map IndexedDataset::map_file(const std::string& path, const char* what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 && errno == ENOENT)
    throw Error(cat("Megatron dataset ", what, " '", path, "' does not exist; data.prefix names PREFIX of PREFIX.bin ",
                    "and PREFIX.idx (as written by preprocess_data.py --output-prefix, plus _text_document)"));
  // The type is checked before open(): a FIFO would block it for ever.
  const int fd = open_regular_file(path, cat("Megatron dataset ", what));
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error(cat("cannot stat Megatron dataset ", what, " '", path, "': ", std::strerror(e)));
  }
  Map m;
  m.bytes = static_cast<std::size_t>(st.st_size);
  if (m.bytes > 0) {
    void* p = ::mmap(nullptr, m.bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      throw Error(cat("cannot mmap Megatron dataset ", what, " '", path, "': ", why));
    }
    m.data = static_cast<const unsigned char*>(p);
  }
  ::close(fd);
  return m;
}

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  const std::string ip = prefix + ".idx", bp = prefix + ".bin";
  // The usual slip: the prefix given with the file's extension.
  for (const char* ext : {".bin", ".idx"})
    if (prefix.size() > 4 && prefix.ends_with(ext) && ::access(ip.c_str(), F_OK) != 0) {
      const std::string bare = prefix.substr(0, prefix.size() - 4);
      if (::access((bare + ".idx").c_str(), F_OK) == 0)
        throw Error(cat("Megatron dataset prefix '", prefix, "' ends with ", ext, "; data.prefix names PREFIX of PREFIX.bin ",
                        "and PREFIX.idx: write \"", bare, "\""));
    }
  idx_ = map_file(ip, "index");
  try {
    bin_ = map_file(bp, "data file");
    auto bad = [&](const std::string& what) {
      return Error(cat("Megatron index '", ip, "' ", what, "; re-run preprocess_data.py or copy the file again"));
    };
    if (idx_.bytes < kHeader) throw bad(cat("is truncated: ", idx_.bytes, " bytes, less than the 34-byte header"));
    if (std::memcmp(idx_.data, kMagic, 9) != 0)
      throw Error(cat("'", ip, "' is not a Megatron index: bad magic (expected \"MMIDIDX\\0\\0\"); data.prefix must name ",
                      "a dataset written by Megatron's or PaddleNLP's preprocess_data.py"));
    const uint64_t version = get<uint64_t>(idx_.data + 9);
    if (version != 1) throw bad(cat("has version ", version, "; loom reads version 1"));
    dtype_ = idx_.data[17];
    switch (dtype_) {
      case 1: case 2: item_ = 1; break;
      case 3: case 8: item_ = 2; break;
      case 4: item_ = 4; break;
      case 5: item_ = 8; break;
      case 6: case 7:
        throw bad(cat("holds floating-point values (dtype code ", dtype_, "), not token ids"));
      default: throw bad(cat("has unknown dtype code ", dtype_, " (known: 1-8)"));
    }
    n_ = get<uint64_t>(idx_.data + 18);
    d_ = get<uint64_t>(idx_.data + 26);
    const uint64_t limit = (uint64_t{1} << 58);
    if (n_ > limit || d_ > limit) throw bad(cat("has an impossible header: ", n_, " sequences, ", d_, " document indices"));
    const uint64_t want = kHeader + 12 * n_ + 8 * d_;
    if (idx_.bytes != want)
      throw bad(cat(idx_.bytes < want ? "is truncated" : "is longer than its header says", ": header says ", n_,
                    " sequences and ", d_, " document indices (", want, " bytes) but the file has ", idx_.bytes, " bytes"));
    if (n_ == 0) throw bad("holds no sequences");
    // Sizes and pointers: every sequence lies inside PREFIX.bin, right after
    // the one before it (the writers lay them out back to back from byte 0),
    // and together they fill PREFIX.bin. A pointer that disagrees with the
    // sizes before it means a damaged index, and one that is merely in bounds
    // would read another sequence's tokens without a word.
    const unsigned char* sizes = idx_.data + kHeader;
    const unsigned char* ptrs = sizes + 4 * n_;
    uint64_t expect = 0;
    for (uint64_t i = 0; i < n_; ++i) {
      const int32_t len = get<int32_t>(sizes + 4 * i);
      const int64_t ptr = get<int64_t>(ptrs + 8 * i);
      if (len < 0) throw bad(cat("gives sequence ", i, " a negative length (", len, ")"));
      const uint64_t end = static_cast<uint64_t>(ptr) + static_cast<uint64_t>(len) * static_cast<uint64_t>(item_);
      if (ptr < 0 || end > bin_.bytes)
        throw bad(cat("points past the end of '", bp, "': sequence ", i, " at byte ", ptr, " with ", len, " tokens of ",
                      item_, " bytes ends at ", end, ", the file has ", bin_.bytes, " bytes (is the .bin truncated?)"));
      if (static_cast<uint64_t>(ptr) != expect)
        throw bad(cat("has sizes and pointers that disagree: sequence ", i, " starts at byte ", ptr, " of '", bp,
                      "' but the sizes before it end at byte ", expect));
      expect = end;
      total_ += static_cast<uint64_t>(len);
    }
    if (expect != bin_.bytes)
      throw bad(cat("covers ", expect, " bytes of '", bp, "' but that file has ", bin_.bytes,
                    " bytes; the .bin and .idx do not belong together (written by different runs, or one copied "
                    "incompletely)"));
    const unsigned char* docs = ptrs + 8 * n_;
    if (d_ < 1) throw bad("has no document indices (at least [0, N] expected)");
    int64_t prev = -1;
    for (uint64_t i = 0; i < d_; ++i) {
      const int64_t v = get<int64_t>(docs + 8 * i);
      if (v < prev || v < 0 || static_cast<uint64_t>(v) > n_ || (i == 0 && v != 0))
        throw bad(cat("has bad document indices: entry ", i, " is ", v, " (they must rise from 0 to the sequence count ", n_, ")"));
      prev = v;
    }
    if (static_cast<uint64_t>(prev) != n_)
      throw bad(cat("has document indices ending at ", prev, ", not at the sequence count ", n_));
  } catch (...) {
    unmap();
    throw;
  }
}

IndexedDataset::~IndexedDataset() { unmap(); }

void IndexedDataset::unmap() noexcept {
  if (idx_.data) ::munmap(const_cast<unsigned char*>(idx_.data), idx_.bytes);
  if (bin_.data) ::munmap(const_cast<unsigned char*>(bin_.data), bin_.bytes);
  idx_ = {};
  bin_ = {};
}

IndexedDataset::IndexedDataset(IndexedDataset&& o) noexcept
    : prefix_(std::move(o.prefix_)), idx_(std::exchange(o.idx_, {})), bin_(std::exchange(o.bin_, {})), n_(o.n_),
      d_(o.d_), total_(o.total_), dtype_(o.dtype_), item_(o.item_) {}

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
  return static_cast<uint32_t>(get<int32_t>(idx_.data + kHeader + 4 * seq));
}

uint64_t IndexedDataset::pointer(uint64_t seq) const {
  return static_cast<uint64_t>(get<int64_t>(idx_.data + kHeader + 4 * n_ + 8 * seq));
}

void IndexedDataset::read(uint64_t seq, uint64_t offset, uint64_t n, int32_t* out, int64_t limit) const {
  if (seq >= n_ || offset + n > length(seq))
    throw Error(cat("Megatron dataset '", prefix_, "': read of tokens [", offset, ", ", offset + n, ") of sequence ", seq,
                    " is outside it"));
  const unsigned char* p = bin_.data + pointer(seq) + offset * static_cast<uint64_t>(item_);
  for (uint64_t i = 0; i < n; ++i, p += item_) {
    int64_t t;
    switch (dtype_) {
      case 1: t = *p; break;
      case 2: t = static_cast<int8_t>(*p); break;
      case 3: t = get<int16_t>(p); break;
      case 4: t = get<int32_t>(p); break;
      case 5: t = get<int64_t>(p); break;
      default: t = get<uint16_t>(p); break;
    }
    if (t < 0 || t >= limit)
      throw Error(cat("Megatron dataset '", prefix_, ".bin': token ", offset + i, " of sequence ", seq, " is ", t,
                      ", not in [0, ", limit, ") (the model's vocab_size); ",
                      t < 0 || t >= kMaxVocabSize
                          ? cat("no model.vocab_size can hold it (at most ", kMaxVocabSize,
                                ": token ids are int32): the data is damaged or was made with another tokenizer")
                          : cat("the data was made with another tokenizer, or model.vocab_size is too small (set it >= ",
                                t + 1, ")")));
    out[i] = static_cast<int32_t>(t);
  }
}

}  // namespace loom::data
