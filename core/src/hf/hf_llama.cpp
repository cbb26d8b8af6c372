#include "hf/hf_llama.hpp"

#include <cmath>
#include <limits>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <vector>

#include "checkpoint/file_util.hpp"
#include "config/format_number.hpp"
#include "config/run_config.hpp"
#include "hf/safetensors.hpp"
#include "loom/error.hpp"

namespace fs = std::filesystem;

namespace loom::hf {
namespace {

using json = nlohmann::json;

using config_detail::format_number;

// A JSON value as a message shows it, with its type where the text alone
// would hide it ("\"4096\" (a string)", "true (a boolean)", "4096.0 (a
// fraction)").
std::string shown(const json& v) {
  if (v.is_string()) return cat(v.dump(), " (a string)");
  if (v.is_boolean()) return cat(v.dump(), " (a boolean)");
  if (v.is_array()) return cat(v.dump(), " (an array)");
  if (v.is_object()) return cat(v.dump(), " (an object)");
  if (v.is_number_float()) {
    const std::string t = v.dump();
    return t.find_first_of(".eE") == std::string::npos ? t + " (a fraction)" : t;
  }
  return v.dump();
}

// Every value read from config.json is held to the range of the model.* key
// it becomes (config/run_config.hpp): a value beyond it would be trained with
// while the run's own config.toml, which records it under that key, is
// refused by `loom check` — or, for a size, found only as a huge allocation.
// The message names the file, the JSON key, the value, the range and the key.
// `model_key` "" for a key that sets none (head_dim: checked against the sizes).
[[noreturn]] void refuse(const std::string& origin, const std::string& key, const json& v, const std::string& model_key,
                         const std::string& range) {
  throw Error(cat(origin, ": \"", key, "\" is ", shown(v), ", outside what Loom accepts",
                  model_key.empty() ? std::string() : cat(" for model.", model_key, ", which it sets"), ": ", range,
                  model_key.empty() ? std::string() : cat(", the range of model.", model_key),
                  ". The file is damaged, or describes a model Loom cannot train"));
}

int64_t get_int(const json& j, const std::string& origin, const char* key, std::optional<int64_t> def,
                const char* model_key, int64_t max) {
  if (!j.contains(key) || j[key].is_null()) {
    if (def) return *def;
    throw Error(cat(origin, ": required key \"", key, "\" is missing; this is not a complete Llama config.json"));
  }
  const auto& v = j[key];
  const std::string range = max == std::numeric_limits<int64_t>::max() ? std::string("a positive integer")
                                                                        : cat("a positive integer, at most ", max);
  // Unsigned first: a number beyond int64 is no negative one.
  const bool ok = v.is_number_unsigned() ? v.get<uint64_t>() >= 1 && v.get<uint64_t>() <= static_cast<uint64_t>(max)
                                         : v.is_number_integer() && v.get<int64_t>() >= 1 && v.get<int64_t>() <= max;
  if (!ok) refuse(origin, key, v, model_key, range);
  return v.get<int64_t>();
}

// A number in [lo, hi] (an infinite hi: no upper bound), finite; `range`
// says it in words.
double get_double(const json& j, const std::string& origin, const std::string& shown_key, const char* key,
                  double def, const char* model_key, double lo, double hi) {
  if (!j.contains(key) || j[key].is_null()) return def;
  const auto& v = j[key];
  const std::string range = std::isinf(hi) ? cat("a finite number >= ", format_number(lo))
                                           : cat("a number in [", format_number(lo), ", ", format_number(hi), "]");
  if (!v.is_number() || !std::isfinite(v.get<double>()) || !(v.get<double>() >= lo && v.get<double>() <= hi))
    refuse(origin, shown_key, v, model_key, range);
  return v.get<double>();
}

// A JSON parse error at a NaN or Infinity (Python's json module writes them
// for non-finite floats; JSON has no such numbers): the key it belongs to,
// found by looking back from the error, for the message; "" when it is not that.
std::string nonfinite_literal_key(const std::string& text, size_t at) {
  // nlohmann reports how many bytes it read: the literal lies just around there.
  const size_t lo = at > 12 ? at - 12 : 0;
  const std::string window = text.substr(lo, 24);
  size_t q = std::string::npos;
  for (const char* lit : {"NaN", "Infinity"})
    if (const size_t f = window.find(lit); f != std::string::npos) q = std::min(q, lo + f);
  if (q == std::string::npos) return "";
  size_t k = q;  // back over a sign, ':' and whitespace to the key's closing quote
  while (k > 0 && std::string_view("-+: \t\r\n").find(text[k - 1]) != std::string_view::npos) --k;
  if (k < 2 || text[k - 1] != '"') return "?";
  const size_t open = text.rfind('"', k - 2);
  return open == std::string::npos ? "?" : text.substr(open + 1, k - 2 - open);
}

// A RoPE block that means "no scaling": null, or a rope_type/type of "default".
// A rope_type that is no string (a number, null) is not "default" either: the
// caller refuses the block, printing it.
bool rope_is_default(const json& r) {
  if (r.is_null()) return true;
  if (!r.is_object()) return false;
  for (const char* k : {"rope_type", "type"})
    if (r.contains(k)) return r[k].is_string() && r[k].get<std::string>() == "default";
  return true;
}

// Whether `p` names something that can be opened. A link loop or a
// dangling link is not there (fs::exists would throw "Too many levels of
// symbolic links" for the loop, with no word of which file or what to do):
// the caller's "not found" message lists it as a link that cannot be followed.
bool present(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p, ec) && !ec;
}

// The folder's entries for a "not found" message. A link whose target is
// missing (or a link loop) is listed as such: "no model.safetensors (found:
// model.safetensors)" would contradict itself, the usual cause being a
// download cache that was cleaned under its links.
std::string list_dir(const std::string& dir) {
  std::string s;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::string item = e.path().filename().string();
    std::error_code lec;
    if (fs::is_symlink(e.symlink_status(lec)) && !fs::exists(e.path(), lec)) {
      std::error_code rec;
      const fs::path to = fs::read_symlink(e.path(), rec);
      item += cat(" (a link to ", rec ? std::string("?") : to.string(),
                  ", which cannot be followed: its target is missing or the links loop)");
    }
    s += (s.empty() ? "" : ", ") + item;
  }
  return s.empty() ? "(empty)" : s;
}

