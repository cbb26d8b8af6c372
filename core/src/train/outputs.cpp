#include "train/outputs.hpp"

#include <fcntl.h>
#include <limits.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/file_util.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"
#include "train/checkpointing.hpp"
#include "util/files.hpp"

namespace fs = std::filesystem;

namespace loom {
namespace {

std::string quoted(const std::string& key, const std::string& path) { return cat(key, " = \"", path, "\""); }

std::string where_relative(const std::string& path) {
  if (fs::path(path).is_absolute()) return "";
  std::error_code ec;
  return cat(" (relative to the working directory ", fs::current_path(ec).string(), ")");
}

// The reason a directory cannot be written, from access(2): "" when it can.
std::string unwritable_reason(const fs::path& dir) {
  if (::access(dir.c_str(), W_OK | X_OK) == 0) return "";
  const int e = errno;
  if (e == EROFS) return "it is on a read-only file system";
  if (e == EACCES || e == EPERM) return "this user may not write there (permission denied)";
  return std::strerror(e);
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

void check_one_path(const std::string& key, const std::string& path) {
  const std::string q = quoted(key, path);
  if (path.size() >= PATH_MAX)
    throw Error(cat(q, ": the path is ", path.size(), " characters long, more than the ", PATH_MAX - 1,
                    " a path may have: choose a shorter ", key));
  for (const fs::path& part : fs::path(path)) {
    const std::string s = part.string();
    if (s.size() > NAME_MAX)
      throw Error(cat(q, ": the name '", s.substr(0, 24), "...' is ", s.size(), " characters long, more than the ",
                      NAME_MAX, " a file or folder name may have: choose a shorter ", key));
  }
  // Every existing part a folder, the rest to be created in a real file system.
  const fs::path last_existing = check_output_walk(q, cat("choose another ", key), path);
  if (const std::string why = unwritable_reason(last_existing); !why.empty())
    throw Error(cat(q, where_relative(path), ": cannot write in '", last_existing.string(), "': ", why,
                    ". Choose a writable ", key));
  // Not inside a checkpoint (a step folder, of this run or another): writing
  // there changes a complete checkpoint, and pruning it (checkpoint.keep_last)
  // would delete this run's files with it.
  for (fs::path p = last_existing;; p = p.parent_path()) {
    std::error_code ec;
    const bool complete = fs::exists(p / "COMPLETE", ec);
    if (p.filename().string().rfind("step_", 0) == 0 && (complete || fs::exists(p / "meta.json", ec)))
      throw Error(cat(q, where_relative(path), ": '", p.string(), "' is a checkpoint (it holds ",
                      complete ? "COMPLETE" : "meta.json",
                      "); a run's files do not belong inside one (pruning old checkpoints would delete them). To "
                      "resume from it, set checkpoint.dir = \"", p.parent_path().string(),
                      "\" (the folder above it); otherwise choose another ", key));
    if (p == p.parent_path() || p.empty()) break;
  }
}

// The kernel's pseudo file systems, by statfs type (linux/magic.h): their
// files are the kernel's interfaces (processes, devices, settings), made up
// when read and never stored, wherever they are mounted.
const char* pseudo_fs_name(unsigned long type) {
  switch (type) {
    case 0x9fa0: return "proc";
    case 0x62656572: return "sysfs";
    case 0x27e0eb: return "cgroup";
    case 0x63677270: return "cgroup2";
    case 0x1cd1: return "devpts";
    case 0x64626720: return "debugfs";
    case 0x74726163: return "tracefs";
    case 0x73636673: return "securityfs";
    case 0x6165676c: return "pstore";
    case 0xcafe4a11: return "bpf";
    case 0x62656570: return "configfs";
    case 0xde5e81e4: return "efivarfs";
    case 0x19800202: return "mqueue";
    case 0x65735543: return "fusectl";
    case 0x42494e4d: return "binfmt_misc";
    case 0xf97cff8c: return "selinuxfs";
    case 0x6e736673: return "nsfs";
    default: return nullptr;
  }
}

// `p` is `top` or lies below it (whole names: /devices is not under /dev).
bool is_under(const std::string& p, const std::string& top) {
  return p.compare(0, top.size(), top) == 0 && (p.size() == top.size() || p[top.size()] == '/');
}

// Why files cannot be written in the existing folder `dir` (docs/RELIABILITY.md
// "Files"): it resolves to /proc, /sys or /dev or below them (/dev/shm, a
// memory file system for files, excepted), or lies on a pseudo file system
// anywhere (a /proc mounted at /host/proc). "" when it is a place for files.
std::string pseudo_place(const fs::path& dir) {
  std::error_code ec;
  fs::path real = fs::canonical(dir, ec);
  if (ec) real = dir;
  const std::string r = real.string();
  std::string top;
  for (const char* t : {"/proc", "/sys", "/dev"})
    if (is_under(r, t) && !is_under(r, "/dev/shm")) top = t;
  struct statfs sf {};
  const char* type = ::statfs(real.c_str(), &sf) == 0 ? pseudo_fs_name(static_cast<unsigned long>(sf.f_type)) : nullptr;
  if (top.empty() && !type) return "";
  const std::string as = real == dir ? std::string() : cat(" (that is, '", r, "')");
  const std::string where = !top.empty() ? cat("under ", top, type ? cat(" (a ", type, " file system)") : std::string())
                                         : cat("on a ", type, " file system");
  return cat(as, " is ", where, ", which the kernel makes up to show processes, devices and settings: it is no "
             "storage, and what is written there is lost or changes the system");
}

}  // namespace

fs::path check_output_walk(const std::string& given, const std::string& remedy, const std::string& path) {
  const std::string at = cat(given, where_relative(path));
  // Down from the root: every existing part must be a folder (the rest is
  // created in the last one that exists).
  const fs::path full = fs::absolute(fs::path(path)).lexically_normal();
  fs::path cur, last = full.root_path();
  for (const fs::path& part : full) {
    cur /= part;
    if (part.empty() || cur == full.root_path()) continue;
    struct stat st {};
    if (::stat(cur.c_str(), &st) != 0) {
      const int e = errno;
      struct stat lst {};
      if (::lstat(cur.c_str(), &lst) == 0 && S_ISLNK(lst.st_mode)) {
        // A link to nowhere: creating the folder would only meet the link ("File exists").
        std::error_code ec;
        const fs::path to = fs::read_symlink(cur, ec);
        throw Error(cat(at, ": '", cur.string(), "' is a link to '", ec ? std::string("?") : to.string(), "'",
                        !ec && to.is_relative() ? cat(" (relative to ", cur.parent_path().string(), ")") : std::string(),
                        e == ENOENT ? std::string(", which does not exist")
                                    : cat(", which cannot be followed (", std::strerror(e), ")"),
                        ": create its target, remove the link, or ", remedy));
      }
      if (e == ENOENT) break;
      if (e == ENOTDIR)  // a part above changed since it was looked at
        throw Error(cat(at, ": '", cur.parent_path().string(), "' is not a folder: move it away or ", remedy));
      if (e == EACCES)
        throw Error(cat(at, ": '", cur.string(), "' cannot be reached (permission denied on a folder above it): ",
                        remedy));
      throw Error(cat(at, ": cannot reach '", cur.string(), "': ", std::strerror(e), "; ", remedy));
    }
    if (!S_ISDIR(st.st_mode))
      throw Error(cat(at, ": '", cur.string(), "' is ", S_ISREG(st.st_mode) ? "a file" : file_type_name(st.st_mode),
                      ", where a folder is needed: move it away or ", remedy));
    last = cur;
  }
  if (const std::string why = pseudo_place(last); !why.empty())
    throw Error(cat(at, ": '", last.string(), "'", why, ". A run's files need a real file system: ", remedy));
  return last;
}

namespace {

// Non-empty metrics.jsonl: the results of a run that did at least one step.
int64_t metrics_lines(const fs::path& file) {
  std::ifstream in(file);
  int64_t n = 0;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) ++n;
  return n;
}

std::string join_steps(const std::vector<ckpt::CheckpointInfo>& cks) {
  std::string s;
  for (size_t i = 0; i < cks.size(); ++i) {
    if (i == 4 && cks.size() > 5) {
      s += cat(", ... (", cks.size(), " in all)");
      break;
    }
    s += (i ? ", " : "") + fs::path(cks[i].dir).filename().string();
  }
  return s;
}

}  // namespace

void check_output_paths(const Config& cfg) {
  check_one_path("run.out_dir", cfg.run.out_dir);
  check_one_path("checkpoint.dir", checkpoint_root(cfg).string());
  check_checkpoint_names(cfg);
}

void check_checkpoint_names(const Config& cfg) {
  const std::string root = checkpoint_root(cfg).string();
  try {
    (void)ckpt::list_checkpoints(root);  // refuses a step_N that is not a folder
  } catch (const Error& e) {
    throw Error(cat(quoted("checkpoint.dir", cfg.checkpoint.dir), ": ", e.what()));
  }
}

std::optional<int64_t> planned_resume_step(const Config& cfg) {
  const std::string& mode = cfg.checkpoint.resume;
  if (mode == "none") return std::nullopt;
  const std::string root = checkpoint_root(cfg).string();
  if (mode == "auto") {
    if (auto c = ckpt::latest_complete(root)) return c->step;
    return std::nullopt;
  }
  return std::stoll(mode);
}

void check_no_overwrite(const Config& cfg, std::optional<int64_t> resume_step) {
  if (resume_step || cfg.run.overwrite) return;
  const fs::path out(cfg.run.out_dir);
  const std::string root = checkpoint_root(cfg).string();
  std::error_code ec;
  const int64_t lines = fs::is_regular_file(out / "metrics.jsonl", ec) ? metrics_lines(out / "metrics.jsonl") : 0;
  std::vector<ckpt::CheckpointInfo> complete;
  for (const ckpt::CheckpointInfo& c : ckpt::list_checkpoints(root))
    if (c.complete) complete.push_back(c);
  if (lines == 0 && complete.empty()) return;
  std::string what;
  if (lines > 0) what = cat((out / "metrics.jsonl").string(), " (", lines, " lines)");
  if (!complete.empty())
    what += cat(what.empty() ? "" : " and ", complete.size(), " complete checkpoint", complete.size() == 1 ? "" : "s",
                " in ", root, " (", join_steps(complete), ")");
  const bool none = cfg.checkpoint.resume == "none";
  throw Error(cat("run.out_dir = \"", cfg.run.out_dir, "\" holds a previous run: ", what, ". ",
                  none ? "checkpoint.resume = \"none\" would start over and overwrite it"
                       : "There is no complete checkpoint to resume from, so this run would start over and overwrite it",
                  ". ", none && !complete.empty() ? "Resume it (checkpoint.resume = \"auto\"), write" : "Write",
                  " this run elsewhere (run.out_dir), or replace the previous run on purpose (run.overwrite = true)"));
}

void create_output_dir(const std::string& key, const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) {
    // The static checks name the usual causes; this is what is left (a race, a full disk).
    check_one_path(key, dir);
    throw Error(cat(quoted(key, dir), ": the folder cannot be created: ",
                    ec ? ec.message() : std::string("something else is in the way")));
  }
}

