#include "util/files.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "loom/error.hpp"

namespace loom {

std::string file_type_name(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

namespace {

std::string not_regular(const std::string& path, const std::string& what, mode_t mode) {
  return cat(what, " '", path, "' is ", file_type_name(mode),
             ", not a regular file: Loom reads its inputs as ordinary files (a pipe or device could block or never "
             "end). Write it to a file first and give that path");
}

}  // namespace

void require_regular_file(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int e = errno;
    if (e == ENOENT) throw Error(cat("cannot open ", what, " '", path, "': it does not exist"));
    throw Error(cat("cannot stat ", what, " '", path, "': ", std::strerror(e)));
  }
  if (!S_ISREG(st.st_mode)) throw Error(not_regular(path, what, st.st_mode));
}

int open_regular_file(const std::string& path, const std::string& what) {
  // stat first: opening a FIFO for reading blocks until a writer appears, and
  // opening some devices has side effects.
  require_regular_file(path, what);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int e = errno;
    throw Error(cat("cannot open ", what, " '", path, "': ", std::strerror(e)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const mode_t mode = st.st_mode;
    ::close(fd);
    throw Error(not_regular(path, what, mode));
  }
  // Regular files ignore O_NONBLOCK; clear it anyway so later reads are plain.
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) (void)::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

std::string read_bounded_file(const std::string& path, const std::string& what, size_t max_bytes) {
  const int fd = open_regular_file(path, what);
  auto too_large = [&] {
    return Error(cat(what, " '", path, "' is larger than ", max_bytes >> 20, " MiB, far beyond what such a file "
                     "holds: check that the path names the right file"));
  };
  // A file that says it is too large is refused before a byte is read.
  if (struct stat st {}; ::fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    throw too_large();
  }
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      ::close(fd);
      throw Error(cat("reading ", what, " '", path, "' failed: ", std::strerror(e)));
    }
    if (n == 0) break;
    // Checked while reading, not from st_size: files under /proc report size 0.
    if (out.size() + static_cast<size_t>(n) > max_bytes) {
      ::close(fd);
      throw too_large();
    }
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

}  // namespace loom
