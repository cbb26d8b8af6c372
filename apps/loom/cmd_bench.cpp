// loom bench CONFIG [--set k=v]... [--steps N] [--warmup N] [--json FILE] [--breakdown]
//
// Times training steps of CONFIG's model, batch and recipe on synthetic data:
// warm-up steps excluded, the median step time over N steps (CUDA events on
// the GPU); tokens/s per GPU first, model TFLOP/s per GPU as NeMo counts them
// (causal attention, 6N + 6LhS a token: figures set beside NeMo's published
// ones need no conversion), MFU (docs/ARCHITECTURE.md "MFU": 6N + 12LhS against
// kMfuPeakFlops, loom/precision.hpp), the device memory in use after the steps
// (cudaMemGetInfo: the arena, the CUDA context, the libraries, NCCL; the
// fullest rank's under a launcher) beside the plan (the arena plus what lies
// beyond it, estimated: what `loom check` prints as "per rank in all") and
// the arena's size. One table row on stdout (rank 0), the same as JSON with
// --json. --breakdown adds per-part times of one
// extra step (units timed one at a time, so the parts add up to a bit more
// than a step); for a mixture of experts (model.ffn = "moe") also the MoE
// block's ranges, from one more forward and backward with each range timed
// on its own: moe.routing (jitter, router GEMM + softmax + top-k + sort,
// gather, combine, and their backward) and moe.experts (the expert GEMMs and
// SwiGLU, forward and backward), each range also as moe.<range>; and for
// every model the attention kernel alone over all layers from that pass
// (attention.forward, attention.backward).
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "commands.hpp"
#include "config/run_config.hpp"
#include "loom/error.hpp"
#include "loom/trace.hpp"
#include "train/session_probe.hpp"

namespace loom::app {
namespace {

int64_t int_flag(const std::string& v, const std::string& name) {
  try {
    size_t used = 0;
    const long long x = std::stoll(v, &used);
    if (used == v.size() && x > 0) return x;
  } catch (const std::exception&) {
  }
  throw Error(cat(name, " needs a positive integer, got '", v, "'"));
}

const char* kUsage =
    "usage: loom bench CONFIG [--set k=v]... [--steps N] [--warmup N] [--json FILE] [--breakdown]\n"
    "  times training steps of CONFIG's model, batch and recipe on synthetic data\n"
    "  --steps N      timed steps (default 20); --warmup N  untimed steps first (default 3)\n"
    "  --json FILE    also write the result as JSON (checked before the steps run)\n"
    "  --breakdown    add per-part times of one extra step\n"
    "  flags take their value as --flag=V or --flag V";

// The MoE block's ranges (blocks/ffn_moe.cpp): the routing steps and the experts.
constexpr const char* kMoeRouting[] = {"router_jitter", "router", "gather", "combine+residual", "combine.grad",
                                       "router.grad"};
constexpr const char* kMoeExperts[] = {"experts", "experts.grad"};

// A trace sink that times named compute ranges, each on its own: it waits for
// the queue at a range's start and end (breakdown only, never in training).
class RangeTimer final : public trace::Sink {
 public:
  explicit RangeTimer(Backend& be) : be_(be) {}
  void begin(trace::Track track, const char* name, void*) override {
    if (track != trace::Track::compute) return;
    be_.synchronize();
    open_.push_back({name, std::chrono::steady_clock::now()});
  }
  void end(trace::Track track, void*) override {
    if (track != trace::Track::compute || open_.empty()) return;
    be_.synchronize();
    const auto t = std::chrono::steady_clock::now();
    const Open o = open_.back();
    open_.pop_back();
    ms_[o.name] += std::chrono::duration<double, std::milli>(t - o.t0).count();
  }
  double ms(const char* name) const {
    const auto it = ms_.find(name);
    return it == ms_.end() ? 0.0 : it->second;
  }

