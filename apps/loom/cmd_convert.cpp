// loom convert CHECKPOINT_DIR --to-hf OUT_DIR [--dtype fp32|bf16]
//
// Writes a checkpoint's weights as a Hugging Face Llama folder (config.json +
// model.safetensors) that transformers' LlamaForCausalLM.from_pretrained loads.
#include <cstdio>
#include <map>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.hpp"
#include "commands.hpp"
#include "hf/hf_llama.hpp"
#include "loom/error.hpp"
#include "loom/model.hpp"

namespace loom::app {

int cmd_convert(const Args& args) {
  std::string ckpt_dir, out_dir, dtype = "bf16";
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--to-hf" && i + 1 < args.size()) out_dir = args[++i];
    else if (args[i] == "--dtype" && i + 1 < args.size()) dtype = args[++i];
    else if (!args[i].empty() && args[i][0] != '-' && ckpt_dir.empty()) ckpt_dir = args[i];
    else throw Error(cat("loom convert: unexpected argument '", args[i],
                         "'. usage: loom convert CHECKPOINT_DIR --to-hf OUT_DIR [--dtype fp32|bf16]"));
  }
  if (ckpt_dir.empty() || out_dir.empty())
    throw Error("usage: loom convert CHECKPOINT_DIR --to-hf OUT_DIR [--dtype fp32|bf16]");
  if (dtype != "fp32" && dtype != "bf16")
    throw Error(cat("loom convert: --dtype ", dtype, " is not one of: fp32, bf16"));

  ckpt::CheckpointReader reader(ckpt_dir, 0);
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(reader.meta());
  } catch (const nlohmann::json::exception& e) {
    throw Error(cat(ckpt_dir, "/meta.json is not valid JSON: ", e.what()));
  }
  if (meta.value("world_size", 1) != 1)
    throw Error(cat(ckpt_dir, " holds a checkpoint sharded over ", meta.value("world_size", 1),
                    " ranks; loom convert reads single-rank checkpoints"));
  const auto& m = meta.at("model");
  ModelSpec spec;
  spec.hidden = m.at("hidden");
  spec.num_layers = m.at("num_layers");
  spec.num_heads = m.at("num_heads");
  spec.num_kv_heads = m.at("num_kv_heads");
  spec.ffn_hidden = m.at("ffn_hidden");
  spec.vocab_size = m.at("vocab_size");
  spec.rope_theta = m.at("rope_theta");
  spec.norm_eps = m.at("norm_eps");
  spec.tied_embeddings = m.at("tied_embeddings");
  spec.max_seq_len = m.value("max_seq_len", spec.max_seq_len);

  // Each unit's flat fp32 params, then per-tensor pointers into them.
  std::map<std::string, std::vector<float>> flat;
  std::map<std::string, const float*> by_name;
  for (const UnitInfo& u : model_units(spec)) {
    const std::string key = "params." + u.name;
    const ckpt::TensorRecord& rec = reader.info(key);
    if (rec.dtype != DType::f32)
      throw Error(cat(reader.file(), ": tensor '", key, "' is ", dtype_name(rec.dtype),
                      "; loom convert expects fp32 parameters"));
    std::vector<float>& buf = flat[u.name];
    int64_t numel = 1;
    for (int64_t d : rec.shape) numel *= d;
    if (numel < u.numel)
      throw Error(cat(reader.file(), ": tensor '", key, "' has ", numel, " elements, the model needs ", u.numel));
    buf.resize(static_cast<size_t>(numel));
    Tensor t(buf.data(), DType::f32, Device::cpu, {numel});
    reader.read(key, t);
    for (const ParamInfo& p : u.params) by_name[p.name] = buf.data() + p.offset;
  }
  hf::save_hf_llama(out_dir, spec, [&](const std::string& name) { return by_name.at(name); },
                    dtype == "bf16" ? DType::bf16 : DType::f32);
  std::printf("wrote %s (step %lld, %s) as a Hugging Face Llama folder\n", out_dir.c_str(),
              static_cast<long long>(meta.value("step", 0)), dtype.c_str());
  return 0;
}

}  // namespace loom::app
