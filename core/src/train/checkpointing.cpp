#include "train/checkpointing.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "checkpoint/file_util.hpp"
#include "checkpoint/train_checkpoint.hpp"
#include "loom/error.hpp"
#include "loom/log.hpp"
#include "model/model.hpp"
#include "train/finite_checks.hpp"
#include "train/outputs.hpp"

namespace fs = std::filesystem;

namespace loom {
namespace {

// The part of a unit this rank writes: its owned range (what its optimizer
// state covers), split between the ranks that own the same range (ddp: every
// rank; hybrid_shard: one per group), so every element is written once and
// the save is spread over all ranks.
std::pair<int64_t, int64_t> checkpoint_piece(const UnitState& u) {
  const UnitLayout& l = u.layout;
  const int64_t lo = std::min(l.optim_begin, u.info->numel);
  const int64_t hi = std::min(l.optim_begin + l.optim_numel, u.info->numel);
  const int64_t n = hi - lo, r = l.replicas, k = l.replica;
  return {lo + n * k / r, lo + n * (k + 1) / r};
}

// Flat range [lo, hi) of a unit's params as this rank holds them.
Tensor params_range(const UnitState& u, int64_t lo, int64_t hi) {
  if (u.layout.params_sharded) return view(u.param_shard, lo - u.layout.optim_begin, {hi - lo});
  return view(u.params, lo, {hi - lo});
}

// The parameter of unit `u` holding flat element `index`, for messages.
std::string param_at(const UnitState& u, int64_t index) {
  for (const ParamInfo& p : u.info->params)
    if (index >= p.offset && index < p.offset + p.numel) return cat("'", p.name, "' (element ", index - p.offset, ")");
  return cat("unit ", u.info->name, " (padding element ", index, ")");
}

}  // namespace

fs::path checkpoint_root(const Config& cfg) {
  return cfg.checkpoint.dir.empty() ? fs::path(cfg.run.out_dir) / "checkpoints" : fs::path(cfg.checkpoint.dir);
}

void save_checkpoint(const Config& cfg, Runtime& rt, TrainState& state, const Model& model, int64_t step) {
  const fs::path root = checkpoint_root(cfg);
  Backend& be = *rt.backend;
  const int rank = rt.rank(), world = rt.world();
  if (rank == 0) create_output_dir("checkpoint.dir", root.string());
  be.synchronize();
  rt.comm->synchronize();  // collectives still writing params (zero1/zero2's gathers) have finished
  std::vector<UnitState>& units = state.units();
  const std::vector<StateTensor> recipe_state = rt.precision->state_tensors();
  // Per unit this rank's [lo, hi), then the CRC of its shard's header: gathered for meta.json.
  std::vector<int64_t> pieces(units.size() * 2 + 1);
  Communicator& host = *rt.host;
  {
    ckpt::CheckpointWriter w(root.string(), step, rank);
    // Device tensors go through host copies that live until the shard is written.
    std::vector<std::vector<std::byte>> staging;
    // Nothing is written from non-finite state: every value is looked at on
    // the host (where it passes anyway) before any rank writes a byte.
    std::string problem;
    auto add = [&](const std::string& name, const Tensor& t, const UnitState& u, int64_t lo) {
      Tensor host_t = t;
      if (t.device != Device::cpu) {
        staging.emplace_back(t.bytes());
        be.download(staging.back().data(), t, t.bytes());
        host_t.data = staging.back().data();
        host_t.device = Device::cpu;
      }
      if (problem.empty())
        if (const NonFiniteCount bad = count_nonfinite(host_t.data, host_t.dtype, host_t.numel()))
          problem = cat("rank ", rank, "'s part of unit ", u.info->name, " holds ", count_words(bad), " in the ",
                        state_kind_words(name.substr(0, name.find('.'))), ", the first in ", param_at(u, lo + bad.first));
      w.add(name, host_t);
    };
    for (size_t i = 0; i < units.size(); ++i) {
      const UnitState& u = units[i];
      const auto [lo, hi] = checkpoint_piece(u);
      pieces[2 * i] = lo;
      pieces[2 * i + 1] = hi;
      if (lo >= hi) continue;
      const std::string& n = u.info->name;
      const int64_t o = lo - u.layout.optim_begin;  // offset in the owned-range buffers
      add("params." + n, params_range(u, lo, hi), u, lo);
      if (u.master.data) add("master." + n, view(u.master, o, {hi - lo}), u, lo);
      add("adam_m." + n, view(u.adam_m, o, {hi - lo}), u, lo);
      add("adam_v." + n, view(u.adam_v, o, {hi - lo}), u, lo);
    }
    // The recipe's state (FP8 scales, amax history): replicated tensors once,
    // from rank 0; per-rank tensors from every rank.
    for (const StateTensor& st : recipe_state) {
      if (st.replicated && rank != 0) continue;
      Tensor host_t = st.tensor;
      if (host_t.device != Device::cpu) {
        staging.emplace_back(host_t.bytes());
        be.download(staging.back().data(), host_t, host_t.bytes());
        host_t.data = staging.back().data();
        host_t.device = Device::cpu;
      }
      w.add("precision." + st.name, host_t);
    }
    // Every rank learns whether any rank found a problem, so all refuse together.
    std::vector<double> flags(static_cast<size_t>(host.size()));
    {
      double mine = problem.empty() ? 0.0 : 1.0;
      Tensor in(&mine, DType::f64, Device::cpu, {1});
      Tensor out(flags.data(), DType::f64, Device::cpu, {static_cast<int64_t>(flags.size())});
      host.all_gather(ExecContext{}, in, out);
    }
    std::string bad_ranks;
    for (int r = 0; r < host.size(); ++r)
      if (flags[static_cast<size_t>(r)] != 0.0) bad_ranks += cat(bad_ranks.empty() ? "" : ", ", r);
    if (!bad_ranks.empty()) {
      const std::string keep = ckpt::complete_list(root.string());
      throw Error(cat("no checkpoint of step ", step, " was written: the training state is not finite (",
                      problem.empty() ? cat("rank(s) ", bad_ranks, " found NaN or inf values; their messages name the tensor")
                                      : problem,
                      "). A checkpoint of it could only be resumed into the same failure. The complete checkpoints in ",
                      root.string(), " are untouched: ", keep,
                      ". Resume from one of them with a lower train.lr or a train.grad_clip"));
    }
    pieces.back() = static_cast<int64_t>(w.write_shard());
  }
  // Every rank's piece of every unit and its header CRC, for the metadata (and for resharding on load).
  std::vector<int64_t> all(pieces.size() * static_cast<size_t>(host.size()));
  {
    // all_gather moves raw bytes: the 8-byte integers travel as f64-sized elements, unconverted.
    Tensor in(pieces.data(), DType::f64, Device::cpu, {static_cast<int64_t>(pieces.size())});
    Tensor out(all.data(), DType::f64, Device::cpu, {static_cast<int64_t>(all.size())});
    host.all_gather(ExecContext{}, in, out);
  }
  host.barrier();  // every rank's shard is on disk before the marker
  if (rank == 0) {
    const std::vector<UnitInfo>& infos = state.infos();
    nlohmann::json jun = nlohmann::json::array();
    for (size_t i = 0; i < units.size(); ++i) {
      nlohmann::json params = nlohmann::json::array();
      for (const ParamInfo& p : infos[i].params)
        params.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.offset}, {"role", param_role_name(p.role)}});
      nlohmann::json ranges = nlohmann::json::array();
      for (int r = 0; r < host.size(); ++r) {
        const size_t k = static_cast<size_t>(r) * pieces.size() + 2 * i;
        if (all[k] < all[k + 1]) ranges.push_back({r, all[k], all[k + 1]});
      }
      jun.push_back({{"name", infos[i].name}, {"numel", infos[i].numel}, {"params", params}, {"shards", ranges}});
    }
    const PrecisionDTypes& dt = rt.dtypes;
    std::vector<uint32_t> header_crcs;
    for (int r = 0; r < host.size(); ++r)
      header_crcs.push_back(static_cast<uint32_t>(all[static_cast<size_t>(r) * pieces.size() + pieces.size() - 1]));
    nlohmann::json jstate = nlohmann::json::array();
    for (const StateTensor& st : recipe_state)
      jstate.push_back({{"name", st.name},
                        {"dtype", std::string(dtype_name(st.tensor.dtype))},
                        {"shape", std::vector<int64_t>(st.tensor.shape.begin(), st.tensor.shape.begin() + st.tensor.ndim)},
                        {"replicated", st.replicated}});
    nlohmann::json meta = {
        {"format", "loom-checkpoint"},
        {"version", 5},
        {"step", step},
        {"world_size", world},
        {"strategy", cfg.sharding.plugin},
        {"precision", cfg.precision.plugin},
        {"dtypes", {{"params", std::string(dtype_name(dt.param))},
                    {"grads", std::string(dtype_name(dt.grad))},
                    {"optim_state", std::string(dtype_name(dt.optim_state))},
                    {"activation", std::string(dtype_name(dt.activation))},
                    {"master", dt.has_master}}},
        {"layers", model.layers()},
        {"model", nlohmann::json::parse(ckpt::model_json(model.spec()))},
        {"units", jun},
        {"data_plugin", cfg.data.plugin},
        {"data_state", rt.data->state()},
        {"samples_seen", step * cfg.train.micro_batch * cfg.train.grad_accum * world},
        {"precision_tensors", jstate},
        {"seed", cfg.run.seed},
        {"config", cfg.effective_toml},
        {"shard_header_crc32", header_crcs},
    };
    ckpt::CheckpointWriter::write_meta(root.string(), step, meta.dump(2));
    ckpt::CheckpointWriter::mark_complete(root.string(), step);
    // Only checkpoints that would resume count (every rank file meta.json lists checked).
    ckpt::prune(root.string(), static_cast<int>(cfg.checkpoint.keep_last), ckpt::training_checkpoint_damage);
  }
  host.barrier();
  log_info(cat("checkpoint: step ", step, " written to ", (root / "").string(), " (", world, " rank",
               world == 1 ? "" : "s", ", ", cfg.sharding.plugin, ", ", model.layers(), " layers)"));
}

