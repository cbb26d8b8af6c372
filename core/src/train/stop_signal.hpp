// Stopping a run on a signal without losing it (docs/RELIABILITY.md "Signals").
//
// While a StopSignals object lives (Session::train), SIGTERM, SIGINT, SIGHUP
// and the config's run.stop_signal (SIGUSR1 by default: Slurm's
// --signal=USR1@120 early warning) no longer kill the process. The first one
// is recorded and announced on stderr; the step loop sees it at the next step
// boundary (on every rank the same step: the ranks agree through a host
// all-reduce of the flag each step), writes a checkpoint and stops with exit
// code 128 + the signal's number. A second signal ends the process at once
// (_exit(128 + signal)), without a checkpoint: the last complete one stays,
// and a partly written one never counts (COMPLETE is written last).
//
// During start-up — from the outermost object's construction until
// steps_begin(), i.e. before this process's first step — no step has run and
// there is nothing to save, so the first signal ends the process at once from
// the handler (saying so, exit code 128 + the signal's number): a start-up
// blocked in a system call (a read the handler's SA_RESTART resumes, a hung
// library initialiser, a slow file system) is ended by one signal, not two.
// What start-up writes is written as a kill -9 at any point leaves it usable
// (tmp + rename, COMPLETE last, the lock released by the kernel).
#pragma once
#include <csignal>
#include <string>
#include <utility>
#include <vector>

namespace loom {

class StopSignals {
 public:
  // `extra`: run.stop_signal ("USR1", "USR2" or "none"). The outermost
  // object forgets any earlier signal; a nested one (Session::train within
  // `loom train`, which installs them before start-up) keeps it.
  explicit StopSignals(const std::string& extra);
  ~StopSignals();  // restores the handlers that were there before
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The first stop signal received while handlers are installed, 0 if none.
  static int pending();
  // Forgets a received signal.
  static void clear();
  // The first step is about to begin: from now on the first signal finishes
  // the current step and checkpoints it (until the outermost object goes).
  static void steps_begin();

 private:
  std::vector<std::pair<int, struct sigaction>> saved_;
};

// "SIGTERM", "SIGUSR1", ... ("signal 42" for others).
std::string signal_name(int sig);
// run.stop_signal's value as a signal number; 0 for "none".
int stop_signal_number(const std::string& name);

}  // namespace loom
