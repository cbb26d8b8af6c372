#include "loom/mapped_file.hpp"

#include <cerrno>
#include <csetjmp>
#include <csignal>
#include <cstring>
#include <mutex>
#include <utility>

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "loom/error.hpp"
#include "util/files.hpp"

namespace loom {
namespace {

// Reads of a mapping whose file was truncated in place fault with SIGBUS. A
// guarded read arms a jump buffer for its thread; the handler jumps back there
// and the read returns false. SIGBUS from a memory access is synchronous, so
// the handler runs on the faulting thread, whose buffer is armed. Initial-exec
// TLS so that the handler never allocates the variable (libloom is linked, not
// dlopened). Volatile: the reader's stores to it are read only by the handler,
// so the compiler would otherwise drop them as dead.
__attribute__((tls_model("initial-exec"))) thread_local sigjmp_buf* volatile t_bus_jump = nullptr;
struct sigaction g_prev_bus {};

void on_sigbus(int sig, siginfo_t* info, void* uctx) {
  if (sigjmp_buf* j = t_bus_jump) siglongjmp(*j, 1);
  // Not a guarded read: behave as if this handler did not exist.
  if (g_prev_bus.sa_flags & SA_SIGINFO) {
    if (g_prev_bus.sa_sigaction) return g_prev_bus.sa_sigaction(sig, info, uctx);
  } else if (g_prev_bus.sa_handler != SIG_DFL && g_prev_bus.sa_handler != SIG_IGN) {
    return g_prev_bus.sa_handler(sig);
  }
  ::signal(SIGBUS, SIG_DFL);  // returning re-runs the faulting access, which now ends the process as before
}

void install_bus_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    // NODEFER: SIGBUS stays unblocked after the jump, which then needs no
    // signal-mask system call (sigsetjmp(..., 0) below).
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (::sigaction(SIGBUS, &sa, &g_prev_bus) != 0)
      throw Error(cat("cannot install the SIGBUS handler that guards reads of memory-mapped data files: ",
                      std::strerror(errno)));
  });
}

// Clears the thread's jump buffer on every way out of a guarded read.
struct BusGuard {
  ~BusGuard() { t_bus_jump = nullptr; }
};

int64_t ns(const struct timespec& t) { return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec; }

}  // namespace

namespace detail {

bool read_guarded_impl(void (*fn)(void*), void* ctx) {
  install_bus_handler();
  // Guarded reads do not nest: an inner one would disarm the outer's buffer
  // on its way out. Keep the outer buffer and restore it.
  sigjmp_buf* const outer = t_bus_jump;
  struct Restore {
    sigjmp_buf* outer;
    ~Restore() { t_bus_jump = outer; }
  } restore{outer};
  sigjmp_buf jump;
  // Nothing in this frame needs destroying when the handler jumps back here.
  if (sigsetjmp(jump, 0) != 0) return false;
  t_bus_jump = &jump;
  fn(ctx);
  return true;
}

}  // namespace detail

FileIdentity FileIdentity::of(const struct ::stat& st) {
  FileIdentity id;
  id.dev = static_cast<uint64_t>(st.st_dev);
  id.ino = static_cast<uint64_t>(st.st_ino);
  id.size = static_cast<uint64_t>(st.st_size);
  id.mtime_ns = ns(st.st_mtim);
  id.ctime_ns = ns(st.st_ctim);
  return id;
}

std::string FileIdentity::change_at(const std::string& path) const {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return cat("it can no longer be found (", std::strerror(errno), ")");
  const FileIdentity now = of(st);
  if (now.dev != dev || now.ino != ino) return "it was replaced by another file (a new inode at the same path)";
  if (now.size != size) return cat("its size changed from ", size, " to ", now.size, " bytes");
  if (now.mtime_ns != mtime_ns || now.ctime_ns != ctime_ns)
    return "it was rewritten in place (same size, new modification time)";
  return "";
}

std::string changed_on_disk_message(const std::string& what, const std::string& path, const std::string& change,
                                    const std::string& uses) {
  return cat(what, " '", path, "' changed on disk while this run was using it: ", change, ". The run's ", uses,
             ", data position and checkpoints refer to the file as it was opened, so it stops here. Restore the "
             "original file, or start a fresh run on the new data");
}

std::string read_fault_message(const std::string& what, const std::string& path, uint64_t opened_bytes) {
  struct stat st {};
  const std::string now = ::stat(path.c_str(), &st) == 0 ? cat("; it now has ", st.st_size, " bytes") : std::string();
  return cat(what, " '", path, "' could not be read (SIGBUS on its memory mapping): the file was truncated or "
             "rewritten in place while this run was reading it (it had ", opened_bytes, " bytes when opened", now,
             "). Data files must not change under a running job: restore the original file, or start a fresh run on "
             "the new data");
}

MappedFile::MappedFile(const std::string& path, const std::string& what) : path_(path), what_(what) {
  // A regular file only: a FIFO named as a data file would block open() forever.
  const int fd = open_regular_file(path, what);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw Error(cat("cannot stat ", what, " '", path, "': ", why));
  }
  id_ = FileIdentity::of(st);
  if (id_.size > 0) {
    void* m = ::mmap(nullptr, static_cast<std::size_t>(id_.size), PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      throw Error(cat("cannot mmap ", what, " '", path, "': ", why));
    }
    data_ = static_cast<const unsigned char*>(m);
  }
  ::close(fd);  // the mapping keeps the file alive
}

MappedFile::~MappedFile() { close(); }

MappedFile::MappedFile(MappedFile&& o) noexcept
    : path_(std::move(o.path_)), what_(std::move(o.what_)), data_(std::exchange(o.data_, nullptr)),
      id_(std::exchange(o.id_, {})) {}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    close();
    path_ = std::move(o.path_);
    what_ = std::move(o.what_);
    data_ = std::exchange(o.data_, nullptr);
    id_ = std::exchange(o.id_, {});
  }
  return *this;
}

void MappedFile::close() noexcept {
  if (data_) ::munmap(const_cast<unsigned char*>(data_), static_cast<std::size_t>(id_.size));
  data_ = nullptr;
}

void MappedFile::verify_unchanged(const std::string& uses) const {
  const std::string what = change();
  if (!what.empty()) throw Error(changed_on_disk_message(what_, path_, what, uses));
}

bool MappedFile::shrunk() const {
  struct stat st {};
  return ::stat(path_.c_str(), &st) != 0 || static_cast<uint64_t>(st.st_size) < id_.size;
}

void MappedFile::throw_read_fault() const { throw Error(read_fault_message(what_, path_, id_.size)); }

}  // namespace loom
