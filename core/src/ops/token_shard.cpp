// Token shard reading (mmap) and writing (tmp + fsync + rename); the format is
// documented in loom/token_shard.hpp.
#include "loom/token_shard.hpp"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "loom/data.hpp"
#include "loom/error.hpp"
#include "loom/mapped_file.hpp"
#include "loom/ops/token_scan.hpp"
#include "util/files.hpp"

namespace loom {

// Tokens are read straight from the mapping; a big-endian host would need a
// byte swap on every read, which nobody runs this trainer on.
static_assert(std::endian::native == std::endian::little, "token shards assume a little-endian host");

namespace {

std::string errno_text() { return std::strerror(errno); }

template <typename T>
void put(unsigned char* dst, T v) {
  std::memcpy(dst, &v, sizeof(T));
}
template <typename T>
T get(const unsigned char* src) {
  T v;
  std::memcpy(&v, src, sizeof(T));
  return v;
}

// Writes all of buf, retrying short writes (large shards exceed one write()).
void write_all(int fd, const void* buf, std::size_t n, const std::string& path) {
  auto* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw Error(cat("cannot write token shard '", path, "': ", errno_text(),
                      "; check free disk space and permissions"));
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

// Header flag bit 0: the shard records BOS and EOS at bytes 32 and 36.
constexpr uint32_t kMarkersFlag = 1;

void write_shard(const std::string& path, const uint32_t* tokens, uint64_t n, int width, uint32_t vocab,
                 const DocumentMarkers* markers);

std::string magic_text(const unsigned char* m) {
  std::string s;
  for (int i = 0; i < 8; ++i) {
    unsigned char c = m[i];
    if (c >= 32 && c < 127) s += static_cast<char>(c);
    else s += cat("\\x", "0123456789abcdef"[c >> 4], "0123456789abcdef"[c & 15]);
  }
  return s;
}

}  // namespace

void write_token_shard(const std::string& path, const uint32_t* tokens, uint64_t n, int width,
                       uint32_t vocab) {
  write_shard(path, tokens, n, width, vocab, nullptr);
}

void write_token_shard(const std::string& path, const uint32_t* tokens, uint64_t n, int width, uint32_t vocab,
                       const DocumentMarkers& markers) {
  for (const auto& [what, id] : {std::pair{"BOS", markers.bos}, std::pair{"EOS", markers.eos}})
    if (vocab > 0 && id >= vocab)
      throw Error(cat("cannot write token shard '", path, "': its ", what, " id ", id, " is outside the vocabulary (",
                      vocab, ")"));
  write_shard(path, tokens, n, width, vocab, &markers);
}

namespace {

void write_shard(const std::string& path, const uint32_t* tokens, uint64_t n, int width, uint32_t vocab,
                 const DocumentMarkers* markers) {
  if (width != 2 && width != 4)
    throw Error(cat("cannot write token shard '", path, "': token width ", width,
                    " is not supported; use 2 (ids < 65536) or 4"));
  const uint64_t max_id = width == 2 ? 0xffffull : 0xffffffffull;
  if (vocab > 0 && vocab - 1 > max_id)
    throw Error(cat("cannot write token shard '", path, "': vocabulary ", vocab, " does not fit ", width,
                    "-byte tokens; use width 4"));
  for (uint64_t i = 0; i < n; ++i) {
    if (tokens[i] > max_id)
      throw Error(cat("cannot write token shard '", path, "': token ", i, " = ", tokens[i], " does not fit ",
                      width, "-byte tokens; use width 4"));
    if (vocab > 0 && tokens[i] >= vocab)
      throw Error(cat("cannot write token shard '", path, "': token ", i, " = ", tokens[i],
                      " is outside the vocabulary (", vocab, ")"));
  }

  unsigned char header[kTokenShardHeaderBytes] = {};
  std::memcpy(header, kTokenShardMagic, 8);
  put<uint32_t>(header + 8, kTokenShardVersion);
  put<uint32_t>(header + 12, static_cast<uint32_t>(width));
  put<uint64_t>(header + 16, n);
  put<uint32_t>(header + 24, vocab);
  if (markers) {
    put<uint32_t>(header + 28, kMarkersFlag);
    put<uint32_t>(header + 32, markers->bos);
    put<uint32_t>(header + 36, markers->eos);
  }

  const std::string tmp = path + ".tmp";
  // A fresh file of our own (as ckpt::AtomicFile): O_TRUNC through a symbolic
  // link planted under the tmp name would overwrite the file it points to.
  (void)::unlink(tmp.c_str());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0)
    throw Error(cat("cannot create token shard '", tmp, "': ", errno == EEXIST ? std::string("something that is not a "
                    "file (a folder?) is in the way; move it away") : errno_text(),
                    errno == EEXIST ? "" : "; check that the directory exists and is writable"));
  try {
    write_all(fd, header, sizeof header, tmp);
    // Narrow in chunks so that a 16M-token shard does not need a second full copy.
    constexpr uint64_t kChunk = 1 << 20;
    std::vector<unsigned char> buf;
    for (uint64_t start = 0; start < n; start += kChunk) {
      const uint64_t m = std::min(kChunk, n - start);
      if (width == 4) {
        write_all(fd, tokens + start, m * 4, tmp);
        continue;
      }
      buf.resize(m * 2);
      for (uint64_t i = 0; i < m; ++i) put<uint16_t>(buf.data() + 2 * i, static_cast<uint16_t>(tokens[start + i]));
      write_all(fd, buf.data(), buf.size(), tmp);
    }
    if (::fsync(fd) != 0)
      throw Error(cat("cannot flush token shard '", tmp, "' to disk: ", errno_text()));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    throw Error(cat("cannot close token shard '", tmp, "': ", errno_text()));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string why = errno_text();
    ::unlink(tmp.c_str());
    throw Error(cat("cannot rename '", tmp, "' to '", path, "': ", why));
  }
}

}  // namespace

TokenShard::TokenShard(const std::string& path) : path_(path) {
  {
    struct stat pre {};
    if (::stat(path.c_str(), &pre) != 0 && errno == ENOENT)
      throw Error(cat("token shard '", path, "' does not exist; check the path or run loom prepare"));
  }
  // A regular file only: a FIFO named as a shard would block open() forever.
  int fd = open_regular_file(path, "token shard");
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    std::string why = errno_text();
    ::close(fd);
    throw Error(cat("cannot stat token shard '", path, "': ", why));
  }
  {
    const FileIdentity id = FileIdentity::of(st);
    id_ = {id.dev, id.ino, id.size, id.mtime_ns, id.ctime_ns};
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < kTokenShardHeaderBytes) {
    ::close(fd);
    throw Error(cat("token shard '", path, "' is truncated: it has ", file_bytes, " bytes, less than the ",
                    kTokenShardHeaderBytes, "-byte header; re-run loom prepare"));
  }
  void* m = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the file alive
  if (m == MAP_FAILED) throw Error(cat("cannot mmap token shard '", path, "': ", errno_text()));
  map_ = static_cast<const unsigned char*>(m);
  map_bytes_ = file_bytes;
  try {
    if (std::memcmp(map_, kTokenShardMagic, 8) != 0)
      throw Error(cat("'", path, "' is not a Loom token shard: magic is \"", magic_text(map_),
                      "\", expected \"LOOMTOKS\"; write shards with loom prepare or loom::write_token_shard"));
    const uint32_t version = get<uint32_t>(map_ + 8);
    if (version != kTokenShardVersion)
      throw Error(cat("token shard '", path, "' has format version ", version, "; this build reads version ",
                      kTokenShardVersion, "; re-run loom prepare with this build or use a matching loom"));
    const uint32_t width = get<uint32_t>(map_ + 12);
    if (width != 2 && width != 4)
      throw Error(cat("token shard '", path, "' has token width ", width,
                      " bytes; expected 2 or 4 (the header is damaged; re-run loom prepare)"));
    const uint64_t count = get<uint64_t>(map_ + 16);
    const uint64_t max_count = (UINT64_MAX - kTokenShardHeaderBytes) / width;
    const bool overflow = count > max_count;
    const uint64_t expected = overflow ? 0 : kTokenShardHeaderBytes + count * width;
    if (overflow || expected != file_bytes) {
      const bool truncated = overflow || file_bytes < expected;
      throw Error(cat("token shard '", path, "' is ", truncated ? "truncated" : "longer than its header says",
                      ": header says ", count, " tokens of ", width, " bytes (",
                      overflow ? std::string("more than 2^64") : cat(expected), " bytes) but the file has ",
                      file_bytes, " bytes; re-run loom prepare"));
    }
    count_ = count;
    width_ = static_cast<int>(width);
    vocab_ = get<uint32_t>(map_ + 24);
    has_markers_ = (get<uint32_t>(map_ + 28) & kMarkersFlag) != 0;
    if (has_markers_) {
      markers_ = {get<uint32_t>(map_ + 32), get<uint32_t>(map_ + 36)};
      for (const auto& [what, id] : {std::pair{"BOS", markers_.bos}, std::pair{"EOS", markers_.eos}})
        if (vocab_ > 0 && id >= vocab_)
          throw Error(cat("token shard '", path, "' records ", what, " id ", id, " outside its own vocabulary of ",
                          vocab_, " (the header is damaged; re-run loom prepare)"));
    }
  } catch (...) {
    close();
    throw;
  }
}