 private:
  struct Open {
    std::string name;
    std::chrono::steady_clock::time_point t0;
  };
  Backend& be_;
  std::vector<Open> open_;
  std::map<std::string, double> ms_;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int cmd_bench(const Args& args) {
  if (wants_help(args)) {
    std::printf("%s\n", kUsage);
    return 0;
  }
  ConfigArgs a = parse_config_args(args, {"--steps", "--warmup", "--json"});
  int64_t steps = 20, warmup = 3;
  std::optional<std::string> json_path;
  bool breakdown = false;
  for (size_t i = 0; i < a.rest.size(); ++i) {
    const std::string& r = a.rest[i];
    if (auto v = flag_value(a.rest, i, "--steps")) steps = int_flag(*v, "--steps");
    else if (auto w = flag_value(a.rest, i, "--warmup")) warmup = int_flag(*w, "--warmup");
    else if (auto j = flag_value(a.rest, i, "--json")) json_path = *j;
    else if (r == "--breakdown") breakdown = true;
    else throw Error(cat("unknown argument '", r, "'\n", kUsage));
  }
  // Where the result goes, before the steps: a path that cannot be written
  // would otherwise throw the whole measurement away at the end.
  if (json_path) check_output_file("--json", *json_path);
  // No checkpoints, no evaluation; the schedule spans exactly the timed steps.
  std::vector<std::string> ov = a.overrides;
  for (const char* o : {"checkpoint.every=0", "checkpoint.resume=\"none\"", "train.validation_every=0", "train.warmup_steps=0"})
    ov.push_back(o);
  // One step past the timed ones: its start closes the last timed period (below).
  ov.push_back("train.steps=" + std::to_string(warmup + steps + 1 + (breakdown ? 1 : 0)));
  // A step-log ring (log_every + 1 rows) that holds every step read at the
  // end, so that no read runs early, with a host wait, among the timed steps.
  ov.push_back("train.log_every=" + std::to_string(steps + 2));
  Config cfg = load_config(a.file, ov);
  // Synthetic data, whatever the config reads: bench measures the step, not the input pipeline.
  if (cfg.data.plugin != "synthetic") {
    ConfigTable root = parse_config_table("[data]\nplugin = \"synthetic\"\n", "loom bench");
    PluginSection d;
    d.plugin = "synthetic";
    d.table = root.table("data");
    d.table.mark_used("plugin");
    cfg.data = d;
  }

  // Start-up (plugins, plan, arena, initial weights, and the attention
  // graphs a plugin builds ahead of the step, e.g. cuDNN's per document-count
  // bucket), reported beside the step times.
  const auto init_t0 = std::chrono::steady_clock::now();
  Session s(cfg);
  s.initialise();
  const double init_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - init_t0).count();
  SessionProbe inside(s);  // the step's parts, timed one by one (--breakdown), and the plan's numbers
  Backend& be = inside.backend();
  // Steps are queued as in training (the host never waits within a step).
  // A step's period runs from its start to the next step's start, so it
  // includes the previous step's optimizer running beside its forward. The
  // periods reported are those of steady steps only:
  //  - after the warm-up the host reads every step but the newest, whose
  //    optimizer is still running when the first timed step starts (reading
  //    it too would leave that step nothing to overlap: a shorter period);
  //  - one more step is queued after the timed ones: its start closes the
  //    last timed period (the last step queued has no successor, and its
  //    period would end with its own work: 204-211 against 219 ms on llama-1b).
  // The final read then holds the newest warm-up step, the timed steps and
  // the extra one; the first and the last are dropped.
  for (int64_t i = 0; i < warmup; ++i) s.train_step();
  (void)s.read_step_logs_but_newest();
  for (int64_t i = 0; i < steps + 1; ++i) s.train_step();
  std::vector<StepLog> logs = s.read_step_logs();
  LOOM_CHECK(static_cast<int64_t>(logs.size()) == steps + 2, "loom bench: read ", logs.size(),
             " step logs, expected the newest warm-up step, ", steps, " timed steps and one more");
  const StepLog last = logs.back();
  logs.pop_back();
  logs.erase(logs.begin());
  std::vector<double> ms;
  for (const StepLog& l : logs) ms.push_back(l.step_ms);
  const auto& t = cfg.train;
  // Tokens per step of one rank: tokens/s here is per GPU. The slowest rank
  // sets the pace; the fullest rank's memory is what has to fit.
  const double tokens_per_step = static_cast<double>(t.micro_batch * t.seq_len * t.grad_accum);
  const double med = all_reduce_scalar(s.host_comm(), median(ms), ReduceOp::max);
  const double tok_s = tokens_per_step / (med * 1e-3);
  const double mfu_now = mfu(s.spec().flops_per_token(t.seq_len), tok_s);
  const double tflops = tok_s * s.spec().causal_flops_per_token(t.seq_len) / 1e12;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const bool gpu = be.device() == Device::cuda;
  const double used = gpu ? static_cast<double>(be.device_memory_used()) : static_cast<double>(s.arena_bytes());
  const double mem = all_reduce_scalar(s.host_comm(), used, ReduceOp::max) / gib;
  const double arena = static_cast<double>(s.arena_bytes()) / gib;
  const double planned = static_cast<double>(s.planned_device_bytes()) / gib;
  const double outside_planned = static_cast<double>(inside.state().outside_arena_bytes()) / gib;