namespace {

// The command that moves a checkpoint folder out of the run's sight: a name
// that does not begin with "step_" is never resumed from, counted or pruned.
std::string move_aside(const ckpt::CheckpointInfo& c, const std::string& prefix) {
  const fs::path d(c.dir);
  return cat("mv '", d.string(), "' '", (d.parent_path() / (prefix + d.filename().string())).string(), "'");
}

// What a folder of the checkpoint series is, for messages, and the prefix it is moved aside under.
std::pair<std::string, std::string> describe_folder(const ckpt::CheckpointInfo& c) {
  if (!c.complete) return {"an unfinished save: no COMPLETE marker", "unfinished_"};
  if (const std::string why = ckpt::training_checkpoint_damage(c); !why.empty()) return {cat("damaged: ", why), "damaged_"};
  return {"a complete checkpoint", "later_"};
}

// Every parameter of this model must be in the checkpoint with the same shape,
// and the checkpoint must hold nothing else. (Where each lies in its unit was
// checked against the checkpoint's own model record when it was opened.)
void check_layout(const ckpt::CheckpointSet& set, const std::vector<UnitInfo>& infos) {
  const ckpt::TrainMeta& m = set.meta();
  size_t ours = 0;
  for (const UnitInfo& u : infos)
    for (const ParamInfo& p : u.params) {
      ++ours;
      auto it = m.by_name.find(p.name);
      if (it == m.by_name.end())
        throw Error(cat("checkpoint ", set.dir(), " has no parameter '", p.name,
                        "' that this model has: it was written for another model. Point checkpoint.dir elsewhere "
                        "or set checkpoint.resume = \"none\""));
      const ckpt::SavedParam& sp = m.params[it->second];
      if (sp.shape != p.shape) {
        auto str = [](const std::vector<int64_t>& s) {
          std::string r = "[";
          for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
          return r + "]";
        };
        throw Error(cat("checkpoint ", set.dir(), ": parameter '", p.name, "' has shape ", str(sp.shape),
                        " there and ", str(p.shape), " in this model. Point checkpoint.dir elsewhere or set "
                        "checkpoint.resume = \"none\""));
      }
    }
  if (m.params.size() != ours) {
    std::string extra;
    for (const ckpt::SavedParam& sp : m.params) {
      bool found = false;
      for (const UnitInfo& u : infos)
        for (const ParamInfo& p : u.params) found = found || p.name == sp.name;
      if (!found) {
        extra = sp.name;
        break;
      }
    }
    throw Error(cat("checkpoint ", set.dir(), " holds ", m.params.size(), " parameters, this model ", ours,
                    " (e.g. '", extra, "' is not part of it): it was written for another model"));
  }
}

// The checkpoint's architecture against this run's. The MoE router's loss
// weight and jitter are training settings, not the architecture: a resume
// may change them (resume_checkpoint says so).
void check_model(const ckpt::CheckpointSet& set, const ModelSpec& spec, const std::vector<UnitInfo>& infos) {
  const std::string want = ckpt::model_json(spec);
  nlohmann::json had = nlohmann::json::parse(set.meta().model_json), has = nlohmann::json::parse(want);
  for (const char* k : {"router_aux_loss_coef", "router_jitter_noise"}) {
    had.erase(k);
    has.erase(k);
  }
  if (had != has)
    throw Error(cat("checkpoint ", set.dir(), " was written for another model: it has ", set.meta().model_json,
                    ", this config builds ", want, ". Point checkpoint.dir elsewhere or set checkpoint.resume = \"none\""));
  check_layout(set, infos);
}

// Everything resuming checks before it reads a byte of tensor data: the
// marker, meta.json, the layout against this model, every rank file's header
// and the tensors meta.json names in them.
void validate(ckpt::CheckpointSet& set, const ModelSpec& spec, const std::vector<UnitInfo>& infos) {
  check_model(set, spec, infos);
  set.check_files();
}

// Gives the data plugin the position the checkpoint in `dir` records, as
// resuming does; one it refuses is named with the file and field it came
// from (the plugin sees only the text of its state). A field the plugin
// finds damaged (ckpt::CheckpointDamaged: of another type, out of range, at
// odds with another field) stays damage, so the caller says which checkpoint
// to resume instead; any other refusal (another plugin's state, other data)
// says itself what to do.
void restore_data_state(const std::string& dir, const ckpt::TrainMeta& m, DataSource& data) {
  const std::string what = cat("cannot resume from ", (fs::path(dir) / "meta.json").string(),
                               ": its \"data_state\" (the position of data plugin '", m.data_plugin, "') is refused: ");
  try {
    data.restore(m.data_state);
  } catch (const ckpt::CheckpointDamaged& e) {
    throw ckpt::CheckpointDamaged(what + e.what());
  } catch (const Error& e) {
    throw Error(what + e.what());
  }
}

// What resuming checks before it reads tensor data: the checkpoint in `dir`
// against this model and, with `data`, its data position given to that source.
void check_resumable(const std::string& dir, const ModelSpec& spec, const std::vector<UnitInfo>& infos,
                     DataSource* data) {
  ckpt::CheckpointSet set(dir);
  validate(set, spec, infos);
  if (data) restore_data_state(dir, set.meta(), *data);
}

// "" when the checkpoint in `dir` would resume into this model (and, with
// `data`, its data position into that source), else why not.
std::string resume_problem(const std::string& dir, const ModelSpec& spec, const std::vector<UnitInfo>& infos,
                           DataSource* data) {
  try {
    check_resumable(dir, spec, infos, data);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// What to do about the damaged checkpoint `bad` that checkpoint.resume led
// to: the newest earlier one that validates (its data position too, given
// `data`), and the exact way back to it (nothing is moved, renamed or
// deleted for the user). `data` is left at that position or another.
std::string damaged_advice(const Config& cfg, const ckpt::CheckpointInfo& bad, const ModelSpec& spec,
                           const std::vector<UnitInfo>& infos, DataSource* data) {
  const std::string root = checkpoint_root(cfg).string();
  const std::vector<ckpt::CheckpointInfo> all = ckpt::list_checkpoints(root);
  std::optional<ckpt::CheckpointInfo> good;
  for (auto it = all.rbegin(); it != all.rend() && !good; ++it)
    if (it->step < bad.step && it->complete && resume_problem(it->dir, spec, infos, data).empty()) good = *it;
  if (!good)
    return cat("No earlier checkpoint in ", root, " validates. To start fresh and keep this one to look at, ",
               move_aside(bad, "damaged_"), " and set checkpoint.resume = \"none\" with another run.out_dir (or run.overwrite = "
               "true, which replaces the previous run's metrics and checkpoints)");
  // Folders of later steps that would stop the way back: with "auto", any
  // complete one (it would be taken instead, or refused again); with a step,
  // any at all while checkpoints are written (the run's saves would meet them).
  const bool by_step = cfg.checkpoint.resume != "auto";
  std::string moves;
  int n = 0;
  for (const ckpt::CheckpointInfo& c : all)
    if (c.step > good->step && (c.complete || (by_step && cfg.checkpoint.every > 0))) {
      moves += cat(moves.empty() ? "" : "; ", move_aside(c, c.step == bad.step ? "damaged_" : describe_folder(c).second));
      ++n;
    }
  return cat("The newest earlier checkpoint that validates is ", good->dir, ". To resume from it, move ",
             n == 1 ? "the damaged folder" : "the folders of later steps",
             " aside (nothing is moved or deleted for you): ", moves, "; then run again with checkpoint.resume = ",
             by_step ? std::to_string(good->step) : std::string("\"auto\""), " (it resumes from step ", good->step,
             ")");
}

// The checkpoint checkpoint.resume names, or nullopt. Says which folders
// "auto" passes over; refuses going back to a step while later folders would
// meet this run's saves, naming each for what it is.
std::optional<ckpt::CheckpointInfo> find_resume_point(const Config& cfg) {
  const std::string& mode = cfg.checkpoint.resume;
  if (mode == "none") return std::nullopt;
  const fs::path root = checkpoint_root(cfg);
  if (mode == "auto") {
    if (!fs::exists(root)) return std::nullopt;
    const std::vector<ckpt::CheckpointInfo> all = ckpt::list_checkpoints(root.string());
    std::optional<ckpt::CheckpointInfo> latest;
    for (auto it = all.rbegin(); it != all.rend() && !latest; ++it)
      if (it->complete) latest = *it;
    // An interrupted save newer than the checkpoint resumed from: its files
    // are replaced when that step is saved again, which the log says first.
    for (const ckpt::CheckpointInfo& c : all)
      if (!c.complete && (!latest || c.step > latest->step))
        ckpt::warn_once(cat("checkpoint.resume = \"auto\": passing over ", c.dir,
                            " (no COMPLETE marker: a save of step ", c.step, " that did not finish); ",
                            latest ? cat("resuming from ", latest->dir, ", the newest complete checkpoint; ")
                                   : std::string("there is no complete checkpoint to resume from; "),
                            "the save of step ", c.step, " will replace what is in it"));
    return latest;
  }
  ckpt::CheckpointInfo info;
  try {
    info = ckpt::find_step(root.string(), std::stoll(mode));
  } catch (const ckpt::CheckpointDamaged&) {
    throw;  // damage is the checkpoint's, with its own advice (check_resume_checkpoint)
  } catch (const Error& e) {  // no such step: located at the key that names it
    throw Error(cat(cfg.where("checkpoint.resume"), ": checkpoint.resume = ", mode, ": ", e.what()));
  }
  // Going back to an older step with checkpointing on would later meet the
  // folders of the newer steps: refuse now, before any work.
  if (cfg.checkpoint.every > 0) {
    std::string newer, moves;
    for (const ckpt::CheckpointInfo& c : ckpt::list_checkpoints(root.string())) {
      if (c.step <= info.step) continue;
      const auto [what, prefix] = describe_folder(c);
      newer += cat(newer.empty() ? "" : "; ", c.dir, " (", what, ")");
      moves += cat(moves.empty() ? "" : "; ", move_aside(c, prefix));
    }
    if (!newer.empty())
      throw Error(cat("checkpoint.resume = ", mode, ": ", root.string(), " holds newer folders, of later steps, "
                      "which this run's saves would overwrite or stop at as training continues: ", newer,
                      ". Move them aside (nothing is moved for you): ", moves,
                      "; or set checkpoint.dir to another folder, or set checkpoint.every = 0"));
  }
  return info;
}

}  // namespace

std::optional<std::string> check_resume_checkpoint(const Config& cfg, const ModelSpec& spec, DataSource* data) {
  const std::optional<ckpt::CheckpointInfo> info = find_resume_point(cfg);
  if (!info) return std::nullopt;
  const Model model(spec, cfg.model.layers, cfg.expert_parallel);
  try {
    check_resumable(info->dir, spec, model.units(), data);
  } catch (const ckpt::CheckpointDamaged& e) {
    throw Error(cat(e.what(), ". ", damaged_advice(cfg, *info, spec, model.units(), data)));
  }
  return info->dir;
}

namespace {

void load_unit_range(ckpt::CheckpointSet& set, const std::string& kind, const ParamInfo& p, int64_t lo, int64_t hi,
                     Tensor dst_flat, int64_t dst_begin, Backend& be, std::vector<std::byte>& staging) {
  // Elements [lo, hi) of the unit's flat vector that fall in parameter p, into dst_flat (whose element 0 is
  // flat index dst_begin).
  const int64_t a = std::max(lo, p.offset), b = std::min(hi, p.offset + p.numel);
  if (a >= b) return;
  const ckpt::SavedParam& sp = set.param(p.name);
  staging.resize(static_cast<size_t>(b - a) * dtype_size(dst_flat.dtype));
  // Refuses NaN or inf (CheckpointDamaged, naming the parameter and which
  // state holds them; the caller adds the way back), as `loom convert` does.
  set.read(kind, sp, a - p.offset, b - p.offset, dst_flat.dtype, staging.data());
  Tensor dst = view(dst_flat, a - dst_begin, {b - a});
  be.upload(dst, staging.data(), staging.size());
}

// "key = value" lines of a table's TOML (its own keys, not its sub-tables).
std::map<std::string, std::string> toml_values(const std::string& toml) {
  std::map<std::string, std::string> out;
  std::istringstream in(toml);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] == '[') break;  // sub-tables follow the plain keys
    const size_t eq = line.find(" = ");
    if (eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 3);
  }
  return out;
}

