#include "cli.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "loom/error.hpp"
#include "train/outputs.hpp"

namespace fs = std::filesystem;

namespace loom::app {
namespace {

// Why `dir` cannot be written, from errno: "" for no error.
std::string why_not(int e) {
  if (e == EROFS) return "a read-only file system";
  if (e == EACCES || e == EPERM) return "this user may not write there (permission denied)";
  if (e == ENOSPC || e == EDQUOT) return "the disk or quota is full";
  return std::strerror(e);
}

}  // namespace

bool wants_help(const Args& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--set") {
      ++i;  // its value, whatever it is
      continue;
    }
    if (args[i] == "-h" || args[i] == "--help") return true;
  }
  return false;
}

std::optional<std::string> flag_value(const Args& args, size_t& i, std::string_view name) {
  const std::string& a = args[i];
  if (a.size() > name.size() && a.compare(0, name.size(), name) == 0 && a[name.size()] == '=')
    return a.substr(name.size() + 1);
  if (a != name) return std::nullopt;
  if (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0)
    throw Error(cat(name, " needs a value: ", name, "=VALUE or ", name, " VALUE"));
  return args[++i];
}

namespace {

// check_output_folder, with `q` saying what the user gave ("--json=out/x.json").
void check_folder(std::string_view flag, const std::string& q, const std::string& dir) {
  // The walk run.out_dir and checkpoint.dir get (train/outputs.hpp): every
  // existing part a folder, no link to nowhere, no pseudo file system.
  const fs::path last = check_output_walk(q, cat("give ", flag, " another folder"), dir);
  const fs::path full = fs::absolute(fs::path(dir)).lexically_normal();
  std::error_code ec;
  fs::create_directories(full, ec);
  if (ec) throw Error(cat(q, ": cannot create it in '", last.string(), "': ", why_not(ec.value()), "; give ", flag,
                         " a writable folder"));
  // A real write: access(2) says yes on a read-only bind mount of a writable
  // file system's folder, and nothing but a write finds a full disk.
  const fs::path probe = full / cat(".loom-write-probe-", ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0)
    throw Error(cat(q, ": cannot write in '", full.string(), "': ", why_not(errno), "; give ", flag, " a writable folder"));
  const ssize_t w = ::write(fd, "\n", 1);
  const int werr = w == 1 ? 0 : errno;
  ::close(fd);
  ::unlink(probe.c_str());
  if (werr != 0)
    throw Error(cat(q, ": cannot write in '", full.string(), "': ", why_not(werr), "; give ", flag, " a writable folder"));
}

}  // namespace

void check_output_folder(std::string_view flag, const std::string& dir) {
  if (dir.empty()) throw Error(cat(flag, "= is empty: give it a folder"));
  check_folder(flag, cat(flag, "=", dir), dir);
}

void check_output_file(std::string_view flag, const std::string& file) {
  if (file.empty()) throw Error(cat(flag, "= is empty: give it a file name, e.g. ", flag, "=out.json"));
  const std::string q = cat(flag, "=", file);
  struct stat st {};
  if (::stat(file.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    throw Error(cat(q, ": '", file, "' is a folder: give ", flag, " a file name"));
  const fs::path parent = fs::path(file).parent_path();
  check_folder(flag, q, parent.empty() ? std::string(".") : parent.string());
  if (::stat(file.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode))
      throw Error(cat(q, ": '", file, "' is not a regular file: give ", flag, " a file name"));
    if (::access(file.c_str(), W_OK) != 0)
      throw Error(cat(q, ": '", file, "' cannot be replaced: ", why_not(errno)));
  }
}

}  // namespace loom::app
