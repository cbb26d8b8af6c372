// loom check CONFIG [--set section.key=value]... [--world-size N [--gpus-per-node G]]
//                   [--gpu NAME | --device-memory SIZE] [--breakdown] [--no-scan]:
// validate everything a run would validate (config, output folders, plugins
// and their tables, data files, the checkpoint it would resume and its data
// position, or the HF weights it would start from, attention support,
// whether the memory plan fits) and print the model size and the memory
// plan, without training. The
// world is the launcher's (mpirun / srun start loom check on every rank), or
// with --world-size (or --world) the plan of rank 0 of N ranks, G per node,
// none started. --gpu / --device-memory plan a CUDA run for that GPU on a
// machine that has none (a login node): no device is touched, the plan
// includes what the process would hold beyond the arena (CUDA context,
// libraries, NCCL), and the answer is whether it fits; with --world-size
// too, a plan that does not fit is planned again at more ranks, and the
// refusal names the fewest that fit (or says more ranks do not help).
// Data plugins that can (loom/data.hpp TokenScan: tokens, megatron) read
// every token of the train and validation data, checked against the
// vocabulary, which a run does only as it reaches each window; --no-scan
// leaves that out (the plan of a run on a corpus too large to read now).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "cli.hpp"
#include "commands.hpp"
#include "config/run_config.hpp"
#include "loom/error.hpp"
#include "hf/hf_llama.hpp"
#include "train/checkpointing.hpp"
#include "train/memory_budget.hpp"
#include "train/outputs.hpp"
#include "train/runtime.hpp"
#include "train/session.hpp"
#include "util/quiet_log.hpp"