// The [precision] keys set otherwise than in the run that wrote the
// checkpoint in `dir` (meta.json's "config"): "amax_history_len 4 -> 8,
// fp8_head (not set) -> true"; "" when none differs or the record is absent.
std::string precision_key_changes(const std::string& dir, const Config& cfg) {
  try {
    const nlohmann::json meta =
        nlohmann::json::parse(ckpt::read_file((fs::path(dir) / "meta.json").string(), "checkpoint metadata"));
    if (!meta.contains("config") || !meta["config"].is_string()) return "";
    const ConfigTable old = parse_config_table(meta["config"].get<std::string>(), dir + "/meta.json (config)");
    std::map<std::string, std::string> had = toml_values(old.table("precision").to_toml()),
                                       has = toml_values(cfg.precision.table.to_toml());
    std::set<std::string> keys;
    for (const auto& [k, v] : had) keys.insert(k);
    for (const auto& [k, v] : has) keys.insert(k);
    std::string out;
    for (const std::string& k : keys) {
      if (k == "plugin" || k == "path") continue;
      const auto a = had.find(k), b = has.find(k);
      const std::string from = a == had.end() ? "(not set)" : a->second, to = b == has.end() ? "(not set)" : b->second;
      if (from != to) out += cat(out.empty() ? "" : ", ", "precision.", k, " ", from, " -> ", to);
    }
    return out;
  } catch (const std::exception&) {
    return "";  // meta.json was certified and read already; an odd "config" record only loses the hint
  }
}

