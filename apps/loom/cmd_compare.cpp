// loom compare CONFIG --strategies=ddp,zero1,... [--configs=B.toml,C.toml] [--steps=N] [--warmup=N]
//              [--validate=N] [--out=DIR] [--peer=FILE]... [--set k=v]...
//
// A strategy may carry [sharding] keys of its own after colons, each a TOML
// value: --strategies=zero3,hybrid_shard:shard_group_size=2 runs hybrid_shard
// with sharding.shard_group_size = 2 (its row is labelled the same way).
//
// Runs CONFIG once per sharding strategy (or each config of --configs as it
// is) for the same steps and seed, under the launcher this process was started
// by (mpirun -np 4 loom compare ...), and reports one row per run: median step
// time, tokens/s per GPU, peak memory per GPU (device memory in use; the arena
// on CPU), bytes moved per step by collective kind, final loss and the largest
// |loss - first row's loss| over all steps; with --validate=N each run also
// evaluates every N steps (and at the end) and the validation losses are
// compared the same way (native against fused layers, say). Rank 0 prints the
// table and writes DIR/compare.csv, DIR/compare_losses.csv (and
// DIR/compare_val_losses.csv) and DIR/compare.png. --peer adds
// rows from benchmarks/torch_fsdp.py's PEER_JSON lines (e.g. PyTorch FSDP2).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "comm/launch.hpp"
#include "cli.hpp"
#include "commands.hpp"
#include "compare_report.hpp"
#include "config/run_config.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"
#include "train/memory_budget.hpp"
#include "train/session.hpp"
#include "util/files.hpp"

namespace fs = std::filesystem;