bool ignorable(const std::string& name, const ModelSpec& spec) {
  // Older transformers saved the RoPE frequencies as a buffer; they follow from rope_theta.
  const std::string inv = "rotary_emb.inv_freq";
  if (name.size() >= inv.size() && name.compare(name.size() - inv.size(), inv.size(), inv) == 0) return true;
  // A tied head is the embedding; some exporters still store a copy.
  return spec.tied_embeddings && name == "lm_head.weight";
}

}  // namespace

ModelSpec parse_hf_llama_config(const std::string& text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    const std::string key = nonfinite_literal_key(text, e.byte);
    throw Error(cat(origin, ": not valid JSON (", e.what(), ")",
                    key.empty() ? std::string()
                                : cat(key == "?" ? std::string(": a value") : cat(": \"", key, "\""),
                                      " is NaN or Infinity, which JSON has no number for (Python's json module writes "
                                      "them for non-finite floats); every number Loom reads from config.json is a "
                                      "finite one in the range of the model.* key it sets")));
  } catch (const json::exception& e) {
    throw Error(cat(origin, ": not valid JSON (", e.what(), ")"));
  }
  if (!j.is_object()) throw Error(cat(origin, ": expected a JSON object"));
  std::string mt = j.contains("model_type") && j["model_type"].is_string() ? j["model_type"].get<std::string>() : "";
  if (mt != "llama" && mt != "mixtral")
    throw Error(cat(origin, ": model_type is ", j.contains("model_type") ? j["model_type"].dump() : "missing",
                    ", expected \"llama\" or \"mixtral\"; Loom imports Llama-architecture models and their "
                    "Mixtral mixture of experts only"));
  std::string act = j.contains("hidden_act") && j["hidden_act"].is_string() ? j["hidden_act"].get<std::string>()
                                                                              : std::string("silu");
  if (j.contains("hidden_act") && !j["hidden_act"].is_string())
    throw Error(cat(origin, ": hidden_act must be a string, found ", j["hidden_act"].dump()));
  if (act != "silu")
    throw Error(cat(origin, ": hidden_act is \"", act, "\", but Loom's MLP is SwiGLU (silu); this model cannot be imported"));
  for (const char* k : {"attention_bias", "mlp_bias"}) {
    if (j.contains(k) && !j[k].is_null() && !(j[k].is_boolean() && !j[k].get<bool>()))
      throw Error(cat(origin, ": ", k, " is ", j[k].dump(), ", but Loom's Llama has no bias terms; this model cannot be imported"));
  }
  if (j.contains("rope_scaling") && !rope_is_default(j["rope_scaling"]))
    throw Error(cat(origin, ": rope_scaling is ", j["rope_scaling"].dump(),
                    ", but Loom implements plain RoPE only; this model cannot be imported"));
  ModelSpec s;
  s.hidden = get_int(j, origin, "hidden_size", std::nullopt, "hidden", kMaxDim);
  s.num_layers = get_int(j, origin, "num_hidden_layers", std::nullopt, "num_layers", kMaxLayersOrHeads);
  s.num_heads = get_int(j, origin, "num_attention_heads", std::nullopt, "num_heads", kMaxLayersOrHeads);
  s.num_kv_heads = get_int(j, origin, "num_key_value_heads", s.num_heads, "num_kv_heads", kMaxLayersOrHeads);
  s.ffn_hidden = get_int(j, origin, "intermediate_size", std::nullopt, "ffn_hidden", kMaxDim);
  s.vocab_size = get_int(j, origin, "vocab_size", std::nullopt, "vocab_size", kMaxVocabSize);
  // Defaults below are LlamaConfig's, so a config that omits a key means what it means in HF.
  // max_position_embeddings becomes model.max_seq_len (RoPE's tables are sized from it).
  s.max_seq_len = get_int(j, origin, "max_position_embeddings", 2048, "max_seq_len", kMaxDim);
  // The ranges of model.norm_eps and model.rope_theta (config/run_config.hpp):
  // RMSNorm's epsilon is an fp32 on the device, RoPE's angles must stay finite.
  s.norm_eps = get_double(j, origin, "rms_norm_eps", "rms_norm_eps", 1e-6, "norm_eps", kFp32MinNormal, kMaxNormEps);
  const double inf = std::numeric_limits<double>::infinity();
  if (j.contains("rope_theta") && !j["rope_theta"].is_null()) {
    s.rope_theta = get_double(j, origin, "rope_theta", "rope_theta", 10000.0, "rope_theta", kMinRopeTheta, inf);
  } else if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    const auto& rp = j["rope_parameters"];
    if (!rope_is_default(rp))
      throw Error(cat(origin, ": rope_parameters is ", rp.dump(),
                      ", but Loom implements plain RoPE only (rope_type \"default\"); this model cannot be imported"));
    s.rope_theta = rp.contains("rope_theta") ? get_double(rp, origin, "rope_parameters.rope_theta", "rope_theta",
                                                          10000.0, "rope_theta", kMinRopeTheta, inf)
                                             : 10000.0;
  } else {
    s.rope_theta = 10000.0;
  }
  if (j.contains("tie_word_embeddings") && !j["tie_word_embeddings"].is_null()) {
    if (!j["tie_word_embeddings"].is_boolean())
      refuse(origin, "tie_word_embeddings", j["tie_word_embeddings"], "tied_embeddings", "true or false");
    s.tied_embeddings = j["tie_word_embeddings"].get<bool>();
  } else {
    s.tied_embeddings = false;
  }
  if (s.hidden % s.num_heads != 0)
    throw Error(cat(origin, ": hidden_size ", s.hidden, " is not divisible by num_attention_heads ", s.num_heads));
  if (s.num_heads % s.num_kv_heads != 0)
    throw Error(cat(origin, ": num_attention_heads ", s.num_heads, " is not divisible by num_key_value_heads ",
                    s.num_kv_heads));
  if (mt == "mixtral") {
    // MixtralConfig's defaults for omitted keys, as for Llama's above.
    s.num_experts = get_int(j, origin, "num_local_experts", 8, "num_experts", kMaxExperts);
    s.top_k = get_int(j, origin, "num_experts_per_tok", 2, "top_k", kMaxTopK);
    if (s.top_k > s.num_experts)
      throw Error(cat(origin, ": num_experts_per_tok ", s.top_k, " exceeds num_local_experts ", s.num_experts,
                      "; each token picks that many distinct experts"));
    s.router_aux_loss_coef = get_double(j, origin, "router_aux_loss_coef", "router_aux_loss_coef", 0.001,
                                        "router_aux_loss_coef", 0.0, kMaxRouterAuxLossCoef);
    s.router_jitter_noise = get_double(j, origin, "router_jitter_noise", "router_jitter_noise", 0.0,
                                       "router_jitter_noise", 0.0, kMaxRouterJitterNoise);
    if (j.contains("sliding_window") && !j["sliding_window"].is_null())
      throw Error(cat(origin, ": sliding_window is ", j["sliding_window"].dump(),
                      ", but Loom's attention is full causal attention; this model cannot be imported "
                      "(Mixtral's published configs have sliding_window = null)"));
  }
  if (j.contains("head_dim") && !j["head_dim"].is_null()) {
    const int64_t hd = get_int(j, origin, "head_dim", std::nullopt, "", std::numeric_limits<int64_t>::max());
    if (hd != s.hidden / s.num_heads)
      throw Error(cat(origin, ": head_dim is ", hd, " but hidden_size / num_attention_heads = ", s.hidden / s.num_heads,
                      "; Loom requires head_dim = hidden_size / num_attention_heads, so this model cannot be imported"));
  }
  return s;
}