void probe_writable(const std::string& key, const std::string& dir, const std::string& probe_name) {
  const std::string file = (fs::path(dir) / probe_name).string();
  auto fail = [&](const char* what, int e) {
    return Error(cat(quoted(key, dir), ": cannot ", what, " ", file, ": ", std::strerror(e),
                     e == ENOSPC || e == EDQUOT ? " (the disk or quota is full: free space or choose another folder)"
                     : e == EROFS                ? " (a read-only file system: choose another folder)"
                     : e == EEXIST               ? " (something that is not a file is in the way: move it away)"
                                                 : ""));
  };
  // A file of our own, never one reached through a symbolic link planted
  // under the probe's name: writing through it would overwrite its target.
  if (::unlink(file.c_str()) != 0 && errno != ENOENT && errno != EISDIR && errno != EPERM) throw fail("remove", errno);
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) throw fail("create", errno);
  // More than one page: a file system with less free space than this cannot
  // hold a metrics line or a checkpoint either.
  static const std::string block(8192, '\n');
  int err = 0;
  for (size_t done = 0; done < block.size() && !err;) {
    const ssize_t w = ::write(fd, block.data() + done, block.size() - done);
    if (w < 0 && errno != EINTR) err = errno;
    if (w > 0) done += static_cast<size_t>(w);
  }
  if (!err && ::fsync(fd) != 0 && errno != EINVAL) err = errno;
  if (::close(fd) != 0 && !err) err = errno;
  ::unlink(file.c_str());
  if (err) throw fail("write", err);
}