namespace loom::app {
namespace {

const char* kUsage =
    "usage: loom compare CONFIG [--strategies=a,b:key=value,...] [--configs=B.toml,...] [--steps=N] [--warmup=N] "
    "[--validate=N] [--out=DIR] [--peer=FILE]... [--set k=v]...\n"
    "  runs CONFIG once per sharding strategy (or each config of --configs) for the same steps and reports step time,\n"
    "  tokens/s, memory, traffic and losses (a table, DIR/compare.csv and DIR/compare.png; --out default runs/compare)\n"
    "  --peer FILE  adds rows from benchmarks/torch_fsdp.py's PEER_JSON lines\n"
    "  flags take their value as --flag=V or --flag V";

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

// The items of --strategies=... or --configs=...: an empty list (a shell
// variable that expanded to nothing) would silently compare the base config
// with itself, so it is refused.
std::vector<std::string> nonempty_list(const std::string& flag, const std::string& value) {
  std::vector<std::string> items = split_list(value);
  if (items.empty())
    throw Error(cat(flag, "=", value, " names nothing to compare: give a comma-separated list, e.g. ", flag, "=",
                    flag == "--strategies" ? "ddp,zero3" : "b.toml,c.toml"));
  return items;
}

int64_t positive(const std::string& v, const std::string& name) {
  try {
    size_t used = 0;
    const long long x = std::stoll(v, &used);
    if (used == v.size() && x >= 0) return x;
  } catch (const std::exception&) {
  }
  throw Error(cat(name, " needs a non-negative integer, got '", v, "'"));
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Job {
  std::string label;
  std::string file;
  std::vector<std::string> overrides;
  // A --strategies item: the strategy it names and the [sharding] keys it sets.
  std::string strategy;
  std::vector<std::string> item_keys;
};

// One --strategies item: "name" or "name:key=value:key=value" (the keys are
// the strategy's own [sharding] keys, the values TOML).
Job strategy_job(const std::string& item, const std::string& file, const std::vector<std::string>& common) {
  std::vector<std::string> parts;
  std::stringstream ss(item);
  for (std::string p; std::getline(ss, p, ':');) parts.push_back(p);
  Job j{item, file, common, "", {}};
  if (parts.empty() || parts[0].empty())
    throw Error(cat("loom compare: --strategies item '", item, "' names no strategy; write name or "
                    "name:key=value, e.g. hybrid_shard:shard_group_size=2"));
  j.strategy = parts[0];
  j.overrides.push_back("sharding.plugin=\"" + parts[0] + "\"");
  for (size_t i = 1; i < parts.size(); ++i) {
    const size_t eq = parts[i].find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == parts[i].size() || parts[i].find('.') < eq)
      throw Error(cat("loom compare: --strategies item '", item, "': '", parts[i], "' is not key=value (a key of ",
                      "the strategy's [sharding] table and a TOML value, e.g. shard_group_size=2)"));
    std::string key = parts[i].substr(0, eq);
    while (!key.empty() && key.back() == ' ') key.pop_back();
    while (!key.empty() && key.front() == ' ') key.erase(0, 1);
    if (std::find(j.item_keys.begin(), j.item_keys.end(), key) != j.item_keys.end())
      throw Error(cat("loom compare: --strategies item '", item, "' sets '", key, "' twice; give each key once"));
    j.item_keys.push_back(key);
    j.overrides.push_back("sharding." + parts[i]);
  }
  return j;
}

// The keys a --strategies item may set: the [sharding] keys its strategy
// reads (what its table accepts, found by building the strategy without the
// item's keys, as `loom check` would) and the core's row-wide ones
// (expert_parallel) — never `plugin` or `path`, which pick the code that runs
// and would run another strategy under this row's name. Refuses a key that
// is not one, naming the item, the key and the keys the strategy accepts.
// Keys the strategy's own table does not take are refused by the strategy
// when the row is built (its message lists them too).
void check_item_keys(const Job& j, const std::vector<std::string>& common) {
  if (j.item_keys.empty()) return;
  std::vector<std::string> bare = common;
  bare.push_back("sharding.plugin=\"" + j.strategy + "\"");
  std::vector<std::string> accepted;
  std::string stopped;
  try {
    Config cfg = load_config(j.file, bare);
    try {
      Session probe(cfg);
    } catch (const Error& e) {
      stopped = e.what();  // e.g. started without a launcher: the table was read before that was found
    }
    for (const std::string& k : cfg.sharding.table.read_keys())
      if (k != "plugin" && k != "path") accepted.push_back(k);
  } catch (const Error&) {
    return;  // the config itself is refused: the row's own probe says so
  }
  std::string list;
  for (const std::string& k : accepted) list += cat(list.empty() ? "" : ", ", k);
  for (const std::string& k : j.item_keys) {
    if (k != "plugin" && k != "path" && (std::find(accepted.begin(), accepted.end(), k) != accepted.end() ||
                                         !stopped.empty()))
      continue;
    throw Error(cat("loom compare: --strategies item '", j.label, "': '", k, "' is not one of strategy ", j.strategy,
                    "'s own [sharding] keys",
                    k == "plugin" ? " (the item's name picks the strategy; write another strategy as an item of its own, "
                                    "e.g. --strategies=" + j.strategy + ",none)"
                    : k == "path" ? " (a plugin file given here would run under this row's name)"
                                  : "",
                    ", so the row would not run what its label says. The keys ", j.strategy, " accepts: ",
                    list.empty() ? std::string("none") : list));
  }
}

// One run: warmup + steps optimizer steps; everything measured on the timed steps.
report::CompareRow run_one(const Job& job, int64_t steps, int64_t warmup) {
  report::CompareRow row;
  row.label = job.label;
  Config cfg = load_config(job.file, job.overrides);
  Session s(cfg);
  row.ranks = s.world();
  // The plan with what the process holds beyond it (estimated on a GPU):
  // what "peak mem", the device memory in use, is to be set against.
  row.planned_mem_bytes = static_cast<double>(s.planned_device_bytes());
  s.initialise();
  std::vector<double> ms;
  CommBytes before{};
  const auto& tc = cfg.train;
  const int64_t total = warmup + steps;
  for (int64_t i = 0; i < total; ++i) {
    if (i == warmup) before = s.comm().bytes_moved();
    s.train_step();
    const int64_t done = i + 1;
    const bool validate = tc.validation_every > 0 && (done % tc.validation_every == 0 || done == total);
    // Steps run ahead of the host; their numbers are read back at log steps,
    // at the end of the warm-up, at evaluations and at the end.
    if (done % tc.log_every != 0 && done != warmup && done != total && !validate) continue;
    for (const StepLog& l : s.read_step_logs()) {
      row.losses.push_back(l.loss);
      if (l.step > warmup) ms.push_back(l.step_ms);
    }
    if (validate) row.val_losses.emplace_back(done, s.evaluate());
  }
  const CommBytes after = s.comm().bytes_moved();
  for (size_t k = 0; k < row.bytes_per_step.size() && k < after.bytes.size(); ++k)
    row.bytes_per_step[k] = static_cast<double>(after.bytes[k] - before.bytes[k]) / static_cast<double>(steps);
  // The slowest rank sets the pace; the largest rank's memory is what has to fit.
  row.step_ms = all_reduce_scalar(s.host_comm(), median(ms), ReduceOp::max);
  const auto& t = cfg.train;
  row.tokens_per_s_per_gpu = static_cast<double>(t.micro_batch * t.seq_len * t.grad_accum) / (row.step_ms * 1e-3);
  const double used = static_cast<double>(s.memory_in_use());  // the device's on a GPU, the arena on the CPU
  row.peak_mem_bytes = all_reduce_scalar(s.host_comm(), used, ReduceOp::max);
  row.final_loss = row.losses.empty() ? 0 : row.losses.back();
  row.note = cat(cfg.sharding.plugin, " ", cfg.precision.plugin, " ", s.device_name());
  return row;
}

}  // namespace

int cmd_compare(const Args& args) {
  if (wants_help(args)) {
    std::printf("%s\n", kUsage);
    return 0;
  }
  ConfigArgs a = parse_config_args(
      args, {"--strategies", "--configs", "--steps", "--warmup", "--out", "--peer", "--validate"});
  int64_t steps = 20, warmup = 3, validate = 0;
  std::string out_dir = "runs/compare";
  std::vector<std::string> strategies, configs, peers;
  for (size_t i = 0; i < a.rest.size(); ++i) {
    const std::string& r = a.rest[i];
    std::optional<std::string> v;
    if ((v = flag_value(a.rest, i, "--strategies"))) strategies = nonempty_list("--strategies", *v);
    else if ((v = flag_value(a.rest, i, "--configs"))) configs = nonempty_list("--configs", *v);
    else if ((v = flag_value(a.rest, i, "--steps"))) steps = positive(*v, "--steps");
    else if ((v = flag_value(a.rest, i, "--warmup"))) warmup = positive(*v, "--warmup");
    else if ((v = flag_value(a.rest, i, "--out"))) out_dir = *v;
    else if ((v = flag_value(a.rest, i, "--peer"))) peers.push_back(*v);
    else if ((v = flag_value(a.rest, i, "--validate"))) validate = positive(*v, "--validate");
    else throw Error(cat("unknown argument '", r, "'\n", kUsage));
  }
  if (steps < 1) throw Error("--steps must be at least 1");
  // What the report needs, before any run: its folder (rank 0 writes it) and
  // the peers' rows, so that neither throws the comparison away at its end.
  if (launch_from_env().rank == 0) check_output_folder("--out", out_dir);
  std::vector<report::CompareRow> peer_rows;
  for (const std::string& p : peers) {
    auto r = report::read_peer_rows(p);
    peer_rows.insert(peer_rows.end(), r.begin(), r.end());
  }
  // Every run: same steps and seed, no checkpoints, evaluation every --validate
  // steps (none by default), a schedule spanning the run.
  std::vector<std::string> common = a.overrides;
  for (const char* o : {"checkpoint.every=0", "checkpoint.resume=\"none\""}) common.push_back(o);
  common.push_back("train.validation_every=" + std::to_string(validate));
  common.push_back("train.steps=" + std::to_string(warmup + steps));

  std::vector<Job> jobs;
  if (strategies.empty() && configs.empty()) jobs.push_back({fs::path(a.file).stem().string(), a.file, common, "", {}});
  for (const std::string& st : strategies) jobs.push_back(strategy_job(st, a.file, common));
  if (!configs.empty() && strategies.empty()) jobs.push_back({fs::path(a.file).stem().string(), a.file, common, "", {}});
  for (const std::string& c : configs) {
    // An item is a config file as it is; per-row keys (name:key=value) are
    // --strategies' — in a file name they would be part of a path that the
    // message about a missing file would not explain.
    std::error_code ec;
    const size_t colon = c.find(':');
    if (colon != std::string::npos && !fs::exists(c, ec) && c.find('=', colon) != std::string::npos)
      throw Error(cat("loom compare: --configs item '", c, "' is not a config file: --configs items are TOML files, "
                      "each run as it is (with the --set overrides); keys of a row (name:key=value) belong to "
                      "--strategies items, or set them in the file"));
    jobs.push_back({fs::path(c).stem().string(), c, common, "", {}});
  }
  // Every run must be able to start before any runs: a typo in the third
  // config, a strategy or plugin that does not exist, a key its plugin does
  // not take or a shape its kernel cannot do stops the comparison here, with
  // the run's own message, instead of costing the runs before it. Each job
  // builds its session as `loom check` does (plugins and their tables, data
  // files, the memory plan; nothing allocated, nothing run) and drops it.
  // Only what the run itself finds (a plan that does not fit the memory,
  // found here from the config's numbers or later from its detailed plan) is
  // still a failed row rather than the end.
  std::vector<std::string> unfit(jobs.size());
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Job& j = jobs[i];
    check_item_keys(j, common);
    try {
      Session probe(load_config(j.file, j.overrides));
    } catch (const MemoryPlanError& e) {
      unfit[i] = e.what();
    } catch (const Error& e) {
      throw Error(cat("'", j.label, "' cannot start, so nothing was run: ", e.what()));
    }
  }