TokenShard::~TokenShard() { close(); }

TokenShard::TokenShard(TokenShard&& o) noexcept
    : path_(std::move(o.path_)), map_(std::exchange(o.map_, nullptr)), map_bytes_(std::exchange(o.map_bytes_, 0)),
      count_(o.count_), width_(o.width_), vocab_(o.vocab_), has_markers_(o.has_markers_), markers_(o.markers_),
      id_(o.id_) {}

TokenShard& TokenShard::operator=(TokenShard&& o) noexcept {
  if (this != &o) {
    close();
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    map_bytes_ = std::exchange(o.map_bytes_, 0);
    count_ = o.count_;
    width_ = o.width_;
    vocab_ = o.vocab_;
    has_markers_ = o.has_markers_;
    markers_ = o.markers_;
    id_ = o.id_;
  }
  return *this;
}

void TokenShard::close() noexcept {
  if (map_) ::munmap(const_cast<unsigned char*>(map_), map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
}

uint32_t TokenShard::operator[](uint64_t i) const {
  const unsigned char* p = map_ + kTokenShardHeaderBytes + i * static_cast<uint64_t>(width_);
  uint32_t t = 0;
  if (!read_guarded([&] { t = width_ == 2 ? get<uint16_t>(p) : get<uint32_t>(p); })) throw_changed_while_reading();
  return t;
}

namespace {

// The error for token `t` at `index` of shard `path`, outside [0, limit) or
// the header's vocabulary. Which limit it breaks decides what to do: a token
// the shard's own header says cannot exist means the shard is damaged (no
// model.vocab_size would make it right); one beyond the model's vocabulary in
// a shard that declares none asks for the model or the tokenizer to change.
[[noreturn]] void throw_bad_token(const std::string& path, uint64_t index, uint32_t t, uint32_t header_vocab,
                                  int64_t limit) {
  if (header_vocab > 0 && t >= header_vocab)
    throw Error(cat("token shard '", path, "': token at index ", index, " is ", t, ", not below the vocabulary of ",
                    header_vocab, " its header declares: the shard is damaged (its tokens or its header were "
                    "overwritten), whatever model.vocab_size is. Re-run loom prepare, or copy the shard again"));
  if (static_cast<int64_t>(t) >= kMaxVocabSize)  // no model.vocab_size can hold it: token ids are int32
    throw Error(cat("token shard '", path, "': token at index ", index, " is ", t,
                    ", beyond any vocabulary Loom supports (model.vocab_size is at most ", kMaxVocabSize,
                    ": token ids are int32); the shard is damaged or was made with another tokenizer"));
  throw Error(cat("token shard '", path, "': token at index ", index, " is ", t, ", not below the model vocabulary ",
                  limit, " (the shard's header gives no vocabulary); the shard was made with another tokenizer, or "
                  "model.vocab_size is too small (set it >= ", static_cast<int64_t>(t) + 1, ")"));
}

}  // namespace

void TokenShard::copy(uint64_t begin, uint64_t n, int32_t* out, int64_t limit) const {
  if (begin > count_ || n > count_ - begin)
    throw Error(cat("token shard '", path_, "': read of tokens [", begin, ", ", begin + n,
                    ") is outside the shard (", count_, " tokens)"));
  // A header that declares a vocabulary bounds every token too: one at or
  // beyond it is damage, even when the model's vocabulary is larger.
  if (vocab_ > 0) limit = std::min<int64_t>(limit, vocab_);
  uint64_t bad = n;  // index of the first token outside the vocabulary, n if none
  uint32_t bad_token = 0;
  const unsigned char* p = map_ + kTokenShardHeaderBytes + begin * static_cast<uint64_t>(width_);
  const bool read = read_guarded([&] {
    for (uint64_t i = 0; i < n; ++i) {
      const uint32_t t = width_ == 2 ? get<uint16_t>(p + 2 * i) : get<uint32_t>(p + 4 * i);
      if (static_cast<int64_t>(t) >= limit) {
        bad = i;
        bad_token = t;
        break;
      }
      out[i] = static_cast<int32_t>(t);
    }
  });
  if (!read) throw_changed_while_reading();
  if (bad < n) throw_bad_token(path_, begin + bad, bad_token, vocab_, limit);
}

uint64_t TokenShard::scan(int64_t limit) const {
  if (vocab_ > 0) limit = std::min<int64_t>(limit, vocab_);
  const unsigned char* p = map_ + kTokenShardHeaderBytes;
  uint64_t bad = count_;
  const bool read = read_guarded([&] {
    // The tokens start 1024 bytes into a page-aligned mapping: aligned to their width.
    bad = width_ == 2 ? data::first_token_outside(reinterpret_cast<const uint16_t*>(p), count_, limit)
                      : data::first_token_outside(reinterpret_cast<const uint32_t*>(p), count_, limit);
  });
  if (!read) throw_changed_while_reading();
  if (bad < count_) throw_bad_token(path_, bad, (*this)[bad], vocab_, limit);
  return count_;
}

void TokenShard::throw_changed_while_reading() const {
  throw Error(read_fault_message("token shard", path_, id_.size));
}

void TokenShard::verify_unchanged() const {
  const FileIdentity id{id_.dev, id_.ino, id_.size, id_.mtime_ns, id_.ctime_ns};
  const std::string what = id.change_at(path_);
  if (!what.empty()) throw Error(changed_on_disk_message("token shard", path_, what, "window order"));
}

}  // namespace loom
