// loom convert CHECKPOINT_DIR --to-hf OUT_DIR [--dtype fp32|bf16]
//
// Writes a checkpoint's weights as a Hugging Face Llama folder (config.json +
// model.safetensors) that transformers' LlamaForCausalLM.from_pretrained loads.
// Any checkpoint: any world size and strategy (the shards are put back
// together), fp32 or bf16 parameters (the fp32 master copy is used when there
// is one), native or fused layers (the same names and layout). It reads
// through the same code as resuming (checkpoint/train_checkpoint.hpp).
#include <cstdio>
#include <filesystem>
#include <map>

#include "checkpoint/train_checkpoint.hpp"
#include "cli.hpp"
#include "commands.hpp"
#include "hf/hf_llama.hpp"
#include "loom/error.hpp"
#include "loom/model.hpp"

namespace fs = std::filesystem;

namespace loom::app {

int cmd_convert(const Args& args) {
  const char* usage = "usage: loom convert CHECKPOINT_DIR --to-hf OUT_DIR [--dtype fp32|bf16]";
  if (wants_help(args)) {
    std::printf("%s\n", usage);
    return 0;
  }
  std::string ckpt_dir, out_dir, dtype = "bf16";
  for (size_t i = 0; i < args.size(); ++i) {
    if (auto v = flag_value(args, i, "--to-hf")) out_dir = *v;
    else if (auto d = flag_value(args, i, "--dtype")) dtype = *d;
    else if (!args[i].empty() && args[i][0] != '-' && ckpt_dir.empty()) ckpt_dir = args[i];
    else throw Error(cat("unexpected argument '", args[i], "'. ", usage));
  }
  if (ckpt_dir.empty() || out_dir.empty()) throw Error(usage);
  if (dtype != "fp32" && dtype != "bf16") throw Error(cat("loom convert: --dtype ", dtype, " is not one of: fp32, bf16"));

  std::error_code ec;
  const fs::file_status st = fs::status(ckpt_dir, ec);
  if (!fs::exists(st)) throw Error(cat("loom convert: ", ckpt_dir, " does not exist; give a checkpoint folder "
                                       "(<checkpoint.dir>/step_NNNNNNNN)"));
  if (!fs::is_directory(st))
    throw Error(cat("loom convert: ", ckpt_dir, " is ", fs::is_regular_file(st) ? "a file" : "not a folder",
                    "; give a checkpoint folder (<checkpoint.dir>/step_NNNNNNNN)"));
  // A checkpoints folder rather than one step of it, or a run folder (its
  // checkpoints in checkpoints/, the default checkpoint.dir): name the steps.
  if (!fs::exists(fs::path(ckpt_dir) / "meta.json")) {
    for (const fs::path& root : {fs::path(ckpt_dir), fs::path(ckpt_dir) / "checkpoints"}) {
      const auto latest = ckpt::latest_complete(root.string());
      if (latest)
        throw Error(cat("loom convert: ", ckpt_dir, " is ",
                        root == fs::path(ckpt_dir) ? "a folder of checkpoints" : "a run folder",
                        ", not one checkpoint; complete ones", root == fs::path(ckpt_dir) ? "" : cat(" in ", root.string()),
                        ": ", ckpt::complete_list(root.string()), ". Convert the newest with: loom convert ",
                        latest->dir, " --to-hf ", out_dir));
    }
    // Neither: not an interrupted save either (that has the folder name and no marker).
    fs::path named = fs::path(ckpt_dir).lexically_normal();
    if (named.filename().empty()) named = named.parent_path();  // "step_00000009/"
    if (!fs::exists(fs::path(ckpt_dir) / "COMPLETE") && named.filename().string().rfind("step_", 0) != 0)
      throw Error(cat("loom convert: ", ckpt_dir, " is not a checkpoint (it has no meta.json) and holds no complete "
                      "checkpoints; give a checkpoint folder (<checkpoint.dir>/step_NNNNNNNN)"));
  }
  // The export must not land inside a checkpoint: it would change a complete
  // checkpoint's folder, and pruning (checkpoint.keep_last) would delete it.
  const fs::path out_abs = fs::weakly_canonical(fs::absolute(out_dir), ec);
  for (fs::path p = out_abs; !ec && !p.empty(); p = p.parent_path()) {
    if (fs::exists(p / "meta.json", ec) || fs::exists(p / "COMPLETE", ec))
      throw Error(cat("loom convert: --to-hf ", out_dir, " is inside the checkpoint ", p.string(),
                      "; write the Hugging Face folder elsewhere (pruning of old checkpoints would delete it)"));
    if (p == p.parent_path()) break;
  }
  ckpt::CheckpointSet set(ckpt_dir);
  const ckpt::TrainMeta& m = set.meta();
  ModelSpec spec = m.spec;
  std::map<std::string, std::vector<float>> weights;
  for (const UnitInfo& u : model_units(spec, m.layers))
    for (const ParamInfo& p : u.params) {
      const ckpt::SavedParam& sp = set.param(p.name);
      if (sp.shape != p.shape)
        throw Error(cat("loom convert: ", ckpt_dir, ": parameter ", p.name, " has the wrong shape for the model its "
                        "meta.json describes: the checkpoint is damaged"));
      weights[p.name] = set.weights_f32(sp);
    }
  hf::save_hf_llama(out_dir, spec, [&](const std::string& name) -> const float* {
    auto it = weights.find(name);
    return it == weights.end() ? nullptr : it->second.data();
  }, dtype == "bf16" ? DType::bf16 : DType::f32);
  const std::string line =
      cat("wrote ", out_dir, " (step ", m.step, ", ", m.world_size, " rank(s), ", dtype_name(m.params_dtype),
          " params", m.has_master ? " + fp32 master" : "", ", ", m.layers, " layers) as a Hugging Face ", spec.moe() ? "Mixtral" : "Llama", " folder (",
          dtype, ")\n");
  std::fputs(line.c_str(), stdout);
  return 0;
}

}  // namespace loom::app