namespace loom::app {
namespace {

// The config planned again at `world` ranks (the same card, file, overrides
// and ranks per node). nullopt when it is refused for anything but memory (a
// strategy that cannot use that many ranks).
struct RankPlan {
  bool fits = false;
  double need = std::numeric_limits<double>::infinity();  // per rank, the plan and beyond; infinite if refused early
};
std::optional<RankPlan> plan_at(const ConfigArgs& a, SessionOptions o, int world) {
  o.plan_world = world;
  try {
    Session s(load_config(a.file, a.overrides), o);
    RankPlan r;
    r.need = static_cast<double>(s.planned_device_bytes());
    try {
      s.check_memory_fits();
      r.fits = true;
    } catch (const MemoryPlanError&) {
    }
    return r;
  } catch (const MemoryPlanError&) {
    return RankPlan{};
  } catch (const Error&) {
    return std::nullopt;
  }
}

// After the plan at --world-size W does not fit a planned GPU: the fewest
// ranks (a multiple of --gpus-per-node) at which it would, found by planning
// again, doubling and then halving the gap. Under a sharded strategy the
// state's share shrinks with the ranks and the rest does not, so only a plan
// says when it fits. Says so when more ranks do not shrink it (each keeps a
// whole copy, or the activations alone exceed the card); empty when not
// planning ranks for a card. `refused` is the plan at --world-size that did
// not fit (its need infinite when the early check refused it).
std::string ranks_that_fit(const ConfigArgs& a, const SessionOptions& opts, const RankPlan& refused) {
  if (opts.plan_world <= 0 || !opts.plan_device) return {};
  const QuietLog quiet;  // each plan would log its set-up again
  constexpr int kMostRanks = 1 << 20;
  const int step = std::max(1, opts.plan_local_world);
  const std::string per_node = opts.plan_local_world > 0 ? cat(" --gpus-per-node ", step) : std::string();
  int lo = opts.plan_world;  // does not fit
  RankPlan lo_plan = refused;
  int hi = 0;
  RankPlan hi_plan;
  for (long w = (2L * lo + step - 1) / step * step; w <= kMostRanks; w = (2L * w + step - 1) / step * step) {
    const std::optional<RankPlan> p = plan_at(a, opts, static_cast<int>(w));
    if (!p) return {};
    if (p->fits) {
      hi = static_cast<int>(w);
      hi_plan = *p;
      break;
    }
    // Refused by the early check (need infinite), the share still shrinks: go on doubling.
    if (std::isfinite(p->need) && std::isfinite(lo_plan.need) && p->need >= lo_plan.need * 0.995)
      return cat(" More ranks do not make it fit: at --world-size ", w, per_node, " each rank still needs ",
                 human_bytes(p->need), " (", human_bytes(lo_plan.need), " at ", lo, ").");
    lo = static_cast<int>(w);
    lo_plan = *p;
  }
  if (hi == 0)
    return lo == opts.plan_world ? std::string()
                                 : cat(" More ranks do not make it fit: not at --world-size ", lo, per_node, " either.");
  while (hi - lo > step) {
    const int mid = std::max(lo + step, (lo + (hi - lo) / 2) / step * step);
    if (mid >= hi) break;
    const std::optional<RankPlan> p = plan_at(a, opts, mid);
    if (p && p->fits) {
      hi = mid;
      hi_plan = *p;
    } else {
      lo = mid;
    }
  }
  return cat(" With more ranks it fits: at --world-size ", hi, per_node, " (the other flags as given) the plan takes ",
             human_bytes(hi_plan.need), " per rank of ", human_bytes(static_cast<double>(opts.plan_device->total)),
             ", the fewest ranks", step > 1 ? cat(" in nodes of ", step) : std::string(), " that fit.");
}

}  // namespace

int cmd_check(const Args& args) {
  const std::string usage = cat(
      "usage: loom check CONFIG [--set section.key=value]... [--world-size N [--gpus-per-node G]]\n"
      "                  [--gpu NAME | --device-memory SIZE] [--breakdown] [--no-scan]\n"
      "  validates everything a run would (config, output folders, plugins and their keys, data files, attention\n"
      "  support, the memory plan) and prints the model size and the memory plan, without training\n"
      "  --world-size N     plan rank 0 of N ranks (under mpirun / srun: the launcher's ranks); --world N is the same\n"
      "  --gpus-per-node G  ranks per node of those N (default: all on one node); G must divide N\n"
      "  --gpu NAME         plan the CUDA run for this GPU without one (a login node): ", named_gpu_list(), "\n"
      "  --device-memory SIZE  the same for a GPU of SIZE device memory (80GiB, 81559MiB, 141GB)\n"
      "  --breakdown        print the plan part by part (each buffer, the layers' summed)\n"
      "  --no-scan          do not read every token of the train and validation data (a corpus too large to read now)");
  if (wants_help(args)) {
    std::printf("%s\n", usage.c_str());
    return 0;
  }
  ConfigArgs a = parse_config_args(args, {"--world", "--world-size", "--gpus-per-node", "--gpu", "--device-memory"});
  SessionOptions opts;
  bool scan = true, breakdown = false;
  std::optional<std::string> gpu, device_memory;
  for (size_t i = 0; i < a.rest.size(); ++i) {
    const std::string& r = a.rest[i];
    if (r == "--no-scan") {
      scan = false;
      continue;
    }
    if (r == "--breakdown") {
      breakdown = true;
      continue;
    }
    if (auto v = flag_value(a.rest, i, "--gpu")) {
      gpu = *v;
      continue;
    }
    if (auto v = flag_value(a.rest, i, "--device-memory")) {
      device_memory = *v;
      continue;
    }
    std::optional<std::string> v;
    int* into = nullptr;
    const char* flag = nullptr;
    for (const char* f : {"--world", "--world-size", "--gpus-per-node"})
      if ((v = flag_value(a.rest, i, f))) {
        flag = f;
        into = std::string_view(f) == "--gpus-per-node" ? &opts.plan_local_world : &opts.plan_world;
        break;
      }
    if (!into) throw Error(cat("unknown argument '", r, "'\n", usage));
    size_t used = 0;
    long n = 0;
    try {
      n = std::stol(*v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != v->size() || n < 1 || n > 1 << 20)
      throw Error(cat(flag, " ", *v, " is not a number of ranks in [1, 1048576]"));
    *into = static_cast<int>(n);
  }
  if (opts.plan_local_world > 0 && opts.plan_world == 0)
    throw Error(cat("--gpus-per-node needs --world-size (the number of ranks to plan for)\n", usage));
  // Nodes hold equal numbers of ranks: the plan's node-local world must divide the world.
  if (opts.plan_local_world > 0 && opts.plan_world % opts.plan_local_world != 0)
    throw Error(cat("--world ", opts.plan_world, " is not a multiple of --gpus-per-node ", opts.plan_local_world,
                    ": every node holds the same number of ranks; give a --gpus-per-node that divides ",
                    opts.plan_world, " or a --world that is a multiple of ", opts.plan_local_world));
  if (gpu && device_memory)
    throw Error(cat("--gpu ", *gpu, " and --device-memory ", *device_memory,
                    " both say which GPU to plan for: give one (--device-memory for a card --gpu does not name)"));
  if (gpu) opts.plan_device = named_gpu(*gpu);
  if (device_memory) {
    const uint64_t bytes = parse_memory_size(*device_memory, "--device-memory");
    opts.plan_device = PlannedDevice{cat("a GPU of ", human_bytes(static_cast<double>(bytes)), " (--device-memory ",
                                         *device_memory, ")"),
                                     bytes};
  }
  Config cfg = load_config(a.file, a.overrides);
  check_plugin_path(cfg);  // a search folder that is not there is refused, not passed over
  check_output_paths(cfg);
  check_no_overwrite(cfg, planned_resume_step(cfg));
  // A plan that does not fit a card planned for says how many ranks would.
  auto with_ranks = [&](const MemoryPlanError& e, const RankPlan& refused) {
    const std::string more = ranks_that_fit(a, opts, refused);
    return MemoryPlanError(more.empty() ? std::string(e.what()) : cat(e.what(), ".", more));
  };
  std::unique_ptr<Session> planned;
  try {
    planned = std::make_unique<Session>(std::move(cfg), opts);
  } catch (const MemoryPlanError& e) {
    throw with_ranks(e, RankPlan{});  // refused by the early check: no detailed plan
  }
  Session& session = *planned;
  // What train would start from, checked as train checks it: the checkpoint
  // it would resume (all but the tensor data) and its data position (given to
  // the data plugin as resuming gives it), else an HF folder's weights
  // (headers and sizes; none is read).
  const Config& c = session.config();
  if (!session.check_resume_checkpoint() && c.model.init.rfind("hf:", 0) == 0)
    hf::load_hf_llama_weights(c.model.init.substr(3), session.spec(), [](const std::string&, int64_t) -> float* {
      return nullptr;
    });
  std::printf("%s\n", session.describe().c_str());
  if (breakdown) std::printf("%s\n", session.plan_breakdown().c_str());
  std::fflush(stdout);
  try {
    session.check_memory_fits();  // after the plan is printed: the error refers to it
  } catch (const MemoryPlanError& e) {
    throw with_ranks(e, RankPlan{false, static_cast<double>(session.planned_device_bytes())});
  }
  // Training checks tokens only as windows reach them; here every one is
  // read, so data that would stop a run hours in is refused before it starts.
  const auto t0 = std::chrono::steady_clock::now();
  if (!scan) {
    std::printf("data: tokens not scanned (--no-scan); a run checks them as it reads them\n");
  } else if (const std::optional<TokenScanReport> report = session.scan_data_tokens()) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("data: %llu tokens of %s scanned in %.2f s: every one is below model.vocab_size = %lld\n",
                static_cast<unsigned long long>(report->tokens), report->what.c_str(), s,
                static_cast<long long>(session.spec().vocab_size));
  } else {
    std::printf("data: data.plugin = \"%s\" cannot scan its tokens ahead; they are checked as they are read\n",
                session.config().data.plugin.c_str());
  }
  std::printf("%s: ok\n", a.file.c_str());
  return 0;
}

}  // namespace loom::app
