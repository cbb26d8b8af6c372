#include "checkpoint/file_util.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "loom/error.hpp"
#include "util/files.hpp"

namespace loom::ckpt {
namespace {

std::string errno_str() { return std::strerror(errno); }

std::string parent_dir(const std::string& path) {
  auto p = std::filesystem::path(path).parent_path();
  return p.empty() ? std::string(".") : p.string();
}

}  // namespace

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
  // A fresh file of our own: a leftover tmp (a killed write) is removed, and
  // O_EXCL | O_NOFOLLOW never follow a symbolic link planted under the tmp
  // name — O_TRUNC through it would overwrite whatever file it points to.
  if (::unlink(tmp_.c_str()) != 0 && errno != ENOENT && errno != EISDIR && errno != EPERM)
    throw Error(cat("cannot remove the leftover ", tmp_, ": ", errno_str(), "; remove it, or check permissions"));
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    if (errno == EEXIST)
      throw Error(cat("cannot create ", tmp_, ": something that is not a file (a folder?) is in the way; "
                      "move it away"));
    throw Error(cat("cannot create ", tmp_, ": ", errno_str(),
                    "; check that the directory exists, is writable and the disk is not full"));
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFile::write(const void* data, size_t bytes) {
  LOOM_CHECK(fd_ >= 0, "write to ", path_, " after commit");
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    // write() may be partial for large buffers (Linux caps one call at ~2 GiB).
    size_t chunk = bytes < (size_t{1} << 30) ? bytes : (size_t{1} << 30);
    ssize_t n = ::write(fd_, p, chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(cat("writing ", tmp_, " failed after ", written_, " bytes: ", errno_str(),
                      "; free disk space or choose another directory (the previous ", path_,
                      ", if any, is untouched)"));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
    written_ += static_cast<size_t>(n);
  }
}

void AtomicFile::commit() {
  LOOM_CHECK(fd_ >= 0, "commit of ", path_, " twice");
  if (::fsync(fd_) != 0)
    throw Error(cat("fsync of ", tmp_, " failed: ", errno_str(), "; the file system may be full or failing"));
  int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    ::unlink(tmp_.c_str());
    throw Error(cat("closing ", tmp_, " failed: ", errno_str()));
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    std::string e = errno_str();
    ::unlink(tmp_.c_str());
    throw Error(cat("renaming ", tmp_, " to ", path_, " failed: ", e));
  }
  fsync_dir(parent_dir(path_));
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw Error(cat("cannot open directory ", dir, " to fsync it: ", errno_str()));
  int rc = ::fsync(fd);
  // Some file systems (e.g. certain network mounts) do not support fsync on
  // directories; EINVAL there means "nothing to do", not a lost write.
  int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL && err != ENOTSUP)
    throw Error(cat("fsync of directory ", dir, " failed: ", std::strerror(err)));
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  AtomicFile f(path);
  f.write(contents);
  f.commit();
}

std::string read_file(const std::string& path, const std::string& what) {
  // Metadata files are small; the bound keeps a wrong path (a device, a huge
  // file) from being read until memory runs out, and a FIFO from blocking.
  return read_bounded_file(path, what, size_t{256} << 20);
}

uint32_t crc32(const void* data, size_t bytes, uint32_t crc) {
  // Slicing-by-8 tables: checkpoints of several GB are checksummed on every
  // write and read, so the byte-at-a-time loop (~0.5 GB/s) would dominate.
  static const auto tables = [] {
    std::array<std::array<uint32_t, 256>, 8> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    return t;
  }();
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  while (bytes >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;  // little-endian hosts only (checked in the checkpoint format)
    c = tables[7][lo & 0xFF] ^ tables[6][(lo >> 8) & 0xFF] ^ tables[5][(lo >> 16) & 0xFF] ^ tables[4][lo >> 24] ^
        tables[3][hi & 0xFF] ^ tables[2][(hi >> 8) & 0xFF] ^ tables[1][(hi >> 16) & 0xFF] ^ tables[0][hi >> 24];
    p += 8;
    bytes -= 8;
  }
  while (bytes--) c = tables[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
  return ~c;
}

}  // namespace loom::ckpt
