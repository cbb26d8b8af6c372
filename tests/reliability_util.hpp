// Helpers of the reliability suites (tests/test_reliability_*.cpp and
// tests/mpi/test_reliability_mpi.cpp): running `loom` as a process the way a
// user does — in the foreground or the background, with signals — and small
// configs that train in well under a second a step on the CPU.
#pragma once
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>

namespace loom::test {

struct ProcResult {
  int code = -1;   // exit status, -1 when killed by a signal
  int signal = 0;  // the signal that killed it, 0 when it exited
  std::string out; // stdout and stderr together
};

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline int count_lines(const std::filesystem::path& p) {
  std::ifstream in(p);
  int n = 0;
  for (std::string l; std::getline(in, l);)
    if (!l.empty()) ++n;
  return n;
}

inline ProcResult decode_status(int status, std::string out) {
  ProcResult r;
  r.out = std::move(out);
  if (WIFEXITED(status)) r.code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  return r;
}

// Runs `cmd` through /bin/sh with stdout and stderr captured.
inline ProcResult run_shell(const std::string& cmd) {
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return {};
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  return decode_status(::pclose(p), out);
}

// Polls `done` every 20 ms until it holds or `timeout_s` passes.
inline bool wait_for(const std::function<bool()>& done, double timeout_s) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < end) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return done();
}

// A command running in the background (`exec`ed by /bin/sh, so pid is the
// command's own), its output in a file.
class Background {
 public:
  Background(const std::string& cmd, const std::filesystem::path& log) : log_(log) {
    const std::string line = "exec " + cmd + " > '" + log.string() + "' 2>&1";  // built before fork: the child only execs
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);  // its own group: a test's signal reaches it alone
      ::execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  ~Background() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      int st;
      ::waitpid(pid_, &st, 0);
    }
  }
  Background(const Background&) = delete;
  Background& operator=(const Background&) = delete;

  pid_t pid() const { return pid_; }
  void signal(int sig) const { ::kill(pid_, sig); }
  std::string output() const { return read_text(log_); }
  // Waits for the process; kills it (and fails) after timeout_s.
  ProcResult wait(double timeout_s) {
    int status = 0;
    const bool ended = wait_for([&] { return ::waitpid(pid_, &status, WNOHANG) == pid_; }, timeout_s);
    if (!ended) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
      ADD_FAILURE() << "the process did not end within " << timeout_s << " s; output:\n" << output();
    }
    reaped_ = true;
    return decode_status(status, output());
  }

 private:
  std::filesystem::path log_;
  pid_t pid_ = -1;
  bool reaped_ = false;
};

// The e2e suite's small model on synthetic "ramp" data (learnable, no files).
// `steps` optimizer steps; everything else can be overridden with --set.
inline std::string tiny_config(const std::filesystem::path& out, int64_t steps = 20) {
  std::ostringstream s;
  s << "[run]\nname = \"rel\"\nout_dir = \"" << out.string() << "\"\ndevice = \"cpu\"\nseed = 7\nthreads = 1\n"
    << "plugin_path = [\"" << LOOM_TEST_PLUGIN_DIR << "\"]\n"
    << "[model]\nhidden = 64\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nffn_hidden = 160\n"
    << "vocab_size = 96\nmax_seq_len = 64\n"
    << "[train]\nsteps = " << steps << "\nmicro_batch = 4\nseq_len = 31\ngrad_accum = 2\nlr = 3e-3\n"
    << "warmup_steps = 0\nschedule = \"constant\"\n"
    << "[checkpoint]\nevery = 0\nresume = \"auto\"\n"
    << "[data]\nplugin = \"synthetic\"\npattern = \"ramp\"\n";
  return s.str();
}

// A fresh folder under the build tree's test_tmp (removed first).
inline std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path d = std::filesystem::path(LOOM_BINARY_DIR) / "test_tmp" / "reliability" / name;
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

inline bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace loom::test

#define EXPECT_CONTAINS(text, part) EXPECT_TRUE(::loom::test::has(text, part)) << "missing '" << (part) << "' in:\n" << (text)