ModelSpec read_hf_llama_config(const std::string& dir) {
  std::string path = (fs::path(dir) / "config.json").string();
  // The folder itself first: "no config.json in X (found: (empty))" would hide
  // that X does not exist or is a file.
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  if (!fs::exists(st))
    throw Error(cat("model.init = \"hf:", dir, "\": ", dir, " does not exist",
                    fs::path(dir).is_relative() ? cat(" (relative to the working directory ", fs::current_path(ec).string(), ")") : "",
                    "; point at a Hugging Face model directory (the one save_pretrained writes)"));
  if (!fs::is_directory(st))
    throw Error(cat("model.init = \"hf:", dir, "\": ", dir, " is ", fs::is_regular_file(st) ? "a file" : "not a folder",
                    "; point at the Hugging Face model directory (the one save_pretrained writes) that holds "
                    "config.json and the safetensors files"));
  if (!present(path))
    throw Error(cat("no config.json in ", dir, " (found: ", list_dir(dir),
                    "); point at a Hugging Face model directory (the one save_pretrained writes)"));
  return parse_hf_llama_config(ckpt::read_file(path, "HF config"), path);
}

void load_hf_llama_weights(const std::string& dir, const ModelSpec& spec,
                           const std::function<float*(const std::string&, int64_t)>& dst) {
  const fs::path d(dir);
  std::vector<std::unique_ptr<SafeTensorsFile>> files;
  std::map<std::string, const SafeTensorsFile*> where;  // tensor -> file holding it
  const fs::path index = d / "model.safetensors.index.json";
  if (present(index)) {
    json j;
    try {
      j = json::parse(ckpt::read_file(index.string(), "safetensors index"));
    } catch (const json::exception& e) {
      throw Error(cat(index.string(), ": not valid JSON (", e.what(), ")"));
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw Error(cat(index.string(), ": no \"weight_map\" object; expected {\"weight_map\": {tensor: file}}"));
    std::map<std::string, const SafeTensorsFile*> by_file;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string())
        throw Error(cat(index.string(), ": weight_map entry for '", it.key(), "' is not a file name"));
      std::string fname = it.value().get<std::string>();
      if (fname.find('/') != std::string::npos || fname == "..")
        throw Error(cat(index.string(), ": weight_map entry for '", it.key(), "' names '", fname,
                        "', which is not a file in this directory"));
      if (!by_file.count(fname)) {
        fs::path p = d / fname;
        if (!present(p))
          throw Error(cat(index.string(), ": tensor '", it.key(), "' is in '", fname,
                          "', which does not exist; the download is incomplete"));
        files.push_back(std::make_unique<SafeTensorsFile>(p.string()));
        by_file[fname] = files.back().get();
      }
      const SafeTensorsFile* f = by_file[fname];
      if (!f->has(it.key()))
        throw Error(cat(f->path(), ": tensor '", it.key(), "' is listed in ", index.string(),
                        " but not present in the file; the shard and the index do not match"));
      where[it.key()] = f;
    }
    // Tensors present in a shard but missing from the index are still
    // unexpected contents: check them too.
    for (auto& f : files)
      for (const auto& n : f->names())
        if (!where.count(n))
          throw Error(cat(f->path(), ": tensor '", n, "' is not listed in ", index.string(),
                          "; the shard and the index do not match"));
  } else if (present(d / "model.safetensors")) {
    files.push_back(std::make_unique<SafeTensorsFile>((d / "model.safetensors").string()));
    for (const auto& n : files.back()->names()) where[n] = files.back().get();
  } else {
    throw Error(cat("no model.safetensors or model.safetensors.index.json in ", dir, " (found: ", list_dir(dir),
                    "); Loom reads safetensors only — convert .bin checkpoints with transformers' "
                    "save_pretrained(..., safe_serialization=True)"));
  }

  std::set<std::string> expected;
  for (const auto& u : model_units(spec)) {
    for (const auto& p : u.params) {
      expected.insert(p.name);
      auto it = where.find(p.name);
      if (it == where.end())
        throw Error(cat(dir, ": tensor '", p.name, "' is missing; the config (", spec.num_layers, " layers, tie_word_embeddings=",
                        spec.tied_embeddings ? "true" : "false", ") needs it — config.json and the weights do not match"));
      const auto& info = it->second->info(p.name);
      if (info.shape != p.shape) {
        std::string want = "[";
        for (size_t i = 0; i < p.shape.size(); ++i) want += (i ? ", " : "") + std::to_string(p.shape[i]);
        throw Error(cat(it->second->path(), ": tensor '", p.name, "' has shape ", info.shape_str(), ", expected ", want,
                        "] from config.json; config.json and the weights do not match"));
      }
      float* out = dst(p.name, p.numel);
      if (out) it->second->read_f32(p.name, out, p.numel);
    }
  }
  for (const auto& [name, f] : where)
    if (!expected.count(name) && !ignorable(name, spec))
      throw Error(cat(f->path(), ": unexpected tensor '", name, "' (", f->info(name).shape_str(),
                      "), not part of a ", spec.moe() ? "Mixtral" : "Llama", " model with this config.json; the weights belong to another architecture "
                      "or config"));
}