// The recipe's state tensors, by name, from a checkpoint of the same recipe;
// any other recipe's checkpoint leaves them fresh, and the log says so. Past
// the certificate, every value is the recipe's to check (state_loaded()): a
// value it refuses is damage, named with the checkpoint and the rank file it
// came from, so the caller adds the way back to the newest earlier
// checkpoint that validates.
void restore_precision_state(ckpt::CheckpointSet& set, const Config& cfg, Runtime& rt) {
  const ckpt::TrainMeta& m = set.meta();
  std::vector<StateTensor> mine = rt.precision->state_tensors();
  if (m.precision != cfg.precision.plugin) {
    if (!mine.empty() || !m.precision_tensors.empty())
      log_info(cat("checkpoint ", set.dir(), " was written with precision \"", m.precision, "\" (",
                   m.precision_tensors.size(), " state tensor(s)); this run's precision \"", cfg.precision.plugin,
                   "\" does not take them over: its scales start fresh"));
    return;
  }
  if (m.version < 5) {  // no recipe state was checkpointed (the reader refused any opaque bytes)
    if (!mine.empty())
      log_info(cat("checkpoint ", set.dir(), " (format version ", m.version, ") holds no state of precision \"",
                   cfg.precision.plugin, "\": its scales start fresh"));
    return;
  }
  if (m.layers != cfg.model.layers && (!mine.empty() || !m.precision_tensors.empty())) {
    // Native and fused layers resume each other's weights, but register
    // other linears (one QKV and one gate-up GEMM against three and two):
    // every slot of the recipe's state would mean another tensor.
    log_warn(cat("checkpoint ", set.dir(), " was computed with model.layers = \"", m.layers, "\", this run with \"",
                 cfg.model.layers, "\", whose linears are others: precision \"", cfg.precision.plugin,
                 "\" does not take over its state (", m.precision_tensors.size(), " tensor(s)); its scales start fresh"));
    return;
  }
  Backend& be = *rt.backend;
  std::vector<std::byte> staging;
  std::map<std::string, std::string> files;  // rank file -> the tensors read from it, for messages
  size_t read = 0;
  for (StateTensor& st : mine) {
    const auto it = std::find_if(m.precision_tensors.begin(), m.precision_tensors.end(),
                                 [&](const ckpt::SavedState& s) { return s.name == st.name; });
    if (it == m.precision_tensors.end()) {
      // Written by an earlier version of the recipe, before it kept this
      // tensor: the recipe keeps its own value, and judges in state_loaded().
      log_info(cat("checkpoint ", set.dir(), " holds no precision state '", st.name, "' (written before precision \"",
                   cfg.precision.plugin, "\" kept it): this run's own value stands in for it"));
      continue;
    }
    if (it->replicated != st.replicated)
      throw Error(cat("checkpoint ", set.dir(), ": precision state '", st.name, "' was saved ",
                      it->replicated ? "replicated" : "per rank", " but the recipe keeps it ",
                      st.replicated ? "replicated" : "per rank", ": written by another version of the recipe"));
    if (!st.replicated && m.world_size != rt.world())
      throw Error(cat("checkpoint ", set.dir(), ": precision state '", st.name, "' is kept per rank and was written by ",
                      m.world_size, " rank(s); this run has ", rt.world(), ". Resume with ", m.world_size,
                      " rank(s), or start fresh (checkpoint.resume = \"none\")"));
    const std::vector<int64_t> shape(st.tensor.shape.begin(), st.tensor.shape.begin() + st.tensor.ndim);
    if (it->dtype != st.tensor.dtype || it->shape != shape) {
      // The state's layout follows the recipe's options (an FP8 amax history
      // length; which linears run in FP8) and the model's linears: name the
      // [precision] keys that changed, the usual cause, and the way back.
      std::string saved = "[";
      for (size_t i = 0; i < it->shape.size(); ++i) saved += cat(i ? "," : "", it->shape[i]);
      saved += "]";
      const std::string changed = precision_key_changes(set.dir(), cfg);
      throw Error(cat("checkpoint ", set.dir(), ": precision state '", st.name, "' is ", dtype_name(it->dtype), " ",
                      saved, " there and ", dtype_name(st.tensor.dtype), " ", st.tensor.shape_str(),
                      " in this run's recipe: its state has another layout there",
                      changed.empty() ? std::string(" (a [precision] setting that sizes it, such as an FP8 amax history "
                                                    "length or fp8_head, or the model's linears changed)")
                                      : cat(" (the [precision] settings changed since it was written: ", changed, ")"),
                      ", and precision \"", cfg.precision.plugin, "\" cannot take it over. Resume with the settings "
                      "that wrote it", changed.empty() ? "" : " (set those keys back)",
                      ", or start fresh (checkpoint.resume = \"none\")"));
    }
    Tensor host_t = st.tensor;
    if (host_t.device != Device::cpu) {
      staging.resize(host_t.bytes());
      host_t.data = staging.data();
      host_t.device = Device::cpu;
    }
    const int from = st.replicated ? 0 : rt.rank();
    set.read_precision_state(from, *it, host_t);
    if (st.tensor.device != Device::cpu) be.upload(st.tensor, staging.data(), staging.size());
    std::string& list = files[(fs::path(set.dir()) / ckpt::rank_file_name(from)).string()];
    list += cat(list.empty() ? "" : ", ", st.name);
    ++read;
  }
  for (const ckpt::SavedState& s : m.precision_tensors)
    if (std::none_of(mine.begin(), mine.end(), [&](const StateTensor& st) { return st.name == s.name; }))
      log_warn(cat("checkpoint ", set.dir(), ": precision state '", s.name, "' is not kept by precision \"",
                   cfg.precision.plugin, "\" any more; it is ignored"));
  try {
    rt.precision->state_loaded();
  } catch (const Error& e) {
    std::string from;
    for (const auto& [file, names] : files) from += cat(from.empty() ? "" : " and ", file, " (", names, ")");
    throw ckpt::CheckpointDamaged(cat("checkpoint ", set.dir(), ": the state of precision \"", cfg.precision.plugin,
                                      "\" read from ", from.empty() ? std::string("its rank files") : from,
                                      " is refused: ", e.what(), ". The checkpoint cannot be resumed as it is"));
  }
  // Whether the state resumes or parts of it start afresh is the recipe's to say.
  if (read > 0)
    log_info(cat("checkpoint ", set.dir(), ": precision \"", cfg.precision.plugin, "\" read ", read,
                 " state tensor(s)"));
}

}  // namespace