  nlohmann::json j = {{"config", a.file},
                      {"device", be.device_name()},
                      {"precision", cfg.precision.plugin},
                      {"attention", cfg.attention.plugin},
                      {"layers", cfg.model.layers},
                      {"recompute", cfg.model.recompute},
                      {"batch", t.micro_batch},
                      {"seq_len", t.seq_len},
                      {"grad_accum", t.grad_accum},
                      {"params", s.spec().total_params()},
                      {"active_params", s.spec().active_params()},  // MoE: what MFU counts; = params if dense
                      {"warmup_steps", warmup},
                      {"steps", steps},
                      {"ranks", s.world()},
                      {"startup_s", init_s},
                      {"median_step_ms", med},
                      {"min_step_ms", *std::min_element(ms.begin(), ms.end())},
                      {"max_step_ms", *std::max_element(ms.begin(), ms.end())},
                      {"tokens_per_s", tok_s},  // per GPU
                      {"tokens_per_s_per_gpu", tok_s},
                      {"model_tflops", tflops},
                      {"mfu", mfu_now},
                      {"device_mem_gib", mem},
                      {"planned_gib", planned},
                      {"mem_over_plan", mem / planned},
                      {"arena_gib", arena},
                      // What the process held beyond the arena, measured (on the fullest rank, its
                      // arena being every rank's) and as planned (train/memory_budget.hpp).
                      {"outside_arena_gib", gpu ? mem - arena : 0.0},
                      {"outside_arena_planned_gib", outside_planned},
                      {"final_loss", last.loss}};

  if (breakdown) {
    // One more step, one part at a time (each part synchronised), same data path.
    const float scale = 1.0f / static_cast<float>(t.micro_batch * t.seq_len);
    const int units = inside.model().num_units();
    nlohmann::json parts = nlohmann::json::object();
    auto timed = [&](const std::string& name, auto&& fn) {
      be.timer_start();
      fn();
      parts[name] = parts.value(name, 0.0) + be.timer_stop_ms();
    };
    inside.zero_grads();
    timed("forward.embedding", [&] { inside.forward_unit(0, true, scale); });
    for (int u = 1; u < units - 1; ++u) timed("forward.layers", [&] { inside.forward_unit(u, true, scale); });
    timed("forward.head(norm)", [&] { inside.forward_unit(units - 1, true, scale); });
    timed("backward.head+loss", [&] { inside.backward_unit(units - 1); });
    for (int u = units - 2; u >= 1; --u) timed("backward.layers", [&] { inside.backward_unit(u); });
    timed("backward.embedding", [&] { inside.backward_unit(0); });
    timed("optimizer", [&] { inside.optimizer_step(s.step()); });
    // One more forward and backward (no update) with the attention kernel's
    // ranges (and a MoE block's) timed one by one: attention alone, forward
    // and backward (with its recompute under model.recompute), every layer.
    RangeTimer rt(be);
    inside.zero_grads();
    be.synchronize();
    trace::Sink* prev = trace::g_sink.exchange(&rt);
    for (int u = 0; u < units; ++u) inside.forward_unit(u, true, scale);
    for (int u = units - 1; u >= 0; --u) inside.backward_unit(u);
    be.synchronize();
    trace::g_sink.store(prev);
    parts["attention.forward"] = rt.ms("attention");
    parts["attention.backward"] = rt.ms("attention.grad") + rt.ms("attention.recompute");
    if (s.spec().moe()) {
      double routing = 0, experts = 0;
      for (const char* n : kMoeRouting) routing += rt.ms(n);
      for (const char* n : kMoeExperts) experts += rt.ms(n);
      parts["moe.routing"] = routing;
      parts["moe.experts"] = experts;
      for (const char* n : kMoeRouting) parts[std::string("moe.") + n] = rt.ms(n);
      for (const char* n : kMoeExperts) parts[std::string("moe.") + n] = rt.ms(n);
    }
    j["breakdown_ms"] = parts;
  }

  if (s.rank() != 0) return 0;  // rank 0 reports for every rank (the numbers above are the run's)
  std::printf("%-28s %-14s %-10s %6s %6s %5s %13s %8s %7s %10s %9s %11s %9s\n", "config", "precision", "attention",
              "batch", "seq", "ranks", "tokens/s/GPU", "TFLOP/s", "MFU", "step ms", "mem GiB", "planned GiB",
              "arena GiB");
  std::printf("%-28s %-14s %-10s %6lld %6lld %5d %13.0f %8.1f %6.1f%% %10.2f %9.2f %11.2f %9.2f\n", a.file.c_str(),
              cfg.precision.plugin.c_str(), cfg.attention.plugin.c_str(), static_cast<long long>(t.micro_batch),
              static_cast<long long>(t.seq_len), s.world(), tok_s, tflops, 100.0 * mfu_now, med, mem, planned, arena);
  if (breakdown)
    for (auto& [k, v] : j["breakdown_ms"].items()) std::printf("  %-22s %9.2f ms\n", k.c_str(), v.get<double>());
  std::printf("BENCH_JSON %s\n", j.dump().c_str());
  if (json_path) {
    std::ofstream f(*json_path);
    if (!f) throw Error(cat("--json=", *json_path, ": cannot open it for writing (", std::strerror(errno), ")"));
    f << j.dump(2) << "\n";
    f.close();  // flushes: a full disk fails here, not silently
    if (!f) throw Error(cat("--json=", *json_path, ": writing it failed (", std::strerror(errno), "; disk full?)"));
  }
  return 0;
}

}  // namespace loom::app
