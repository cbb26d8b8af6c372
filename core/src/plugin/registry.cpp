// Plugin discovery, loading and checking (docs/PLUGINS.md, docs/ARCHITECTURE.md "Plugin ABI").
//
// Every check reads only the plain-C descriptor, in an order where each step
// may rely on the previous ones (struct size before fields, kind and ABI before
// the build id, ...), and every failure is its own loom::Error naming the file.
#include "loom/registry.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <system_error>
#include <utility>

#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>

#include "loom/config.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"
#include "loom/version.hpp"
#include "plugin/registry_detail.hpp"
#include "util/files.hpp"

namespace loom {
namespace fs = std::filesystem;

namespace {

// Libraries stay loaded until the process exits: objects made by a plugin keep
// vtables and code pointers into it, and the descriptor strings live in it too.
// The holder is leaked on purpose so that no static destructor unloads a
// library while another static destructor may still use one of its objects.
struct LoadedLibraries {
  std::mutex mu;
  std::map<std::string, boost::dll::shared_library> by_path;
};
LoadedLibraries& loaded_libraries() {
  static auto* libs = new LoadedLibraries;
  return *libs;
}

std::string sdk_version() { return version_string(); }

std::string abi_string(uint32_t major, uint32_t minor) { return cat(major, ".", minor); }

const char* kind_list() { return "precision, attention, sharding, data"; }

// "an attention plugin", "a data plugin".
std::string a_kind(PluginKind k) {
  return cat(k == PluginKind::attention ? "an " : "a ", plugin_kind_name(k));
}

// One loaded and checked plugin file.
struct Checked {
  PluginRecord record;
  const PluginDescriptor* descriptor = nullptr;
};

// What dlopen said, from boost::dll's "load() failed (dlerror system message:
// <reason>): <errno text>" (the errno is not dlopen's: it is whatever an
// earlier call left, e.g. "Bad file descriptor").
std::string loader_reason(const std::string& what) {
  const std::string tag = "dlerror system message: ";
  const size_t b = what.find(tag), e = what.rfind("):");
  if (b == std::string::npos || e == std::string::npos || e < b) return what;
  return what.substr(b + tag.size(), e - b - tag.size());
}

// dlopen the file once per process (keyed by its canonical path) and return the
// library. RTLD_NOW so that a missing symbol is reported here, with the file's
// name, instead of as a crash in the middle of a run; RTLD_LOCAL so that two
// plugins' entry symbols never interpose each other.
boost::dll::shared_library& load_library(const fs::path& file) {
  std::error_code ec;
  fs::path canonical = fs::canonical(file, ec);
  if (ec) canonical = fs::absolute(file).lexically_normal();
  auto& libs = loaded_libraries();
  std::lock_guard<std::mutex> lock(libs.mu);
  auto it = libs.by_path.find(canonical.string());
  if (it != libs.by_path.end()) return it->second;
  // Not a shared library at all (a text file, a truncated download): said so,
  // rather than by the loader's message with an errno left over from elsewhere.
  {
    char magic[4] = {};
    const int fd = ::open(canonical.c_str(), O_RDONLY | O_CLOEXEC);
    const ssize_t n = fd >= 0 ? ::read(fd, magic, sizeof magic) : -1;
    if (fd >= 0) ::close(fd);
    if (n >= 0 && (n < 4 || std::memcmp(magic, "\x7f" "ELF", 4) != 0))
      throw Error(cat("plugin file ", file.string(), " is not a shared library (it does not start with an ELF header",
                      n < 4 ? cat(": it holds ", n, " bytes") : std::string(), "). Give the .so a plugin's build ",
                      "wrote (libloom-<kind>-<name>.so), or remove it from the plugin path."));
  }
  boost::dll::shared_library lib;
  try {
    lib.load(canonical, boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local);
  } catch (const std::exception& e) {
    throw Error(cat("plugin file ", file.string(), " cannot be loaded: ", loader_reason(e.what()),
                    ". Check that it is a shared library built for this machine and that every library it "
                    "needs is found (run 'ldd ", file.string(), "'), or remove it from the plugin path."));
  }
  return libs.by_path.emplace(canonical.string(), std::move(lib)).first->second;
}

Checked load_and_check(const fs::path& file) {
  const std::string f = file.string();
  std::error_code ec;
  if (!fs::exists(file, ec))
    throw Error(cat("plugin file ", f, " does not exist: check the path given for it in the config."));
  require_regular_file(f, "plugin file");  // dlopen of a FIFO would block
  auto parsed = detail::parse_plugin_file_name(file.filename().string());
  if (!parsed)
    throw Error(cat(f, " is not named like a Loom plugin: plugin files are named libloom-<kind>-<name>.so "
                    "(for example libloom-attention-cudnn.so); loom_add_plugin() names them so."));
  if (!parsed->kind)
    throw Error(cat(f, ": the file name has unknown plugin kind '", parsed->kind_text, "'; plugin files are named ",
                    "libloom-<kind>-<name>.so with <kind> one of ", kind_list(), ". Rename or remove the file."));

  boost::dll::shared_library& lib = load_library(file);
  if (!lib.has(LOOM_STR_(LOOM_PLUGIN_ENTRY_NAME)))
    throw Error(cat(f, " is not a Loom plugin: it exports no '", LOOM_STR_(LOOM_PLUGIN_ENTRY_NAME),
                    "' entry. Build plugins with loom_add_plugin() and the LOOM_PLUGIN(...) macro from "
                    "loom/plugin.hpp, or remove the file from the plugin path."));
  const PluginDescriptor* d = nullptr;
  try {
    d = lib.get_alias<const PluginDescriptor*()>(LOOM_STR_(LOOM_PLUGIN_ENTRY_NAME))();
  } catch (const std::exception& e) {
    throw Error(cat(f, " is not a Loom plugin: its '", LOOM_STR_(LOOM_PLUGIN_ENTRY_NAME),
                    "' entry cannot be resolved (", e.what(), "). Rebuild it with the LOOM_PLUGIN(...) macro."));
  }
  if (!d)
    throw Error(cat(f, ": its '", LOOM_STR_(LOOM_PLUGIN_ENTRY_NAME), "' entry returned no descriptor. ",
                    "Rebuild the plugin with the LOOM_PLUGIN(...) macro of loom ", sdk_version(), "."));

  // The descriptor only ever grows at its end, so every field this host reads
  // exists when struct_size covers at least the layout this host was built with.
  constexpr size_t kMinSize = offsetof(PluginDescriptor, create) + sizeof(d->create);
  if (d->struct_size < kMinSize)
    throw Error(cat(f, ": its plugin descriptor is ", d->struct_size, " bytes, this loom needs at least ", kMinSize,
                    " (plugin ABI ", abi_string(LOOM_ABI_MAJOR, LOOM_ABI_MINOR),
                    "): the plugin was not built with the LOOM_PLUGIN(...) macro of this SDK. "
                    "Rebuild it against loom ", sdk_version(), "."));
  if (!d->name || !d->version || !d->description || !d->build_id || !d->create)
    throw Error(cat(f, ": its plugin descriptor has a null ",
                    !d->name ? "name" : !d->version ? "version" : !d->description ? "description"
                                                     : !d->build_id ? "build_id" : "create",
                    " field. Rebuild it with the LOOM_PLUGIN(...) macro of loom ", sdk_version(), "."));

  auto kind = detail::kind_from_number(d->kind);
  if (!kind)
    throw Error(cat(f, ": its descriptor declares unknown plugin kind ", d->kind, "; this loom knows precision (1), ",
                    "attention (2), sharding (3) and data (4). The plugin needs a newer loom, or rebuild it "
                    "against loom ", sdk_version(), "."));

  if (d->abi_major != LOOM_ABI_MAJOR)
    throw Error(cat(f, " was built for plugin ABI ", abi_string(d->abi_major, d->abi_minor), ", this loom speaks ",
                    abi_string(LOOM_ABI_MAJOR, LOOM_ABI_MINOR), ": rebuild the plugin against loom ", sdk_version(),
                    "."));
  if (d->abi_minor > LOOM_ABI_MINOR)
    throw Error(cat(f, " needs plugin ABI ", abi_string(d->abi_major, d->abi_minor), ", this loom speaks only ",
                    abi_string(LOOM_ABI_MAJOR, LOOM_ABI_MINOR),
                    " (a plugin may use a minor up to the host's): upgrade loom, or rebuild the plugin against loom ",
                    sdk_version(), "."));

  std::string why = detail::build_id_mismatch(d->build_id, build_id());
  if (!why.empty())
    throw Error(cat(f, " was built with an incompatible toolchain or SDK (", why, "): plugin build id '", d->build_id,
                    "', this loom's build id '", build_id(),
                    "'. Plugins pass C++ objects to loom, so both need the same compiler family and major "
                    "version, the same C++ library ABI and the same loom major.minor: rebuild the plugin with ",
                    LOOM_COMPILER_TAG, " against loom ", sdk_version(), "."));

  const char* desc_kind = plugin_kind_name(*kind);
  if (*kind != *parsed->kind)
    throw Error(cat(f, ": the file name says kind '", parsed->kind_text, "' but its descriptor says '", desc_kind,
                    "'. Rename the file to libloom-", desc_kind, "-", d->name,
                    ".so, or fix the kind given to LOOM_PLUGIN(...)."));
  if (parsed->name != d->name)
    throw Error(cat(f, ": the file name says plugin '", parsed->name, "' but its descriptor says '", d->name,
                    "'. Rename the file to libloom-", desc_kind, "-", d->name,
                    ".so, or fix the name given to LOOM_PLUGIN(...)."));

  Checked c;
  c.descriptor = d;
  c.record.file = file;
  c.record.kind = *kind;
  c.record.name = d->name;
  c.record.version = d->version;
  c.record.description = d->description;
  c.record.build_id = d->build_id;
  c.record.abi_major = d->abi_major;
  c.record.abi_minor = d->abi_minor;
  return c;
}

// --- Probing a file in a child process (scan, `loom plugins`) --------------
//
// Loading a library runs its code (static constructors), and a broken one can
// crash or hang the process that loads it. A scan only needs each file's
// descriptor, so it loads every candidate in a forked child, which sends the
// record (or the check's message) back through a pipe: a crash or a hang is
// then that file's problem, reported like any refused file, and the listing
// goes on. A run still loads the one plugin it asks for in-process.

constexpr char kFieldSep = '\x1f';

std::string encode_record(const PluginRecord& r) {
  return cat("R", static_cast<uint32_t>(r.kind), kFieldSep, r.name, kFieldSep, r.version, kFieldSep, r.description,
             kFieldSep, r.build_id, kFieldSep, r.abi_major, kFieldSep, r.abi_minor);
}

std::optional<PluginRecord> decode_record(const std::string& s, const fs::path& file) {
  if (s.empty() || s[0] != 'R') return std::nullopt;
  std::vector<std::string> f;
  size_t at = 1;
  for (;;) {
    const size_t sep = s.find(kFieldSep, at);
    f.push_back(s.substr(at, sep == std::string::npos ? std::string::npos : sep - at));
    if (sep == std::string::npos) break;
    at = sep + 1;
  }
  if (f.size() != 7) return std::nullopt;
  PluginRecord r;
  try {
    auto kind = detail::kind_from_number(static_cast<uint32_t>(std::stoul(f[0])));
    if (!kind) return std::nullopt;
    r.kind = *kind;
    r.abi_major = static_cast<uint32_t>(std::stoul(f[5]));
    r.abi_minor = static_cast<uint32_t>(std::stoul(f[6]));
  } catch (const std::exception&) {
    return std::nullopt;
  }
  r.file = file;
  r.name = f[1];
  r.version = f[2];
  r.description = f[3];
  r.build_id = f[4];
  return r;
}

double probe_timeout_s() {
  constexpr double kDefault = 20.0;
  const char* e = std::getenv("LOOM_PLUGIN_PROBE_TIMEOUT");
  if (!e) return kDefault;
  char* end = nullptr;
  const double v = std::strtod(e, &end);
  if (end != e && *end == '\0' && v > 0 && std::isfinite(v)) return v;
  // The environment's setting, not the run's: said once, and the default used.
  static std::once_flag warned;
  std::call_once(warned, [&] {
    log_warn(cat("$LOOM_PLUGIN_PROBE_TIMEOUT = '", e, "' is not a number of seconds > 0 (e.g. 60); loading each ",
                 "plugin file in a child process may take ", kDefault, " s"));
  });
  return kDefault;
}

std::string signal_text(int sig) {
  const char* d = ::strsignal(sig);
  return cat("signal ", sig, d ? cat(", ", d) : std::string());
}

// The file's record, or throws loom::Error with the reason it was refused,
// crashed or hung; the library is never loaded into this process.
PluginRecord probe_in_child(const fs::path& file);

// Candidate plugin files of one directory, sorted by name so that scans and
// messages do not depend on the file system's order. Missing directories are
// not an error here: the search path names several places on purpose.
std::vector<fs::path> candidates_in(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string fname = it->path().filename().string();
    if (!detail::looks_like_plugin_file(fname)) continue;
    std::error_code ec2;
    if (!it->is_regular_file(ec2)) continue;  // follows symlinks
    out.push_back(it->path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string describe_search_path(const std::vector<fs::path>& dirs) {
  std::ostringstream os;
  for (const auto& d : dirs) {
    std::error_code ec;
    os << "\n  " << d.string()
       << (fs::is_directory(d, ec) ? "" : fs::exists(fs::status(d, ec)) ? "   (not a folder)" : "   (does not exist)");
  }
  return os.str();
}

PluginRecord probe_in_child(const fs::path& file) {
  const std::string f = file.string();
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw Error(cat("cannot probe ", f, ": pipe: ", std::strerror(errno)));
  std::fflush(nullptr);  // the child must not flush the parent's buffered output a second time
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int e = errno;
    ::close(fds[0]);
    ::close(fds[1]);
    throw Error(cat("cannot probe ", f, ": fork: ", std::strerror(e)));
  }
  if (pid == 0) {
    ::close(fds[0]);
    std::string out;
    try {
      out = encode_record(load_and_check(file).record);
    } catch (const std::exception& e) {
      out = cat("E", e.what());
    } catch (...) {
      out = "Eunknown exception while loading the plugin";
    }
    for (size_t done = 0; done < out.size();) {
      const ssize_t w = ::write(fds[1], out.data() + done, out.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) break;
      done += static_cast<size_t>(w);
    }
    ::_exit(0);  // no exit handlers or static destructors: they belong to the parent
  }
  ::close(fds[1]);
  std::string got;
  bool hung = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(probe_timeout_s());
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      hung = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (rc < 0 && errno != EINTR) break;
    if (rc <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // the child closed the pipe: done (or dead)
    got.append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  if (hung) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (hung)
    throw Error(cat(f, ": loading it did not finish within ", probe_timeout_s(), " s (its initialisation code, which "
                    "runs when the library is loaded, hangs); a run that asks for it would hang the same way. Fix or "
                    "remove the file"));
  if (WIFSIGNALED(status))
    throw Error(cat(f, ": loading it crashed the process (", signal_text(WTERMSIG(status)), ") in the library's own "
                    "initialisation code, before Loom could check anything; a run that asks for this plugin would "
                    "crash the same way. Rebuild it, or remove it from the plugin path"));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || got.empty())
    throw Error(cat(f, ": loading it ended the process (exit status ", WIFEXITED(status) ? WEXITSTATUS(status) : -1,
                    ") in the library's own initialisation code; a run that asks for this plugin would end the same "
                    "way. Rebuild it, or remove it from the plugin path"));
  if (got[0] == 'E') throw Error(got.substr(1));
  if (auto r = decode_record(got, file)) return *r;
  throw Error(cat(f, ": the probe of this file returned an unreadable answer"));
}

}  // namespace

namespace detail {

bool looks_like_plugin_file(std::string_view fname) {
  constexpr std::string_view prefix = "libloom-", suffix = ".so";
  return fname.size() > prefix.size() + suffix.size() && fname.substr(0, prefix.size()) == prefix &&
         fname.substr(fname.size() - suffix.size()) == suffix;
}

std::optional<ParsedFileName> parse_plugin_file_name(std::string_view fname) {
  if (!looks_like_plugin_file(fname)) return std::nullopt;
  std::string_view stem = fname.substr(8, fname.size() - 8 - 3);  // between "libloom-" and ".so"
  size_t dash = stem.find('-');
  if (dash == std::string_view::npos || dash == 0 || dash + 1 == stem.size()) return std::nullopt;
  ParsedFileName p;
  p.kind_text = std::string(stem.substr(0, dash));
  p.name = std::string(stem.substr(dash + 1));
  p.kind = kind_from_name(p.kind_text);
  return p;
}

std::optional<PluginKind> kind_from_name(std::string_view s) {
  for (auto k : {PluginKind::precision, PluginKind::attention, PluginKind::sharding, PluginKind::data})
    if (s == plugin_kind_name(k)) return k;
  return std::nullopt;
}

std::optional<PluginKind> kind_from_number(uint32_t n) {
  if (n >= static_cast<uint32_t>(PluginKind::precision) && n <= static_cast<uint32_t>(PluginKind::data))
    return static_cast<PluginKind>(n);
  return std::nullopt;
}

std::string build_id_mismatch(std::string_view plugin_id, std::string_view host_id) {
  // LOOM_BUILD_ID is "<compiler>-<major>;<C++ ABI>;loom-<major>.<minor>". Fields
  // appended later by a newer SDK do not take part in the comparison.
  auto split = [](std::string_view s) {
    std::vector<std::string> parts;
    size_t start = 0;
    while (true) {
      size_t semi = s.find(';', start);
      parts.emplace_back(s.substr(start, semi == std::string_view::npos ? std::string_view::npos : semi - start));
      if (semi == std::string_view::npos) break;
      start = semi + 1;
    }
    return parts;
  };
  auto p = split(plugin_id), h = split(host_id);
  static const char* const what[] = {"the compiler differs", "the C++ library ABI differs",
                                     "the loom major.minor differs"};
  if (p.size() < 3) return "the plugin's build id is malformed";
  for (size_t i = 0; i < 3; ++i)
    if (i >= h.size() || p[i] != h[i]) return what[i];
  return "";
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string nearest_name(std::string_view word, const std::vector<std::string>& candidates) {
  // The shared config helper is preferred so that every did-you-mean in loom
  // agrees; the local distance keeps this message useful on its own.
  std::string shared = did_you_mean(word, candidates);
  if (!shared.empty()) return shared;
  std::string best;
  size_t best_d = std::max<size_t>(2, word.size() / 3) + 1;
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_d) best_d = d, best = c;
  }
  return best;
}

}  // namespace detail

PluginRegistry::PluginRegistry(std::vector<fs::path> extra_dirs) {
  auto add = [this](fs::path p) {
    if (p.empty()) return;
    p = p.lexically_normal();
    // A directory named twice (config and environment) is searched once, at its first place.
    if (std::find(dirs_.begin(), dirs_.end(), p) == dirs_.end()) dirs_.push_back(std::move(p));
  };
  for (auto& d : extra_dirs) add(std::move(d));
  if (const char* env = std::getenv("LOOM_PLUGIN_PATH")) {
    std::string_view s(env);
    size_t start = 0;
    while (start <= s.size()) {
      size_t colon = s.find(':', start);
      if (colon == std::string_view::npos) colon = s.size();
      add(fs::path(std::string(s.substr(start, colon - start))));
      start = colon + 1;
    }
  }
  boost::dll::fs::error_code ec;
  fs::path exe = boost::dll::program_location(ec);
  if (!ec && !exe.empty()) add(exe.parent_path() / ".." / "lib" / "loom" / "plugins");
}

void PluginRegistry::scan() {
  records_.clear();
  problems_.clear();
  // kind/name -> the file that wins (the first in search order).
  std::map<std::pair<std::string, std::string>, fs::path> seen;
  for (const auto& dir : dirs_) {
    for (const auto& file : candidates_in(dir)) {
      auto parsed = detail::parse_plugin_file_name(file.filename().string());
      if (parsed && parsed->kind) {
        auto key = std::make_pair(parsed->kind_text, parsed->name);
        auto it = seen.find(key);
        if (it != seen.end()) {
          problems_.push_back(cat(file.string(), " is shadowed by ", it->second.string(),
                                  ", which comes first in the search path; it is never loaded. Remove one of them "
                                  "or reorder the plugin path."));
          continue;
        }
        seen.emplace(key, file);
      }
      try {
        records_.push_back(probe_in_child(file));
      } catch (const Error& e) {
        problems_.push_back(e.what());
      }
    }
  }
  scanned_ = true;
}

PluginRecord PluginRegistry::inspect(const fs::path& file) { return load_and_check(file).record; }

std::unique_ptr<Plugin> PluginRegistry::create(PluginKind kind, const std::string& name, const PluginInit& init,
                                               const fs::path& explicit_file) {
  const char* kname = plugin_kind_name(kind);
  fs::path file = explicit_file;
  if (file.empty()) {
    if (name.empty() || name.find('/') != std::string::npos || name.find('\\') != std::string::npos)
      throw Error(cat("'", name, "' is not a valid ", kname,
                      " plugin name: names are plain words such as 'cudnn'; to load a file by its path, give the "
                      "path to the .so file instead."));
    const std::string wanted = cat("libloom-", kname, "-", name, ".so");
    for (const auto& dir : dirs_) {
      std::error_code ec;
      fs::path cand = dir / wanted;
      if (fs::is_regular_file(cand, ec)) {
        file = cand;  // the first directory in search order wins
        break;
      }
    }
    if (file.empty()) {
      // What was there for this kind (first in search order), and whether the
      // name exists under another kind: both are the usual causes of a miss.
      std::map<std::string, fs::path> found;
      std::vector<std::string> other_kinds;
      for (const auto& dir : dirs_)
        for (const auto& f : candidates_in(dir)) {
          auto p = detail::parse_plugin_file_name(f.filename().string());
          if (!p) continue;
          if (p->kind == kind)
            found.emplace(p->name, f);
          else if (p->name == name && p->kind)
            other_kinds.push_back(cat(p->kind_text, " (", f.string(), ")"));
        }
      std::vector<std::string> names;
      for (const auto& [n, f] : found) names.push_back(n);
      std::ostringstream os;
      os << "no " << kname << " plugin named '" << name << "'.";
      std::string near = detail::nearest_name(name, names);
      if (!near.empty()) os << " Did you mean '" << near << "'?";
      for (const auto& o : other_kinds) os << " A plugin of that name exists for kind " << o << ".";
      if (found.empty()) {
        os << "\nNo " << kname << " plugins were found.";
      } else {
        os << "\nFound " << kname << " plugins:";
        size_t w = 0;
        for (const auto& n : names) w = std::max(w, n.size());
        for (const auto& [n, f] : found) os << "\n  " << n << std::string(w - n.size() + 2, ' ') << f.string();
      }
      os << "\nSearched, in this order:" << describe_search_path(dirs_);
      os << "\nPut " << wanted
         << " into one of these directories, or add its directory to run.plugin_path in the config "
            "or to $LOOM_PLUGIN_PATH. 'loom plugins' lists every plugin found and why any was refused.";
      throw Error(os.str());
    }
  }

  Checked c = load_and_check(file);
  if (c.record.kind != kind)
    throw Error(cat(file.string(), " is ", a_kind(c.record.kind), " plugin, but ", a_kind(kind),
                    " plugin was asked for: point the ", kname, " section of the config at ", a_kind(kind),
                    " plugin."));
  if (!name.empty() && c.record.name != name)
    throw Error(cat(file.string(), " holds the ", kname, " plugin '", c.record.name, "', but '", name,
                    "' was asked for: fix the plugin name or the path in the config."));

  Plugin* obj = nullptr;
  try {
    obj = c.descriptor->create(&init);
  } catch (const Error& e) {
    // Usually a bad value in the plugin's own config table; say whose it is.
    throw Error(cat(kname, " plugin '", c.record.name, "': ", e.what()));
  }
  if (!obj)
    throw Error(cat(kname, " plugin '", c.record.name, "' (", file.string(),
                    ") returned no object from its factory: the plugin is broken; report it to its authors."));
  log_debug(cat("loaded ", kname, " plugin '", c.record.name, "' ", c.record.version, " from ", file.string()));
  loaded_.push_back(c.record);
  return std::unique_ptr<Plugin>(obj);
}

}  // namespace loom
