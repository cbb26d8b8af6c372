// loom convert CHECKPOINT_DIR --to-hf OUT_DIR [--dtype fp32|bf16] [--force]
//
// Writes a checkpoint's weights as a Hugging Face Llama folder (config.json +
// model.safetensors) that transformers' LlamaForCausalLM.from_pretrained loads.
// Any checkpoint: any world size and strategy (the shards are put back
// together), fp32 or bf16 parameters (the fp32 master copy is used when there
// is one), native or fused layers (the same names and layout). It reads
// through the same code as resuming (checkpoint/train_checkpoint.hpp).
//
// OUT_DIR may hold other files (a tokenizer), but not a model: writing
// model.safetensors beside a sharded export would leave its index, which
// loaders prefer, naming the old shards. --force replaces that model whole:
// the new files are written first (in a staging folder inside OUT_DIR), then
// moved in, then the old index and shards removed, so an interrupted convert
// never leaves OUT_DIR without a model.
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "checkpoint/file_util.hpp"
#include "checkpoint/train_checkpoint.hpp"
#include "cli.hpp"
#include "config/run_config.hpp"
#include "commands.hpp"
#include "hf/hf_llama.hpp"
#include "hf/safetensors.hpp"
#include "loom/config.hpp"
#include "loom/error.hpp"
#include "loom/model.hpp"

namespace fs = std::filesystem;

namespace loom::app {
namespace {

constexpr const char* kIndex = "model.safetensors.index.json";

// The files of `dir` that make up a model a loader would read, by name:
// config.json, the safetensors files and the index (and the shards it names).
std::vector<std::string> model_files(const fs::path& dir) {
  std::set<std::string> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n == "config.json" || n == kIndex || (n.ends_with(".safetensors") && n[0] != '.')) found.insert(n);
  }
  return {found.begin(), found.end()};
}

// The shards of an earlier sharded export that --force removes: the files the
// index names (plain names in `dir` only) and any model-NNNNN-of-NNNNN.safetensors.
std::vector<fs::path> stale_shards(const fs::path& dir) {
  std::set<std::string> names;
  try {
    const nlohmann::json j = nlohmann::json::parse(ckpt::read_file((dir / kIndex).string(), "safetensors index"));
    if (j.is_object() && j.contains("weight_map") && j["weight_map"].is_object())
      for (const auto& [tensor, file] : j["weight_map"].items())
        if (file.is_string()) {
          const std::string f = file.get<std::string>();
          if (!f.empty() && f.find('/') == std::string::npos && f != "." && f != ".." && f != "model.safetensors")
            names.insert(f);
        }
  } catch (const std::exception&) {
    // No index, or one that cannot be read: the pattern below still finds the usual names.
  }
  static const std::regex shard(R"(model-\d+-of-\d+\.safetensors)");
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (std::regex_match(e.path().filename().string(), shard)) names.insert(e.path().filename().string());
  std::vector<fs::path> out;
  for (const std::string& n : names)
    if (fs::exists(dir / n, ec)) out.push_back(dir / n);
  return out;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i == 6 && v.size() > 8) return s + cat(", ... (", v.size(), " in all)");
    s += (i ? ", " : "") + v[i];
  }
  return s;
}

void rename_or_throw(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec) throw Error(cat("--to-hf: cannot move ", from.string(), " to ", to.string(), ": ", ec.message()));
}

void remove_or_throw(const fs::path& p) {
  std::error_code ec;
  fs::remove(p, ec);
  if (ec) throw Error(cat("--to-hf: cannot remove the old ", p.string(), ": ", ec.message()));
}

// What to do about a damaged checkpoint: the newest other checkpoint beside
// it that validates, to convert instead.
std::string convert_advice(const std::string& ckpt_dir, const std::string& out_dir) {
  fs::path named = fs::path(ckpt_dir).lexically_normal();
  if (named.filename().empty()) named = named.parent_path();
  const fs::path root = named.parent_path().empty() ? fs::path(".") : named.parent_path();
  std::vector<ckpt::CheckpointInfo> all;
  try {
    all = ckpt::list_checkpoints(root.string());
  } catch (const Error&) {
  }
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (!it->complete || fs::path(it->dir).filename() == named.filename()) continue;
    try {
      ckpt::CheckpointSet set(it->dir);
      set.check_files();
    } catch (const Error&) {
      continue;
    }
    return cat("The newest other checkpoint in ", root.string(), " that validates is ", it->dir,
               ": loom convert ", it->dir, " --to-hf ", out_dir);
  }
  return cat("No other checkpoint in ", root.string(), " validates");
}