// ---------------------------------------------------------------------------
// The lock
// ---------------------------------------------------------------------------

struct OutputLock::Held {
  std::string path;
  int fd = -1;
  ~Held() {
    if (fd >= 0) ::close(fd);  // closing the last descriptor releases the flock
  }
};

namespace {

std::mutex g_locks_mu;
std::map<std::string, std::weak_ptr<OutputLock::Held>>& held_locks() {
  static auto* m = new std::map<std::string, std::weak_ptr<OutputLock::Held>>;
  return *m;
}

std::shared_ptr<OutputLock::Held> lock_dir(const std::string& key, const std::string& dir) {
  create_output_dir(key, dir);
  std::error_code ec;
  const std::string canon = fs::canonical(dir, ec).string();
  const std::string id = ec ? fs::absolute(dir).lexically_normal().string() : canon;
  std::lock_guard<std::mutex> g(g_locks_mu);
  if (auto existing = held_locks()[id].lock()) return existing;
  auto h = std::make_shared<OutputLock::Held>();
  h->path = (fs::path(dir) / ".loom.lock").string();
  // O_NOFOLLOW and a regular file only: the holder's line is written into the
  // lock (after truncating it), which must never reach another file through a
  // symbolic link, and a FIFO or device there cannot hold a lock.
  h->fd = ::open(h->path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
  if (h->fd < 0) {
    const int e = errno;
    throw Error(cat(quoted(key, dir), ": cannot create the lock file ", h->path, ": ",
                    e == ELOOP ? "it is a symbolic link; remove it (Loom creates the lock file itself)"
                               : std::strerror(e)));
  }
  struct stat lst {};
  if (::fstat(h->fd, &lst) != 0 || !S_ISREG(lst.st_mode))
    throw Error(cat(quoted(key, dir), ": the lock file ", h->path, " is ", file_type_name(lst.st_mode),
                    ", not a regular file: remove it (Loom creates the lock file itself)"));
  if (lst.st_nlink > 1)  // a hard link: truncating it would truncate the other name's file too
    throw Error(cat(quoted(key, dir), ": the lock file ", h->path, " has ", lst.st_nlink,
                    " names (hard links), so it is another file too: remove it (Loom creates the lock file itself)"));
  if (::flock(h->fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    if (e == EWOULDBLOCK) {
      std::string holder;
      {
        std::ifstream in(h->path);
        std::getline(in, holder);
      }
      throw Error(cat(quoted(key, dir), " is in use by another run",
                      holder.empty() ? std::string() : cat(" (", holder, ")"),
                      ": two runs writing one folder would mix their metrics and checkpoints. Wait for it to end, or "
                      "choose another ", key));
    }
    throw Error(cat(quoted(key, dir), ": cannot lock ", h->path, ": ", std::strerror(e)));
  }
  // Who holds it, for the message a second run gets.
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char when[64] = {};
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", std::localtime(&now));
  const std::string who = cat("pid ", ::getpid(), " on host ", host_name(), ", since ", when, "\n");
  int err = 0;
  if (::ftruncate(h->fd, 0) != 0) err = errno;
  if (!err && ::pwrite(h->fd, who.data(), who.size(), 0) != static_cast<ssize_t>(who.size())) err = errno ? errno : EIO;
  if (err)
    throw Error(cat(quoted(key, dir), ": cannot write the lock file ", h->path, ": ", std::strerror(err),
                    err == ENOSPC ? " (the disk is full: free space or choose another folder)" : ""));
  held_locks()[id] = h;
  return h;
}

}  // namespace

std::shared_ptr<OutputLock> OutputLock::acquire(const Config& cfg) {
  std::shared_ptr<OutputLock> l(new OutputLock);
  l->held_.push_back(lock_dir("run.out_dir", cfg.run.out_dir));
  // checkpoint.dir too, wherever it is: another run may name this run's
  // checkpoint folder as its own checkpoint.dir with a different out_dir.
  const fs::path root = checkpoint_root(cfg);
  l->held_.push_back(lock_dir("checkpoint.dir", root.string()));
  // A real write into each: a full disk is found here, before any work.
  probe_writable("run.out_dir", cfg.run.out_dir, ".loom.write_test");
  probe_writable("checkpoint.dir", root.string(), ".loom.write_test");
  return l;
}

OutputLock::~OutputLock() = default;

// ---------------------------------------------------------------------------
// The run's files
// ---------------------------------------------------------------------------

namespace {

// Removes step folders (rename, then delete, as pruning does, so a crash
// never leaves one that looks complete with shards missing).
void remove_checkpoints(const std::vector<std::string>& dirs) {
  for (const std::string& d : dirs) {
    const fs::path victim(d);
    const fs::path trash = victim.parent_path() / ("." + victim.filename().string() + ".deleting");
    std::error_code ec;
    fs::remove_all(trash, ec);
    fs::rename(victim, trash, ec);
    if (ec) throw Error(cat("run.overwrite = true: cannot remove the previous run's checkpoint ", d, ": ", ec.message()));
    fs::remove_all(trash, ec);
    if (ec) throw Error(cat("run.overwrite = true: cannot remove ", trash.string(), ": ", ec.message()));
  }
}

// Where the previous run's metrics wait while a replacing run has nothing of its own.
fs::path replaced_metrics(const fs::path& out) { return out / "metrics.jsonl.replaced"; }

// Keeps the lines of metrics.jsonl up to `step` (a resumed run continues
// there; lines of steps after the checkpoint belong to a timeline that was lost).
void trim_metrics(const fs::path& file, int64_t step) {
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) return;
  std::ifstream in(file);
  std::string kept, line;
  int64_t dropped = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    int64_t s = -1;
    try {
      s = nlohmann::json::parse(line).value("step", int64_t{-1});
    } catch (const nlohmann::json::exception&) {
      s = -1;  // a torn last line of a killed run
    }
    if (s < 0 || s > step) {
      ++dropped;
      continue;
    }
    kept += line + "\n";
  }
  if (dropped == 0) return;
  ckpt::write_file_atomic(file.string(), kept);
  log_info(cat("metrics: dropped ", dropped, " line(s) after step ", step, " from ", file.string(),
               " (steps the resumed checkpoint does not include)"));
}

}  // namespace

