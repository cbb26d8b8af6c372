// File helpers shared by checkpoints and HF export: crash-safe writes
// (tmp + fsync + rename + fsync of the directory), CRC32, whole-file reads.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace loom::ckpt {

// Writes `path` so that a crash at any point leaves either the old file (or
// none) or the complete new one, never a torn file: the bytes go to
// `path.tmp`, which is fsynced, renamed over `path`, and the directory is
// fsynced so the rename itself survives a power loss. If the object is
// destroyed before commit() (an exception while writing), the tmp file is
// removed and `path` is untouched.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile();

  void write(const void* data, size_t bytes);
  void write(const std::string& s) { write(s.data(), s.size()); }
  size_t written() const { return written_; }
  void commit();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string tmp_;
  int fd_ = -1;
  size_t written_ = 0;
};

// fsync a directory so that entries created/renamed in it are durable.
void fsync_dir(const std::string& dir);

// Writes a whole file atomically (see AtomicFile).
void write_file_atomic(const std::string& path, const std::string& contents);

// Reads a whole file; throws loom::Error naming `what` (e.g. "config.json") and the path.
std::string read_file(const std::string& path, const std::string& what);

// CRC-32 (IEEE 802.3, the zlib/PNG polynomial); chain calls through `crc`.
uint32_t crc32(const void* data, size_t bytes, uint32_t crc = 0);

}  // namespace loom::ckpt