// The model.max_seq_len the checkpoint's run trained with, from the run's
// effective config that meta.json records ("config"): the architecture record
// leaves it out (it sizes RoPE's tables, not the weights, so a resume may
// change it), but an export's max_position_embeddings must be it, or a run
// from the export with the same config would be told its max_seq_len differs
// from the folder's. A checkpoint without that record keeps `fallback`.
int64_t trained_max_seq_len(const std::string& dir, int64_t fallback) {
  try {
    const nlohmann::json meta = nlohmann::json::parse(ckpt::read_file((fs::path(dir) / "meta.json").string(), "checkpoint metadata"));
    if (!meta.contains("config") || !meta["config"].is_string()) return fallback;
    const ConfigTable cfg = parse_config_table(meta["config"].get<std::string>(), dir + "/meta.json (config)");
    if (!cfg.has("model")) return fallback;
    const ConfigTable model = cfg.table("model");
    // model.max_seq_len's own range: the export's max_position_embeddings is held to it when read back.
    return model.has("max_seq_len") ? model.get_int("max_seq_len", fallback, 1, kMaxDim) : fallback;
  } catch (const std::exception&) {
    return fallback;  // meta.json was certified and read already; an old or odd "config" record changes nothing
  }
}

}  // namespace

int cmd_convert(const Args& args) {
  const char* usage = "usage: loom convert CHECKPOINT_DIR --to-hf OUT_DIR [--dtype fp32|bf16] [--force]";
  if (wants_help(args)) {
    std::printf("%s\n", usage);
    return 0;
  }
  std::string ckpt_dir, out_dir, dtype = "bf16";
  bool force = false;
  for (size_t i = 0; i < args.size(); ++i) {
    if (auto v = flag_value(args, i, "--to-hf")) out_dir = *v;
    else if (auto d = flag_value(args, i, "--dtype")) dtype = *d;
    else if (args[i] == "--force") force = true;
    else if (!args[i].empty() && args[i][0] != '-' && ckpt_dir.empty()) ckpt_dir = args[i];
    else throw Error(cat("unexpected argument '", args[i], "'. ", usage));
  }
  if (ckpt_dir.empty() || out_dir.empty()) throw Error(usage);
  if (dtype != "fp32" && dtype != "bf16") throw Error(cat("--dtype ", dtype, " is not one of: fp32, bf16"));

  std::error_code ec;
  const fs::file_status st = fs::status(ckpt_dir, ec);
  if (!fs::exists(st)) throw Error(cat(ckpt_dir, " does not exist; give a checkpoint folder "
                                       "(<checkpoint.dir>/step_NNNNNNNN)"));
  if (!fs::is_directory(st))
    throw Error(cat(ckpt_dir, " is ", fs::is_regular_file(st) ? "a file" : "not a folder",
                    "; give a checkpoint folder (<checkpoint.dir>/step_NNNNNNNN)"));
  // A checkpoints folder rather than one step of it, or a run folder (its
  // checkpoints in checkpoints/, the default checkpoint.dir): name the steps.
  if (!fs::exists(fs::path(ckpt_dir) / "meta.json")) {
    for (const fs::path& root : {fs::path(ckpt_dir), fs::path(ckpt_dir) / "checkpoints"}) {
      const auto latest = ckpt::latest_complete(root.string());
      if (latest)
        throw Error(cat(ckpt_dir, " is ", root == fs::path(ckpt_dir) ? "a folder of checkpoints" : "a run folder",
                        ", not one checkpoint; complete ones", root == fs::path(ckpt_dir) ? "" : cat(" in ", root.string()),
                        ": ", ckpt::complete_list(root.string()), ". Convert the newest with: loom convert ",
                        latest->dir, " --to-hf ", out_dir));
    }
    // Neither: not an interrupted save either (that has the folder name and no marker).
    fs::path named = fs::path(ckpt_dir).lexically_normal();
    if (named.filename().empty()) named = named.parent_path();  // "step_00000009/"
    if (!fs::exists(fs::path(ckpt_dir) / "COMPLETE") && named.filename().string().rfind("step_", 0) != 0)
      throw Error(cat(ckpt_dir, " is not a checkpoint (it has no meta.json) and holds no complete "
                      "checkpoints; give a checkpoint folder (<checkpoint.dir>/step_NNNNNNNN)"));
  }
  // The export must not land inside a checkpoint: it would change a complete
  // checkpoint's folder, and pruning (checkpoint.keep_last) would delete it.
  const fs::path out_abs = fs::weakly_canonical(fs::absolute(out_dir), ec);
  for (fs::path p = out_abs; !ec && !p.empty(); p = p.parent_path()) {
    if (fs::exists(p / "meta.json", ec) || fs::exists(p / "COMPLETE", ec))
      throw Error(cat("--to-hf ", out_dir, " is inside the checkpoint ", p.string(),
                      "; write the Hugging Face folder elsewhere (pruning of old checkpoints would delete it)"));
    if (p == p.parent_path()) break;
  }
  // A model already there is replaced only on request, and then whole.
  const fs::file_status ost = fs::status(out_dir, ec);
  if (fs::exists(ost) && !fs::is_directory(ost))
    throw Error(cat("--to-hf ", out_dir, " is ", fs::is_regular_file(ost) ? "a file" : "not a folder",
                    "; give a folder to write the Hugging Face model into"));
  const std::vector<std::string> existing = fs::exists(ost) ? model_files(out_dir) : std::vector<std::string>{};
  if (!existing.empty() && !force)
    throw Error(cat("--to-hf ", out_dir, " already holds a model (", join(existing),
                    "): writing into it would replace it, and beside a sharded one would leave its index naming the "
                    "old shards, which loaders prefer. Write to a new folder, or add --force to replace that model "
                    "whole (config.json, model.safetensors, the index and its shards; other files are kept)"));

  // Damage is refused with the checkpoint beside it that can be converted instead.
  std::unique_ptr<ckpt::CheckpointSet> set;
  std::map<std::string, std::vector<float>> weights;
  try {
    set = std::make_unique<ckpt::CheckpointSet>(ckpt_dir);
    for (const UnitInfo& u : model_units(set->meta().spec, set->meta().layers))
      for (const ParamInfo& p : u.params) {
        const ckpt::SavedParam& sp = set->param(p.name);
        if (sp.shape != p.shape)  // (versions before 4 are not held to the derived layout when opened)
          throw ckpt::CheckpointDamaged(cat(ckpt_dir, ": parameter ", p.name, " has the wrong shape for the model "
                                            "its meta.json describes; the checkpoint cannot be used"));
        weights[p.name] = set->weights_f32(sp);
      }
  } catch (const ckpt::CheckpointDamaged& e) {
    throw Error(cat(e.what(), ". ", convert_advice(ckpt_dir, out_dir)));
  }
  const ckpt::TrainMeta& m = set->meta();
  // Every weight was read finite (CheckpointSet::read refuses NaN and inf, as
  // resuming does). In bf16 a finite fp32 beyond bf16's largest value
  // (3.3895314e38) rounds to inf, which `model.init = "hf:..."` would then
  // refuse: refused here, before anything is written.
  if (dtype == "bf16")
    for (const auto& [name, w] : weights)
      for (size_t i = 0; i < w.size(); ++i)
        if ((hf::f32_to_bf16(w[i]) & 0x7F80u) == 0x7F80u) {
          char v[32];
          std::snprintf(v, sizeof v, "%.9g", static_cast<double>(w[i]));
          throw Error(cat("checkpoint ", set->dir(), ": '", name, "' holds ", v, " at element ", i,
                          ", beyond bf16's range (its largest value is 3.3895314e38; from 3.3961776e38 on, a value rounds to inf): --dtype bf16 "
                          "would write inf there, which Loom refuses to load. Convert with --dtype fp32; nothing was "
                          "written"));
        }
  ModelSpec spec = m.spec;
  spec.max_seq_len = trained_max_seq_len(set->dir(), spec.max_seq_len);
  auto src = [&](const std::string& name) -> const float* {
    auto it = weights.find(name);
    return it == weights.end() ? nullptr : it->second.data();
  };
  const DType out = dtype == "bf16" ? DType::bf16 : DType::f32;
  const fs::path staging = fs::path(out_dir) / ".loom-convert.tmp";  // also a leftover of an interrupted --force
  if (existing.empty()) {
    hf::save_hf_llama(out_dir, spec, src, out);
    fs::remove_all(staging, ec);
  } else {
    // --force: the whole new model first, beside the old one; then moved in
    // (the weights first, with the old index gone right after them, so both
    // loom and transformers read the new weights from then on), then the old
    // shards removed.
    const fs::path dir(out_dir);
    fs::remove_all(staging, ec);
    hf::save_hf_llama(staging.string(), spec, src, out);
    const std::vector<fs::path> shards = stale_shards(dir);
    rename_or_throw(staging / "model.safetensors", dir / "model.safetensors");
    ckpt::fsync_dir(dir.string());
    if (fs::exists(dir / kIndex, ec)) remove_or_throw(dir / kIndex);
    rename_or_throw(staging / "config.json", dir / "config.json");
    ckpt::fsync_dir(dir.string());
    for (const fs::path& s : shards) remove_or_throw(s);
    fs::remove_all(staging, ec);
    ckpt::fsync_dir(dir.string());
    std::fprintf(stdout, "replaced the model in %s (%s)%s\n", out_dir.c_str(), join(existing).c_str(),
                 shards.empty() ? "" : cat("; removed ", shards.size(), " old shard(s) and the index").c_str());
  }
  const std::string line =
      cat("wrote ", out_dir, " (step ", m.step, ", ", m.world_size, " rank(s), ", dtype_name(m.params_dtype),
          " params", m.has_master ? " + fp32 master" : "", ", ", m.layers, " layers) as a Hugging Face ", spec.moe() ? "Mixtral" : "Llama", " folder (",
          dtype, ")\n");
  std::fputs(line.c_str(), stdout);
  return 0;
}

}  // namespace loom::app