ReplacedRun::ReplacedRun(const Config& cfg, std::vector<std::string> checkpoints, bool had_metrics)
    : out_dir_(cfg.run.out_dir), checkpoints_(std::move(checkpoints)), had_metrics_(had_metrics) {
  if (had_metrics_) {
    const fs::path out(out_dir_);
    std::error_code ec;
    fs::rename(out / "metrics.jsonl", replaced_metrics(out), ec);
    if (ec)
      throw Error(cat("run.overwrite = true: cannot move ", (out / "metrics.jsonl").string(), " aside to ",
                      replaced_metrics(out).string(), ": ", ec.message()));
  }
  log_info(cat("run.overwrite = true: the previous run in ", out_dir_, " (", checkpoints_.size(), " checkpoint(s)",
               had_metrics_ ? ", metrics.jsonl" : "",
               ") is removed when this run writes its first checkpoint or ends; until then an error leaves it as it is"));
}

void ReplacedRun::remove() {
  if (removed_) return;
  removed_ = true;
  remove_checkpoints(checkpoints_);
  std::error_code ec;
  if (had_metrics_) fs::remove(replaced_metrics(out_dir_), ec);
  log_warn(cat("run.overwrite = true: replaced the previous run in ", out_dir_, " (", checkpoints_.size(),
               " checkpoint(s)", had_metrics_ ? ", metrics.jsonl" : "", " removed)"));
}

