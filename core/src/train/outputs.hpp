// Where a run writes, checked before it starts (docs/RELIABILITY.md "Files"):
//
//   check_output_walk     the walk every output path gets, these and the
//                         command line's (`loom bench --json`, `loom compare
//                         --out`): every existing part a folder, no link to
//                         nowhere, not on a pseudo file system.
//   check_output_paths    run.out_dir and checkpoint.dir can be created and
//                         written (check_output_walk, a name too long, a
//                         read-only or unwritable place), naming the key and
//                         the path; creates nothing. Also
//                         check_checkpoint_names.
//   check_checkpoint_names every step_N name in checkpoint.dir is a folder:
//                         a file, FIFO, device or link to one there would
//                         make the save of step N fail after training to it.
//   check_no_overwrite    a fresh run never replaces a previous run's results
//                         (metrics.jsonl, complete checkpoints) unless
//                         run.overwrite = true says so.
//   OutputLock            an exclusive lock (flock) on out_dir and on
//                         checkpoint.dir, held while the run lives: a second
//                         run on either folder is refused, naming the process
//                         that holds it.
//                         The kernel drops it when the process ends, even on
//                         kill -9, so there is never a stale lock to clean.
//   prepare_run_files     what rank 0 does to the folder before step 1:
//                         set the previous run aside (run.overwrite: a
//                         ReplacedRun), trim metrics.jsonl to the resumed
//                         step, write config.toml.
//   ReplacedRun           run.overwrite = true on a fresh start: the previous
//                         run is removed only once this run has something of
//                         its own (its first checkpoint, or its end); a run
//                         that fails before puts it back as it was.
//   probe_writable        a real write (create, write, fsync, remove) into a
//                         folder: a full disk or a read-only mount fails here,
//                         before any step, instead of at the first save.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/run_config.hpp"

namespace loom {

// The walk every output path gets before anything is created in it: down
// from the root, every part of `path` that exists must be a folder (a file,
// a FIFO, a device or a link to one there is refused), a symbolic link whose
// target does not exist is refused naming the target (creating the folder
// would only meet the link: "File exists"), and the deepest existing folder,
// where the rest would be created, must be a place for files: not /proc,
// /sys or /dev or below them (/dev/shm excepted), nor any folder on a
// kernel pseudo file system (proc, sysfs, cgroup, devpts, debugfs, ... by
// statfs type, wherever mounted). Each message starts with `given` (what the
// user wrote: `run.out_dir = "x"`, `--json=x`) and ends with `remedy`
// ("choose another run.out_dir"). Returns the deepest existing folder;
// creates nothing.
std::filesystem::path check_output_walk(const std::string& given, const std::string& remedy, const std::string& path);

void check_output_paths(const Config& cfg);
void check_checkpoint_names(const Config& cfg);

// `resume_step`: the step the run resumes from, nullopt for a fresh start.
void check_no_overwrite(const Config& cfg, std::optional<int64_t> resume_step);

// The step checkpoint.resume will resume from, read from the files only
// (nullopt: a fresh start). Errors for a missing step are left to resuming.
std::optional<int64_t> planned_resume_step(const Config& cfg);

class OutputLock {
 public:
  // Creates out_dir (and checkpoint.dir) and locks them; throws loom::Error
  // naming the key, the path and the holder when another run has them. Locks
  // are per process and path: acquiring one this process already holds
  // shares it.
  static std::shared_ptr<OutputLock> acquire(const Config& cfg);
  ~OutputLock();
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;
  struct Held;  // one locked folder, shared by every holder in this process

 private:
  OutputLock() = default;
  std::vector<std::shared_ptr<Held>> held_;
};

// The previous run that run.overwrite = true replaces, on a fresh start. Its
// checkpoints stay in checkpoint.dir and its metrics.jsonl is moved to
// metrics.jsonl.replaced until remove(), which the session calls just before
// its first checkpoint is written, or at the end of a run that writes none.
// If the object dies without remove() (a config, data or numeric error at
// step 0 or 1, a stop before any step), the new run's metrics.jsonl gives way
// to the previous one again and nothing of the previous run is lost. A
// process killed in between leaves metrics.jsonl.replaced beside the previous
// run's checkpoints; the next run in the folder puts it back first
// (prepare_run_files) and says so.
class ReplacedRun {
 public:
  ReplacedRun(const Config& cfg, std::vector<std::string> checkpoints, bool had_metrics);
  ~ReplacedRun();
  ReplacedRun(const ReplacedRun&) = delete;
  ReplacedRun& operator=(const ReplacedRun&) = delete;
  // Removes the previous run's checkpoints and metrics (once; later calls do nothing).
  void remove();

 private:
  std::string out_dir_;
  std::vector<std::string> checkpoints_;  // the previous run's step folders
  bool had_metrics_ = false;
  bool removed_ = false;
};

// Returns the previous run that this run replaces (run.overwrite = true on a
// fresh start over one), or null.
std::unique_ptr<ReplacedRun> prepare_run_files(const Config& cfg, std::optional<int64_t> resume_step);

// Creates, writes, fsyncs and removes a small file in `dir`; throws naming
// `key`, the path and the system's reason.
void probe_writable(const std::string& key, const std::string& dir, const std::string& probe_name);

// Creates `dir` (and its parents) for `key`, with a message naming both on failure.
void create_output_dir(const std::string& key, const std::string& dir);

}  // namespace loom