  std::vector<report::CompareRow> rows;
  int rank = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    const Job& j = jobs[i];
    log_info(cat("compare: ", j.label, " (", steps, " steps after ", warmup, " warm-up)"));
    report::CompareRow row;
    try {
      if (!unfit[i].empty()) throw MemoryPlanError(unfit[i]);
      row = run_one(j, steps, warmup);
    } catch (const Error& e) {
      // A run that every check above let through but that cannot go on (a plan that does not fit) is a row, not the end.
      row.label = j.label;
      row.note = cat("failed: ", e.what());
      log_warn(cat("compare: ", j.label, " failed: ", e.what()));
    }
    rows.push_back(row);
  }
  rank = launch_from_env().rank;  // the launcher's rank (MPI agrees with it)
  rows.insert(rows.end(), peer_rows.begin(), peer_rows.end());
  report::compute_diffs(rows);
  {
    // Model TFLOP/s (NeMo's count, causal attention) and MFU of every row,
    // peers included (they run the compared shape), from the first config.
    const Config first = load_config(jobs.front().file, jobs.front().overrides);
    const ModelSpec spec = run_model_spec(first);
    for (report::CompareRow& r : rows) {
      r.model_tflops = r.tokens_per_s_per_gpu * spec.causal_flops_per_token(first.train.seq_len) / 1e12;
      r.mfu = mfu(spec.flops_per_token(first.train.seq_len), r.tokens_per_s_per_gpu);
    }
  }
  if (rank != 0) return 0;

  std::printf("%s", report::format_table(rows).c_str());
  fs::create_directories(out_dir);
  const std::string csv = (fs::path(out_dir) / "compare.csv").string();
  const std::string png = (fs::path(out_dir) / "compare.png").string();
  report::write_csv(csv, rows);
  // The chart needs cairo, which a machine may lack (GPU nodes often do): the
  // table and the CSV files hold the results, so a missing cairo is said, not fatal.
  bool drawn = true;
  try {
    report::require_cairo();
  } catch (const Error& e) {
    drawn = false;
    log_warn(cat(png, " not drawn: ", e.what()));
  }
  if (drawn) report::write_png(png, rows, cat("loom compare: ", a.file, ", ", steps, " steps"));
  for (const report::CompareRow& r : rows) {
    nlohmann::json j = {{"label", r.label},
                        {"ranks", r.ranks},
                        {"step_ms", r.step_ms},
                        {"tokens_per_s_per_gpu", r.tokens_per_s_per_gpu},
                        {"model_tflops", r.model_tflops},
                        {"mfu", r.mfu},
                        {"peak_mem_bytes", r.peak_mem_bytes},
                        {"planned_mem_bytes", r.planned_mem_bytes},
                        {"bytes_per_step", r.bytes_per_step},
                        {"final_loss", r.final_loss},
                        {"max_loss_diff", r.max_loss_diff},
                        {"max_rel_loss_diff", r.max_rel_loss_diff},
                        {"losses", r.losses},
                        {"note", r.note}};
    std::printf("COMPARE_JSON %s\n", j.dump().c_str());
  }
  std::printf("wrote %s, %s%s%s\n", csv.c_str(), report::losses_csv_path(csv).c_str(), drawn ? ", " : "",
              drawn ? png.c_str() : "");
  return 0;
}

}  // namespace loom::app
