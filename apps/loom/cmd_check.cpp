// loom check CONFIG [--set section.key=value]... [--world N [--gpus-per-node G]]:
// validate everything a run would validate (config, output folders, plugins
// and their tables, data files, the checkpoint it would resume or the HF
// weights it would start from, attention support, whether the memory plan
// fits) and print the model size and the memory plan, without training. The
// world is the launcher's (mpirun / srun start loom check on every rank), or
// with --world the plan of rank 0 of N ranks, G per node, none started.
#include <cstdio>
#include <string>

#include "commands.hpp"
#include "config/run_config.hpp"
#include "loom/error.hpp"
#include "hf/hf_llama.hpp"
#include "train/checkpointing.hpp"
#include "train/outputs.hpp"
#include "train/runtime.hpp"
#include "train/session.hpp"

namespace loom::app {

int cmd_check(const Args& args) {
  ConfigArgs a = parse_config_args(args);
  const char* usage = "usage: loom check CONFIG [--set section.key=value]... [--world N [--gpus-per-node G]]";
  if (a.file.empty()) throw Error(usage);
  SessionOptions opts;
  for (size_t i = 0; i < a.rest.size(); ++i) {
    const std::string& r = a.rest[i];
    int* into = r == "--world" ? &opts.plan_world : r == "--gpus-per-node" ? &opts.plan_local_world : nullptr;
    if (!into) throw Error(cat("loom check: unknown argument '", r, "'; ", usage));
    if (i + 1 >= a.rest.size()) throw Error(cat("loom check: ", r, " needs a number of ranks; ", usage));
    const std::string& v = a.rest[++i];
    size_t used = 0;
    long n = 0;
    try {
      n = std::stol(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != v.size() || n < 1 || n > 1 << 20)
      throw Error(cat("loom check: ", r, " ", v, " is not a number of ranks in [1, 1048576]"));
    *into = static_cast<int>(n);
  }
  if (opts.plan_local_world > 0 && opts.plan_world == 0)
    throw Error(cat("loom check: --gpus-per-node needs --world (the number of ranks to plan for); ", usage));
  Config cfg = load_config(a.file, a.overrides);
  check_plugin_path(cfg);  // a search folder that is not there is refused, not passed over
  check_output_paths(cfg);
  check_no_overwrite(cfg, planned_resume_step(cfg));
  Session session(std::move(cfg), opts);
  // What train would start from, checked as train checks it: the checkpoint
  // it would resume (all but the tensor data), else an HF folder's weights
  // (headers and sizes; none is read).
  const Config& c = session.config();
  if (!check_resume_checkpoint(c, session.spec()) && c.model.init.rfind("hf:", 0) == 0)
    hf::load_hf_llama_weights(c.model.init.substr(3), session.spec(), [](const std::string&, int64_t) -> float* {
      return nullptr;
    });
  std::printf("%s\n", session.describe().c_str());
  std::fflush(stdout);
  session.check_memory_fits();  // after the plan is printed: the error refers to it
  std::printf("%s: ok\n", a.file.c_str());
  return 0;
}

}  // namespace loom::app
