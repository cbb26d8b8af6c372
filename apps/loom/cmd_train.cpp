// loom train CONFIG [--set section.key=value]...
#include <cstdio>
#include <filesystem>

#include "comm/launch.hpp"
#include "cli.hpp"
#include "commands.hpp"
#include "config/run_config.hpp"
#include "loom/error.hpp"
#include "train/checkpointing.hpp"
#include "train/outputs.hpp"
#include "train/runtime.hpp"
#include "train/session.hpp"
#include "train/stop_signal.hpp"

namespace loom::app {

int cmd_train(const Args& args) {
  const char* usage =
      "usage: loom train CONFIG [--set section.key=value]...\n"
      "  trains the model CONFIG describes (docs/CONFIG.md); under mpirun / srun every rank runs it";
  if (wants_help(args)) {
    std::printf("%s\n", usage);
    return 0;
  }
  ConfigArgs a = parse_config_args(args);
  if (!a.rest.empty()) throw Error(cat("unknown argument '", a.rest.front(), "'\n", usage));
  Config cfg = load_config(a.file, a.overrides);
  check_plugin_path(cfg);  // a search folder that is not there is refused, not passed over
  // Signals during start-up (loading weights, building kernels) are kept:
  // the run then stops before its first step, saying so, instead of dying.
  StopSignals signals(cfg.run.stop_signal);
  // The output folders before any device work: paths that cannot be written,
  // a previous run that would be overwritten, another run using them.
  check_output_paths(cfg);
  // The checkpoint to resume from, checked as resuming checks it (every file
  // but the tensor data) before any work. While checkpoint.dir does not exist
  // (no run holds it) that is before the lock creates it: a refused run
  // leaves nothing behind.
  const bool rank0 = launch_from_env().rank == 0;
  std::error_code ec;
  if (rank0 && !std::filesystem::exists(checkpoint_root(cfg), ec)) check_resume_checkpoint(cfg, run_model_spec(cfg));
  std::shared_ptr<OutputLock> lock;
  if (rank0) lock = OutputLock::acquire(cfg);  // first: a live run is the news
  if (rank0) check_resume_checkpoint(cfg, run_model_spec(cfg));
  check_no_overwrite(cfg, planned_resume_step(cfg));
  Session session(std::move(cfg));
  const RunSummary r = session.train();
  // Stopped by a signal after writing a checkpoint: the shell's convention for
  // "ended by that signal", so job scripts read it as an interruption.
  return r.stop_signal ? 128 + r.stop_signal : 0;
}

}  // namespace loom::app