ReplacedRun::~ReplacedRun() {
  if (removed_) return;
  // This run ends with nothing of its own to keep: the previous run stays.
  try {
    const fs::path out(out_dir_);
    std::error_code ec;
    if (had_metrics_) fs::rename(replaced_metrics(out), out / "metrics.jsonl", ec);
    else fs::remove(out / "metrics.jsonl", ec);
    log_warn(cat("run.overwrite = true: this run ended before it wrote a checkpoint, so the previous run in ",
                 out_dir_, " is left as it was (", checkpoints_.size(), " checkpoint(s)",
                 had_metrics_ ? ", metrics.jsonl" : "", ")",
                 ec ? cat("; putting its metrics.jsonl back failed: ", ec.message(), " (it is ",
                          replaced_metrics(out).string(), ")")
                    : std::string()));
  } catch (...) {  // a destructor: nothing may escape (logging itself can throw on a full disk)
  }
}

std::unique_ptr<ReplacedRun> prepare_run_files(const Config& cfg, std::optional<int64_t> resume_step) {
  const fs::path out(cfg.run.out_dir);
  check_checkpoint_names(cfg);  // before metrics.jsonl is trimmed or anything replaced
  // A replacing run killed before its first checkpoint left the previous
  // run's metrics aside (ReplacedRun): they belong to the checkpoints still here.
  std::error_code ec;
  if (fs::is_regular_file(replaced_metrics(out), ec)) {
    fs::rename(replaced_metrics(out), out / "metrics.jsonl", ec);
    if (ec)
      throw Error(cat("cannot put ", replaced_metrics(out).string(), " back to ", (out / "metrics.jsonl").string(),
                      ": ", ec.message(), ". It holds the metrics of the run a killed run.overwrite = true run was "
                      "replacing: move it there yourself, or remove it"));
    log_warn(cat("put ", replaced_metrics(out).string(), " back to metrics.jsonl: a run with run.overwrite = true "
                 "ended before its first checkpoint, so the run it was replacing is still here"));
  }
  check_no_overwrite(cfg, resume_step);
  std::unique_ptr<ReplacedRun> replaced;
  if (!resume_step && cfg.run.overwrite) {
    std::vector<std::string> dirs;
    for (const ckpt::CheckpointInfo& c : ckpt::list_checkpoints(checkpoint_root(cfg).string())) dirs.push_back(c.dir);
    const bool had_metrics = fs::is_regular_file(out / "metrics.jsonl", ec);
    if (!dirs.empty() || had_metrics) replaced = std::make_unique<ReplacedRun>(cfg, std::move(dirs), had_metrics);
  }
  if (resume_step) trim_metrics(out / "metrics.jsonl", *resume_step);
  probe_writable("run.out_dir", cfg.run.out_dir, ".loom.write_test");
  ckpt::write_file_atomic((out / "config.toml").string(), cfg.effective_toml);
  return replaced;
}

}  // namespace loom
