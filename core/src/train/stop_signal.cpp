#include "train/stop_signal.hpp"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "loom/error.hpp"

namespace loom {
namespace {

static_assert(std::atomic<int>::is_always_lock_free, "the stop flag is written from a signal handler");
std::atomic<int> g_pending{0};
// False during start-up (until the first step begins): no step has run, so a
// stop signal ends the process from the handler itself — even while it is
// blocked in a system call the handler's SA_RESTART would resume.
std::atomic<bool> g_steps_begun{false};
static_assert(std::atomic<bool>::is_always_lock_free, "read from a signal handler");
int g_depth = 0;  // StopSignals alive (main thread only): the outermost one starts clean

// Messages written from the handler, prepared beforehand: a handler may only
// call async-signal-safe functions (write, _exit), not format strings.
constexpr int kMaxSignal = 65;
struct Texts {
  char first[256];
  char second[160];
  char startup[192];
};
Texts g_texts[kMaxSignal];

void write_all(const char* s) {
  size_t n = std::strlen(s);
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;
    }
    s += w;
    n -= static_cast<size_t>(w);
  }
}

void on_stop_signal(int sig) {
  const int saved_errno = errno;  // a handler must leave errno as it found it
  int expected = 0;
  if (!g_steps_begun.load() && g_pending.load() == 0) {
    if (sig > 0 && sig < kMaxSignal) write_all(g_texts[sig].startup);
    ::_exit(128 + sig);
  }
  if (g_pending.compare_exchange_strong(expected, sig)) {
    if (sig > 0 && sig < kMaxSignal) write_all(g_texts[sig].first);
    errno = saved_errno;
    return;
  }
  if (sig > 0 && sig < kMaxSignal) write_all(g_texts[sig].second);
  ::_exit(128 + sig);
}

}  // namespace

std::string signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGHUP: return "SIGHUP";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    case SIGQUIT: return "SIGQUIT";
    case SIGKILL: return "SIGKILL";
    case SIGBUS: return "SIGBUS";
    case SIGSEGV: return "SIGSEGV";
    case SIGABRT: return "SIGABRT";
    default: return cat("signal ", sig);
  }
}

int stop_signal_number(const std::string& name) {
  if (name == "none") return 0;
  if (name == "USR1") return SIGUSR1;
  if (name == "USR2") return SIGUSR2;
  throw Error(cat("run.stop_signal = \"", name, "\" is not one of: USR1, USR2, none"));
}

StopSignals::StopSignals(const std::string& extra) {
  // A new run starts clean; an inner object (Session::train inside `loom
  // train`'s own) keeps what arrived during start-up.
  if (g_depth++ == 0) {
    g_pending.store(0);
    g_steps_begun.store(false);
  }
  std::vector<int> sigs = {SIGTERM, SIGINT, SIGHUP};
  if (const int s = stop_signal_number(extra)) sigs.push_back(s);
  for (int sig : sigs) {
    const std::string name = signal_name(sig);
    const std::string first = cat("\nloom: ", name, " received: finishing the current step, then writing a checkpoint "
                                  "and stopping (send it again to stop at once, without a checkpoint)\n");
    const std::string second = cat("\nloom: ", name, " received again: stopping at once, without a checkpoint\n");
    const std::string startup = cat("\nloom: ", name, " received during start-up, before the first step: stopping "
                                    "now (no step has run, nothing to save)\n");
    std::snprintf(g_texts[sig].first, sizeof g_texts[sig].first, "%s", first.c_str());
    std::snprintf(g_texts[sig].second, sizeof g_texts[sig].second, "%s", second.c_str());
    std::snprintf(g_texts[sig].startup, sizeof g_texts[sig].startup, "%s", startup.c_str());
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    // Restart interrupted system calls: file writes and MPI polling go on.
    sa.sa_flags = SA_RESTART;
    struct sigaction old {};
    if (::sigaction(sig, &sa, &old) != 0) {
      const int e = errno;
      for (auto& [s, o] : saved_) ::sigaction(s, &o, nullptr);
      --g_depth;
      throw Error(cat("cannot install the handler for ", name, ": ", std::strerror(e)));
    }
    saved_.emplace_back(sig, old);
  }
}

StopSignals::~StopSignals() {
  for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) ::sigaction(it->first, &it->second, nullptr);
  if (--g_depth == 0) g_steps_begun.store(false);
}

void StopSignals::steps_begin() { g_steps_begun.store(true); }

int StopSignals::pending() { return g_pending.load(); }

void StopSignals::clear() { g_pending.store(0); }

}  // namespace loom
