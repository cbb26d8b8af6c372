// Read-only memory mappings of data files (token shards, Megatron .bin/.idx)
// that survive the file changing under them. Part of the SDK: any data
// source that maps its files gets the same guard and identity check.
//
// A mapped file that is truncated in place makes the next read of a page past
// the new end fault with SIGBUS, which would kill the process with "Bus
// error" and no word about the file. Reads go through read_guarded(): the
// fault jumps back to it and it returns false, so the reader can throw an
// error naming the file (MappedFile::throw_read_fault). A file rewritten in
// place with other bytes, or replaced by another file at the same path, does
// not fault at all; MappedFile::verify_unchanged() compares the file at the
// path with the one opened (device, inode, size, modification and change
// times), and the data sources call it at every epoch, validation pass and
// checkpoint.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include <sys/stat.h>

namespace loom {

namespace detail {
bool read_guarded_impl(void (*fn)(void*), void* ctx);
}

// Runs f(), which reads one or more mappings, and returns true; returns false
// when a read of it faulted with SIGBUS (a file truncated under its mapping).
// A fault abandons f() where it stands, without unwinding: while f() reads a
// mapping it must hold nothing that needs destroying (no strings, vectors or
// locks of its own). Exceptions thrown by f() pass through. Thread-safe; the
// SIGBUS handler is installed on first use and hands faults that are not
// inside a guarded read to the handler that was there before.
template <typename F>
bool read_guarded(F&& f) {
  return detail::read_guarded_impl([](void* c) { (*static_cast<std::remove_reference_t<F>*>(c))(); },
                                   const_cast<void*>(static_cast<const void*>(&f)));
}

// What identifies an opened file: a rewrite in place changes the times (and
// usually the size), a replacement by rename changes the inode.
struct FileIdentity {
  uint64_t dev = 0, ino = 0, size = 0;
  int64_t mtime_ns = 0, ctime_ns = 0;
  static FileIdentity of(const struct ::stat& st);
  // What differs between the file now at `path` and this one ("its size
  // changed from 4096 to 0 bytes", ...), or "" when it is the same file. Only
  // stat()s the path.
  std::string change_at(const std::string& path) const;
};

// The messages of the two faults, the same for every data file. `what` names
// the kind of file ("token shard"), `uses` what the run bases on it ("window
// order").
std::string changed_on_disk_message(const std::string& what, const std::string& path, const std::string& change,
                                    const std::string& uses);
std::string read_fault_message(const std::string& what, const std::string& path, uint64_t opened_bytes);

class MappedFile {
 public:
  MappedFile() = default;
  // Opens `path` (a regular file only: open_regular_file, so a FIFO cannot
  // block) and maps all of it read-only. `what` names the file in every
  // message ("Megatron index"). An empty file has no mapping (data() is
  // null). Throws loom::Error naming `what` and the path.
  MappedFile(const std::string& path, const std::string& what);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const unsigned char* data() const { return data_; }
  std::size_t size() const { return static_cast<std::size_t>(id_.size); }  // bytes when opened

  std::string change() const { return id_.change_at(path_); }
  // Throws loom::Error naming the file and what changed when change() is not "".
  void verify_unchanged(const std::string& uses) const;
  // True when the file at path() is now shorter than when opened, or gone
  // (what makes reads of its mapping fault).
  bool shrunk() const;
  // The error for a read of this mapping that faulted (read_guarded returned false).
  [[noreturn]] void throw_read_fault() const;

 private:
  void close() noexcept;

  std::string path_, what_;
  const unsigned char* data_ = nullptr;
  FileIdentity id_;
};

}  // namespace loom