namespace {

// Loads the checkpoint `info` (see resume_checkpoint).
int64_t load_checkpoint(const Config& cfg, Runtime& rt, TrainState& state, const Model& model,
                        const ckpt::CheckpointInfo& info) {
  ckpt::CheckpointSet set(info.dir);
  const ckpt::TrainMeta& m = set.meta();
  {
    nlohmann::json had = nlohmann::json::parse(m.model_json),
                   has = nlohmann::json::parse(ckpt::model_json(model.spec()));
    for (const char* k : {"router_aux_loss_coef", "router_jitter_noise"})
      if (had.contains(k) && has.contains(k) && had[k] != has[k])
        log_info(cat("checkpoint ", info.dir, " was trained with model.", k, " = ", had[k].dump(), ", this run uses ",
                     has[k].dump()));
  }
  check_model(set, model.spec(), state.infos());
  // Every rank file's header and the tensors meta.json names, before any is
  // read: a damaged file is found before the state changes. Rank 0 checks
  // them all (each rank reads its own pieces' CRCs as it loads).
  if (rt.rank() == 0) set.check_files();
  // The data position before any tensor is read: a refused one costs no load
  // (the same code as `loom check`'s check_resume_checkpoint).
  restore_data_state(info.dir, m, *rt.data);

  // What differs is said, not refused: every combination loads by name.
  if (m.world_size != rt.world() || m.strategy != cfg.sharding.plugin)
    log_info(cat("resharding checkpoint ", info.dir, ": written by ", m.world_size, " rank(s) with sharding \"",
                 m.strategy, "\", loading into ", rt.world(), " rank(s) with \"", cfg.sharding.plugin, "\""));
  if (m.layers != model.layers())
    log_info(cat("checkpoint ", info.dir, " was computed with ", m.layers, " layers, this run uses ", model.layers(),
                 " layers: same parameters, names and layout"));
  const PrecisionDTypes& dt = rt.dtypes;
  const bool same_dtypes = m.params_dtype == dt.param && m.optim_dtype == dt.optim_state && m.has_master == dt.has_master;
  if (!same_dtypes)
    log_info(cat("checkpoint ", info.dir, " holds ", dtype_name(m.params_dtype), " params",
                 m.has_master ? " with an fp32 master copy" : "", " and ", dtype_name(m.optim_dtype),
                 " AdamW state (precision \"", m.precision, "\"); converting to this run's ", dtype_name(dt.param),
                 " params", dt.has_master ? " with an fp32 master copy" : "", " and ", dtype_name(dt.optim_state),
                 " state (precision \"", cfg.precision.plugin, "\")"));

  // The recipe's state next: a few small tensors, every value checked by the
  // recipe, so a refused one costs no load of the weights.
  restore_precision_state(set, cfg, rt);

  Backend& be = *rt.backend;
  std::vector<std::byte> staging;
  // fp32 params with an fp32 master in the checkpoint: take the exact master values.
  const std::string params_kind = m.has_master && dt.param == DType::f32 ? "master" : "params";
  const std::string master_kind = m.has_master ? "master" : "params";
  for (UnitState& u : state.units()) {
    const int64_t N = u.info->numel;
    const int64_t olo = std::min(u.layout.optim_begin, N);
    const int64_t ohi = std::min(u.layout.optim_begin + u.layout.optim_numel, N);
    for (const ParamInfo& p : u.info->params) {
      if (u.layout.params_sharded) load_unit_range(set, params_kind, p, olo, ohi, u.param_shard, u.layout.optim_begin, be, staging);
      else load_unit_range(set, params_kind, p, 0, N, u.params, 0, be, staging);
      if (u.master.data) load_unit_range(set, master_kind, p, olo, ohi, u.master, u.layout.optim_begin, be, staging);
      load_unit_range(set, "adam_m", p, olo, ohi, u.adam_m, u.layout.optim_begin, be, staging);
      load_unit_range(set, "adam_v", p, olo, ohi, u.adam_v, u.layout.optim_begin, be, staging);
    }
  }
  log_info(cat("resumed from ", info.dir, " at step ", m.step));
  return m.step;
}

}  // namespace

std::optional<int64_t> resume_checkpoint(const Config& cfg, Runtime& rt, TrainState& state, const Model& model) {
  const std::optional<ckpt::CheckpointInfo> info = find_resume_point(cfg);
  if (!info) return std::nullopt;
  try {
    return load_checkpoint(cfg, rt, state, model, *info);
  } catch (const ckpt::CheckpointDamaged& e) {
    throw Error(cat(e.what(), ". ", damaged_advice(cfg, *info, model.spec(), state.infos(), rt.data.get())));
  }
}

}  // namespace loom