void save_hf_llama(const std::string& dir, const ModelSpec& spec,
                   const std::function<const float*(const std::string&)>& src, DType out,
                   const HfExportOptions& options) {
  if (out != DType::f32 && out != DType::bf16)
    throw Error(cat("HF export to ", dir, ": dtype ", dtype_name(out), " is not supported; use fp32 or bf16"));
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(cat("cannot create export directory ", dir, ": ", ec.message()));

  std::vector<SafeTensorsEntry> entries;
  for (const auto& u : model_units(spec)) {
    for (const auto& p : u.params) {
      const float* data = src(p.name);
      if (!data) throw Error(cat("HF export to ", dir, ": no data for tensor '", p.name, "'"));
      // Norm gains stay fp32-representable anyway; HF keeps one dtype per file, so all use `out`.
      entries.push_back({p.name, p.shape, data, DType::f32, out});
    }
  }
  const std::string torch_dtype = out == DType::bf16 ? "bfloat16" : "float32";
  // "format": "pt" is required: from_pretrained refuses safetensors files without it.
  write_safetensors((fs::path(dir) / "model.safetensors").string(), entries, {{"format", "pt"}});

  nlohmann::ordered_json c;
  c["architectures"] = {spec.moe() ? "MixtralForCausalLM" : "LlamaForCausalLM"};
  c["model_type"] = spec.moe() ? "mixtral" : "llama";
  c["hidden_size"] = spec.hidden;
  c["num_hidden_layers"] = spec.num_layers;
  c["num_attention_heads"] = spec.num_heads;
  c["num_key_value_heads"] = spec.num_kv_heads;
  c["head_dim"] = spec.head_dim();
  c["intermediate_size"] = spec.ffn_hidden;
  c["vocab_size"] = spec.vocab_size;
  c["max_position_embeddings"] = spec.max_seq_len;
  // Both spellings: transformers < 5 reads rope_theta, >= 5 rope_parameters.
  c["rope_theta"] = spec.rope_theta;
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", spec.rope_theta}};
  c["rope_scaling"] = nullptr;
  c["rms_norm_eps"] = spec.norm_eps;
  c["tie_word_embeddings"] = spec.tied_embeddings;
  c["hidden_act"] = "silu";
  c["attention_dropout"] = 0.0;
  if (spec.moe()) {
    c["num_local_experts"] = spec.num_experts;
    c["num_experts_per_tok"] = spec.top_k;
    c["router_aux_loss_coef"] = spec.router_aux_loss_coef;
    c["router_jitter_noise"] = spec.router_jitter_noise;
    c["output_router_logits"] = false;
    c["sliding_window"] = nullptr;
  } else {
    c["attention_bias"] = false;
    c["mlp_bias"] = false;
    c["pretraining_tp"] = 1;
  }
  c["initializer_range"] = 0.02;
  c["use_cache"] = true;
  c["torch_dtype"] = torch_dtype;  // transformers < 5
  c["dtype"] = torch_dtype;        // transformers >= 5
  if (options.bos_token_id) c["bos_token_id"] = *options.bos_token_id;
  if (options.eos_token_id) c["eos_token_id"] = *options.eos_token_id;
  // config.json last: a directory with a config but no weights would look loadable.
  ckpt::write_file_atomic((fs::path(dir) / "config.json").string(), c.dump(2) + "\n");
}

}  // namespace loom::hf
