// Reads the core sections of a run config through ConfigTable, so that a typo
// or a bad value in a core section gets the same located message as one in a
// plugin table. Ranges and choices here are the ones docs/CONFIG.md states.
#include "run_config.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>

#include "format_number.hpp"
#include "hf/hf_llama.hpp"
#include "loom/block.hpp"
#include "loom/error.hpp"
#include "util/files.hpp"

namespace loom {
namespace {

constexpr size_t kMaxConfigBytes = size_t{16} << 20;  // a config is a few KiB; more is the wrong file

using config_detail::format_number;

// Keys the device uses as fp32, their ranges in fp32 terms (run_config.hpp):
// "> 0" is from the smallest normal fp32 on, no bound beyond FLT_MAX, and a
// beta below 1 after rounding.
double get_positive_fp32(const ConfigTable& t, std::string_view key, double def, double max) {
  return t.get_float(key, def, kFp32MinNormal, max);
}

double get_beta(const ConfigTable& t, std::string_view key, double def) {
  return t.get_float(key, def, 0.0, kMaxBeta);
}

bool is_plugin_name(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  return true;
}

PluginSection read_plugin_section(const ConfigTable& root, std::string_view section, std::string_view def) {
  PluginSection p;
  p.table = root.table(section);
  // get_string marks `plugin` and `path` read; every other key is the plugin's.
  p.plugin = p.table.get_string("plugin", def);
  if (!is_plugin_name(p.plugin))
    p.table.fail("plugin", cat(section, ".plugin = \"", p.plugin,
                               "\" is not a plugin name: use letters, digits, '_' or '-' (e.g. \"", def, "\")"));
  p.path = p.table.get_string("path", "");
  return p;
}

// A string as TOML would write it, control characters escaped ("a\nb" -> "a\\nb").
std::string quoted(const std::string& v) {
  std::string out = "\"";
  for (unsigned char ch : v) {
    if (ch == '"' || ch == '\\') out += cat('\\', static_cast<char>(ch));
    else if (ch == '\n') out += "\\n";
    else if (ch == '\t') out += "\\t";
    else if (ch < 0x20 || ch == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", ch);
      out += buf;
    } else out += static_cast<char>(ch);
  }
  return out + "\"";
}

// run.name is one folder name: the default out_dir is runs/<name>, and a
// name with '/' or ".." would put the run elsewhere ("a/../../x" writes
// outside runs/ and leaves runs/a behind). It also heads every log line,
// so it must be visible: not blank, no control characters.
void check_run_name(const ConfigTable& t, const std::string& name) {
  const std::string what = cat("run.name = ", quoted(name), " ");
  const std::string use = "; it names the run in logs and its default folder runs/<name>: use one name such as "
                          "\"llama-1b\" (letters, digits, '-', '_', '.', spaces), and run.out_dir for a folder elsewhere";
  if (name.empty()) t.fail("name", "run.name must not be empty: it names the run in logs and the default out_dir");
  if (name.find_first_not_of(" \t") == std::string::npos) t.fail("name", cat(what, "is blank", use));
  if (name.find('/') != std::string::npos)
    t.fail("name", cat(what, "holds '/': runs/<name> would be a path, not a folder of runs/", use));
  if (name == "." || name == "..") t.fail("name", cat(what, "is not a folder name of its own (runs/", name, ")", use));
  for (unsigned char ch : name)
    if (ch < 0x20 || ch == 0x7f) t.fail("name", cat(what, "holds a control character", use));
}

RunSection read_run(const ConfigTable& t) {
  RunSection r;
  r.name = t.get_string("name", r.name);
  check_run_name(t, r.name);
  r.out_dir = t.get_string("out_dir", cat("runs/", r.name));
  if (r.out_dir.empty()) t.fail("out_dir", "run.out_dir must not be empty (default: runs/<run.name>)");
  r.device = t.get_choice("device", r.device, {"cpu", "cuda"});
  r.seed = static_cast<uint64_t>(t.get_int("seed", static_cast<int64_t>(r.seed), 0));
  r.deterministic = t.get_bool("deterministic", r.deterministic);
  r.log_level = t.get_choice("log_level", r.log_level, {"trace", "debug", "info", "warn", "error"});
  r.threads = static_cast<int>(t.get_int("threads", r.threads, 0, 4096));
  r.collective_timeout = t.get_float("collective_timeout", r.collective_timeout, 0.1, 86400.0);
  r.plugin_path = t.get_string_list("plugin_path", r.plugin_path);
  r.stop_signal = t.get_choice("stop_signal", r.stop_signal, {"USR1", "USR2", "none"});
  r.overwrite = t.get_bool("overwrite", r.overwrite);
  r.tensorboard = t.get_bool("tensorboard", r.tensorboard);
  return r;
}

bool hf_init(const std::string& init) { return init.rfind("hf:", 0) == 0; }

ModelSection read_model(const ConfigTable& t) {
  ModelSection m;
  ModelSpec& s = m.spec;
  m.init = t.get_string("init", m.init);
  if (m.init != "random" && !(m.init.rfind("hf:", 0) == 0 && m.init.size() > 3))
    t.fail("init", cat("model.init = \"", m.init,
                       "\" is not accepted: use \"random\" or \"hf:/path/to/dir\" (a Hugging Face Llama folder)"));
  // The block factory's table (blocks/block_table.cpp) names the variants.
  m.layers = t.get_choice("layers", m.layers, attention_variant_names());
  s.hidden = t.get_int("hidden", s.hidden, 1, kMaxDim);
  s.num_layers = t.get_int("num_layers", s.num_layers, 1, kMaxLayersOrHeads);
  s.num_heads = t.get_int("num_heads", s.num_heads, 1, kMaxLayersOrHeads);
  s.num_kv_heads = t.get_int("num_kv_heads", s.num_kv_heads, 1, kMaxLayersOrHeads);
  s.ffn_hidden = t.get_int("ffn_hidden", s.ffn_hidden, 1, kMaxDim);
  s.vocab_size = t.get_int("vocab_size", s.vocab_size, 1, kMaxVocabSize);
  s.max_seq_len = t.get_int("max_seq_len", s.max_seq_len, 1, kMaxDim);
  // RoPE's inverse frequencies theta^(-2i/D) are at most 1 from theta = 1 on, so
  // every angle (position x frequency) is a finite fp32; a huge theta only
  // rounds the slowest frequencies to 0, as in fp32 torch. Below 1 the ladder
  // is inverted and, for small theta, the angles overflow fp32.
  s.rope_theta = t.get_float("rope_theta", s.rope_theta, kMinRopeTheta);
  s.norm_eps = get_positive_fp32(t, "norm_eps", s.norm_eps, kMaxNormEps);
  s.tied_embeddings = t.get_bool("tied_embeddings", s.tied_embeddings);
  m.ffn = t.get_choice("ffn", m.ffn, ffn_variant_names());
  if (m.ffn == "moe") {
    // kMaxExperts: the CUDA backend's pinned expert counts hold that many (cuda_backend.cpp).
    s.num_experts = t.get_int("num_experts", 8, 1, kMaxExperts);
    s.top_k = t.get_int("top_k", s.top_k, 1, kMaxTopK);
    if (s.top_k > s.num_experts)
      t.fail("top_k", cat("model.top_k = ", s.top_k, " exceeds model.num_experts = ", s.num_experts,
                          ": each token picks top_k distinct experts; lower top_k or add experts"));
    s.router_aux_loss_coef = t.get_float("router_aux_loss_coef", s.router_aux_loss_coef, 0.0, kMaxRouterAuxLossCoef);
    s.router_jitter_noise = t.get_float("router_jitter_noise", s.router_jitter_noise, 0.0, kMaxRouterJitterNoise);
  } else {
    for (const char* k : {"num_experts", "top_k", "router_aux_loss_coef", "router_jitter_noise"})
      // With hf: the folder says whether there are experts (apply_hf_init compares).
      if (t.has(k) && !hf_init(m.init))
        t.fail(k, cat("model.", k, " applies to a mixture of experts only: set model.ffn = \"moe\" (model.ffn is \"",
                      m.ffn, "\")"));
  }
  m.init_std = t.get_float("init_std", m.init_std, 0.0, 1.0);
  // The token embedding's own scale. At N(0, init_std) the residual stream
  // starts at 0.02 an element, and Adam's first updates (about lr per weight,
  // whatever the gradient) let every layer's output swamp the token's
  // identity: a Llama-3-8B run from such weights climbs from 12.5 to 16-20
  // nats in its first steps. An untied embedding has no other use for a small
  // scale (its rows only enter the first RMSNorm); a tied one is also the LM
  // head, whose logits it would scale.
  m.embedding_init_std = m.init_std;
  if (t.has("embedding_init_std")) {
    m.embedding_init_std = t.get_float("embedding_init_std", m.init_std, 0.0, 1.0);
    if (s.tied_embeddings)
      t.fail("embedding_init_std",
             "model.embedding_init_std applies to an untied embedding: with model.tied_embeddings = true the "
             "embedding is also the LM head and starts at model.init_std. Remove embedding_init_std or untie the "
             "embeddings");
  }
  m.recompute = t.get_choice("recompute", m.recompute, {"none", "selective", "attention", "full"});
  m.head_chunk = t.get_int("head_chunk", m.head_chunk, 0, int64_t{1} << 40);
  // Like the experts' keys under a dense model: a key of another mode would
  // be accepted and do nothing (native layers compute every logit at once).
  if (t.has("head_chunk") && !attention_variant(m.layers).chunked_head) {
    std::string chunked;
    for (const std::string& n : attention_variant_names())
      if (attention_variant(n).chunked_head) chunked += cat(chunked.empty() ? "" : " or ", "\"", n, "\"");
    t.fail("head_chunk", cat("model.head_chunk applies to fused layers only (their LM head runs in chunks of tokens): ",
                             "set model.layers = ", chunked, " or remove model.head_chunk (model.layers is \"", m.layers,
                             "\", which computes the whole micro-batch's logits at once)"));
  }
  return m;
}

TrainSection read_train(const ConfigTable& t) {
  TrainSection r;
  r.steps = t.get_int("steps", r.steps, 1);
  r.micro_batch = t.get_int("micro_batch", r.micro_batch, 1, kMaxDim);
  r.seq_len = t.get_int("seq_len", r.seq_len, 1, kMaxDim);
  r.grad_accum = t.get_int("grad_accum", r.grad_accum, 1, kMaxDim);
  r.lr = t.get_float("lr", r.lr, 0.0, 10.0);
  r.min_lr = t.get_float("min_lr", r.min_lr, 0.0, 10.0);
  r.warmup_steps = t.get_int("warmup_steps", r.warmup_steps, 0);
  r.schedule = t.get_choice("schedule", r.schedule, {"cosine", "linear", "constant"});
  // min_lr is where a decay ends; a constant schedule has none and would ignore it.
  if (r.schedule == "constant" && t.has("min_lr"))
    t.fail("min_lr", "train.min_lr applies to a decaying schedule only (cosine, linear: the lr after the decay): "
                     "train.schedule = \"constant\" keeps train.lr after the warm-up; remove train.min_lr");
  r.grad_clip = t.get_float("grad_clip", r.grad_clip, 0.0, kFp32Max);
  r.weight_decay = t.get_float("weight_decay", r.weight_decay, 0.0, 10.0);
  r.beta1 = get_beta(t, "beta1", r.beta1);
  r.beta2 = get_beta(t, "beta2", r.beta2);
  r.eps = get_positive_fp32(t, "eps", r.eps, 1.0);
  r.log_every = t.get_int("log_every", r.log_every, 1);
  r.validation_every = t.get_int("validation_every", r.validation_every, 0);
  r.validation_batches = t.get_int("validation_batches", r.validation_batches, 1);
  r.max_skipped_steps = t.get_int("max_skipped_steps", r.max_skipped_steps, 0);
  r.reset_attention_mask = t.get_bool("reset_attention_mask", r.reset_attention_mask);
  r.reset_position_ids = t.get_bool("reset_position_ids", r.reset_position_ids);
  r.eod_mask_loss = t.get_bool("eod_mask_loss", r.eod_mask_loss);
  return r;
}

CheckpointSection read_checkpoint(const ConfigTable& t, const RunSection& run) {
  CheckpointSection c;
  c.every = t.get_int("every", c.every, 0);
  c.keep_last = t.get_int("keep_last", c.keep_last, 0);
  c.resume = t.get_int_or_string("resume", c.resume);
  if (c.resume != "auto" && c.resume != "none") {
    // A step number, given as a TOML integer or a decimal string.
    int64_t step = -1;
    const char* b = c.resume.data();
    const char* e = b + c.resume.size();
    auto res = std::from_chars(b, e, step);
    bool digits_only = !c.resume.empty() && std::isdigit(static_cast<unsigned char>(c.resume.front()));
    if (!digits_only || res.ec != std::errc() || res.ptr != e || step < 0) {
      bool numeric = res.ec == std::errc() && res.ptr == e;
      t.fail("resume", cat("checkpoint.resume = ", numeric ? c.resume : cat("\"", c.resume, "\""),
                           " is not accepted: use \"auto\" (newest complete checkpoint), \"none\" (start fresh)"
                           " or a step number >= 0"));
    }
  }
  c.dir = t.get_string("dir", cat(run.out_dir, "/checkpoints"));
  if (c.dir.empty()) t.fail("dir", "checkpoint.dir must not be empty (default: <run.out_dir>/checkpoints)");
  return c;
}

ProfileSection read_profile(const ConfigTable& t, const TrainSection& train) {
  ProfileSection p;
  if (t.has("steps")) {
    const std::vector<int64_t> w = t.get_int_list("steps", {}, 1);
    if (w.size() != 2 || w[0] > w[1])
      t.fail("steps", "profile.steps must be [start, stop] with 1 <= start <= stop: the window of steps to profile, "
                      "e.g. steps = [10, 12]");
    if (w[1] > train.steps)
      t.fail("steps", cat("profile.steps = [", w[0], ", ", w[1], "] ends after train.steps = ", train.steps,
                          "; profile steps the run reaches"));
    p.start = w[0];
    p.stop = w[1];
  }
  p.trace = t.get_bool("trace", p.trace);
  if (p.trace && !p.enabled())
    t.fail("trace", "profile.trace = true needs profile.steps = [start, stop]: the window of steps to trace");
  return p;
}

// Whether a plugin can run on the chosen device is the plugin's to say (it
// refuses at creation, before any work): nothing here matches plugin names.
void check_cross_fields(const Config& c, const ConfigTable& model, const ConfigTable& train) {
  const ModelSpec& s = c.model.spec;
  if (s.hidden % s.num_heads != 0)
    model.fail(model.has("num_heads") ? "num_heads" : "hidden",
               cat("model.hidden = ", s.hidden, " is not divisible by model.num_heads = ", s.num_heads,
                   ": the head dimension is hidden / num_heads"));
  if (s.num_heads % s.num_kv_heads != 0)
    model.fail("num_kv_heads", cat("model.num_heads = ", s.num_heads, " is not divisible by model.num_kv_heads = ",
                                   s.num_kv_heads, ": grouped-query attention shares each kv head among ",
                                   "num_heads / num_kv_heads query heads"));
  if (s.head_dim() % 2 != 0)
    model.fail("hidden", cat("the head dimension model.hidden / model.num_heads = ", s.hidden, " / ", s.num_heads,
                             " = ", s.head_dim(), " must be even: RoPE rotates pairs of dimensions"));
  if (c.train.seq_len > s.max_seq_len)
    train.fail("seq_len", cat("train.seq_len = ", c.train.seq_len, " exceeds model.max_seq_len = ", s.max_seq_len,
                              ": raise model.max_seq_len or shorten train.seq_len"));
  if (c.train.schedule != "constant" && c.train.min_lr > c.train.lr)
    train.fail("min_lr", cat("train.min_lr = ", format_number(c.train.min_lr), " exceeds train.lr = ", format_number(c.train.lr),
                             ": the ", c.train.schedule, " schedule decays from lr down to min_lr"));
  if (c.train.warmup_steps > c.train.steps)
    train.fail("warmup_steps", cat("train.warmup_steps = ", c.train.warmup_steps, " exceeds train.steps = ",
                                   c.train.steps));
}

// A float as a TOML value that reads back as a float ("10000.0", "1e-5").
std::string toml_float(double v) {
  std::string t = format_number(v);
  return t.find_first_of(".eni") == std::string::npos ? t + ".0" : t;
}

// model.init = "hf:DIR": the folder's config.json defines the architecture
// (the session builds the model from it). Its sizes replace the [model] keys
// here, so that the cross-field rules, the counts and the saved config.toml
// are those of the model that is trained; a key the user set to another
// value than the folder's is refused, naming both, instead of being ignored.
// Returns the [model] overrides that write the folder's sizes into the
// effective config.
std::vector<std::string> apply_hf_init(Config& c, const ConfigTable& t) {
  const std::string dir = c.model.init.substr(3);
  ModelSpec hf;
  try {
    hf = hf::read_hf_llama_config(dir);
  } catch (const Error& e) {
    const std::string msg = e.what();
    t.fail("init", msg.rfind("model.init = ", 0) == 0 ? msg : cat("model.init = \"", c.model.init, "\": ", msg));
  }
  const std::string json = (std::filesystem::path(dir) / "config.json").string();
  // train.seq_len beyond max_position_embeddings: RoPE is computed for the
  // positions the run uses, and the model's max_seq_len follows.
  const int64_t max_seq = std::max(hf.max_seq_len, c.train.seq_len);
  const std::string ffn = hf.moe() ? "moe" : "dense";
  std::vector<std::string> sets;
  auto differs = [&](const char* key, const std::string& user, const std::string& theirs, const char* hf_key) {
    t.fail(key, cat("model.", key, " = ", user, " differs from the model in ", json, " (", hf_key, " = ", theirs,
                    "): with model.init = \"", c.model.init, "\" the folder's config.json defines the model, so ",
                    "model.", key, " would be ignored. Remove model.", key, " or set it to ", theirs));
  };
  auto int_key = [&](const char* key, int64_t theirs, const char* hf_key, int64_t also = -1) {
    if (t.has(key)) {
      const int64_t v = t.get_int(key, 0);
      if (v != theirs && v != also) differs(key, std::to_string(v), std::to_string(theirs), hf_key);
    }
    sets.push_back(cat("model.", key, "=", also >= 0 ? also : theirs));
  };
  auto float_key = [&](const char* key, double theirs, const char* hf_key) {
    if (t.has(key)) {
      const double v = t.get_float(key, 0.0);
      if (v != theirs) differs(key, format_number(v), format_number(theirs), hf_key);
    }
    sets.push_back(cat("model.", key, "=", toml_float(theirs)));
  };
  if (t.has("ffn") && t.get_string("ffn", "") != ffn)
    differs("ffn", cat("\"", t.get_string("ffn", ""), "\""), cat("\"", ffn, "\""),
            hf.moe() ? "model_type \"mixtral\": a mixture of experts" : "model_type \"llama\": dense");
  sets.push_back(cat("model.ffn=\"", ffn, "\""));
  int_key("hidden", hf.hidden, "hidden_size");
  int_key("num_layers", hf.num_layers, "num_hidden_layers");
  int_key("num_heads", hf.num_heads, "num_attention_heads");
  int_key("num_kv_heads", hf.num_kv_heads, "num_key_value_heads");
  int_key("ffn_hidden", hf.ffn_hidden, "intermediate_size");
  int_key("vocab_size", hf.vocab_size, "vocab_size");
  int_key("max_seq_len", hf.max_seq_len, "max_position_embeddings", max_seq);
  float_key("rope_theta", hf.rope_theta, "rope_theta");
  float_key("norm_eps", hf.norm_eps, "rms_norm_eps");
  if (t.has("tied_embeddings") && t.get_bool("tied_embeddings", false) != hf.tied_embeddings)
    differs("tied_embeddings", hf.tied_embeddings ? "false" : "true", hf.tied_embeddings ? "true" : "false",
            "tie_word_embeddings");
  sets.push_back(cat("model.tied_embeddings=", hf.tied_embeddings ? "true" : "false"));
  if (hf.moe()) {
    int_key("num_experts", hf.num_experts, "num_local_experts");
    int_key("top_k", hf.top_k, "num_experts_per_tok");
    float_key("router_aux_loss_coef", hf.router_aux_loss_coef, "router_aux_loss_coef");
    float_key("router_jitter_noise", hf.router_jitter_noise, "router_jitter_noise");
  } else {
    for (const char* k : {"num_experts", "top_k", "router_aux_loss_coef", "router_jitter_noise"})
      if (t.has(k))
        t.fail(k, cat("model.", k, " applies to a mixture of experts, but ", json, " describes a dense Llama (model_type "
                      "\"llama\"), which model.init = \"", c.model.init, "\" trains: remove model.", k));
  }
  hf.max_seq_len = max_seq;
  c.model.spec = hf;
  c.model.ffn = ffn;
  return sets;
}

// A count for a message: "5.63e+22", "1.13e+15", "25824".
std::string approx(long double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3Lg", v);
  return buf;
}

// The counts a run computes in int64, bounded before anything uses them
// (kMaxParams, kMaxTokensPerStep): each key may be inside its range while the
// products leave 64 bits, which would print negative parameter counts and
// size the memory plan with wrapped numbers. `origin` says where the sizes
// come from when the [model] keys do not (an HF folder's config.json).
void check_counts(const Config& c, const ConfigTable& model, const ConfigTable& train, const std::string& origin) {
  const ModelSpec& s = c.model.spec;
  const long double total = s.total_params_ld();
  if (total > static_cast<long double>(kMaxParams)) {
    using LD = long double;
    const LD h = static_cast<LD>(s.hidden);
    const LD ffn = s.moe() ? static_cast<LD>(s.num_experts) * (h + 3 * h * static_cast<LD>(s.ffn_hidden))
                           : 3 * h * static_cast<LD>(s.ffn_hidden);
    const LD embed = static_cast<LD>(s.vocab_size) * h * (s.tied_embeddings ? 1 : 2);
    const LD layer = (total - embed - h) / static_cast<LD>(s.num_layers);
    const std::string ffn_text =
        s.moe() ? cat("model.num_experts = ", s.num_experts, " experts of 3 x model.hidden = ", s.hidden,
                      " x model.ffn_hidden = ", s.ffn_hidden)
                : cat("3 x model.hidden = ", s.hidden, " x model.ffn_hidden = ", s.ffn_hidden);
    model.fail(!origin.empty() ? "init" : model.has("num_layers") ? "num_layers" : "hidden",
               cat(origin, "the model would have ", approx(total), " parameters, more than Loom plans for (at most 2^50 = ",
                   approx(static_cast<LD>(kMaxParams)), ": no machine holds that, and its counts would leave 64 bits): ",
                   "model.num_layers = ", s.num_layers, " layers of ", approx(layer), " (the feed-forward block ",
                   approx(ffn), ": ", ffn_text, "; the attention ", approx(layer - ffn), "), and ", approx(embed),
                   " in the embeddings (model.vocab_size = ", s.vocab_size, " x model.hidden",
                   s.tied_embeddings ? "" : ", twice: untied", "). Lower these sizes"));
  }
  if (s.moe() && s.num_layers * s.num_experts > kMaxModelExperts)
    model.fail(!origin.empty() ? "init" : model.has("num_experts") ? "num_experts" : "num_layers",
               cat(origin, "model.num_layers = ", s.num_layers, " x model.num_experts = ", s.num_experts, " = ",
                   s.num_layers * s.num_experts, " experts, more than Loom plans for (at most 2^20 = ", kMaxModelExperts,
                   " in the whole model: each is described on the host before anything is planned, and past a million "
                   "that alone takes gigabytes and minutes). Lower model.num_layers or model.num_experts"));
  const long double tokens = static_cast<long double>(c.train.micro_batch) * static_cast<long double>(c.train.seq_len) *
                             static_cast<long double>(c.train.grad_accum);
  if (tokens > static_cast<long double>(kMaxTokensPerStep))
    train.fail(train.has("grad_accum") ? "grad_accum" : train.has("micro_batch") ? "micro_batch" : "seq_len",
               cat("train.micro_batch = ", c.train.micro_batch, " x train.seq_len = ", c.train.seq_len,
                   " x train.grad_accum = ", c.train.grad_accum, " = ", approx(tokens),
                   " tokens per rank and step, more than Loom plans for (at most 2^40 = ",
                   approx(static_cast<long double>(kMaxTokensPerStep)), "); lower them"));
}

// sharding.expert_parallel against the model; the world size is checked
// when the ranks exist (TrainState).
void check_expert_parallel(const Config& c) {
  const int64_t n = c.expert_parallel;
  if (n == 1) return;
  const ModelSpec& s = c.model.spec;
  if (!s.moe())
    c.sharding.table.fail("expert_parallel",
                          cat("sharding.expert_parallel = ", n, " splits the experts of a mixture of experts, but the "
                              "model is dense (model.ffn = \"", c.model.ffn, "\"): set model.ffn = \"moe\" or "
                              "sharding.expert_parallel = 1"));
  if (s.num_experts % n != 0)
    c.sharding.table.fail("expert_parallel",
                          cat("sharding.expert_parallel = ", n, " does not divide model.num_experts = ",
                              s.num_experts, ": every rank of an expert-parallel group holds num_experts / "
                              "expert_parallel experts; pick a divisor of ", s.num_experts));
}

}  // namespace

Config parse_config_string(std::string_view toml_text, const std::string& source_name,
                           const std::vector<std::string>& overrides) {
  ConfigTable root = parse_config_table(toml_text, source_name, overrides);
  Config c;
  c.source = source_name;
  c.document = root;
  c.effective_toml = root.to_toml();

  ConfigTable run = root.table("run");
  ConfigTable model = root.table("model");
  ConfigTable train = root.table("train");
  ConfigTable checkpoint = root.table("checkpoint");
  c.run = read_run(run);
  c.model = read_model(model);
  c.train = read_train(train);
  c.checkpoint = read_checkpoint(checkpoint, c.run);
  c.precision = read_plugin_section(root, "precision", "fp32");
  c.attention = read_plugin_section(root, "attention", "naive");
  c.sharding = read_plugin_section(root, "sharding", "none");
  c.expert_parallel = c.sharding.table.get_int("expert_parallel", 1, 1, 1 << 20);
  c.data = read_plugin_section(root, "data", "synthetic");
  ConfigTable profile = root.table("profile");
  c.profile = read_profile(profile, c.train);

  // Unknown names first: a misspelt key silently falls back to its default,
  // which could otherwise surface as a confusing cross-field error.
  root.finish();
  run.finish();
  model.finish();
  train.finish();
  checkpoint.finish();
  profile.finish();
  std::string origin;
  if (hf_init(c.model.init)) {
    const std::vector<std::string> sets = apply_hf_init(c, model);
    // The saved config (config.toml, checkpoint metadata) records the model trained.
    c.effective_toml = parse_config_table(c.effective_toml, source_name, sets).to_toml();
    origin = cat("model.init = \"", c.model.init, "\": its config.json describes a model that is too large: ");
  }
  check_cross_fields(c, model, train);
  check_counts(c, model, train, origin);
  check_expert_parallel(c);
  return c;
}

std::string Config::where(std::string_view dotted_key) const {
  const size_t dot = dotted_key.rfind('.');
  if (dot == std::string_view::npos) return document.where(dotted_key);
  ConfigTable t = document;
  for (size_t b = 0; b < dot;) {
    const size_t e = std::min(dotted_key.find('.', b), dot);
    t = t.table(dotted_key.substr(b, e - b));
    b = e + 1;
  }
  return t.where(dotted_key.substr(dot + 1));
}

Config load_config(const std::filesystem::path& file, const std::vector<std::string>& overrides) {
  std::error_code ec;
  if (!std::filesystem::exists(file, ec))
    throw Error(cat("config file '", file.string(), "' not found (working directory: ",
                    std::filesystem::current_path(ec).string(), ")"));
  if (std::filesystem::is_directory(file, ec))
    throw Error(cat("config file '", file.string(), "' is a directory, expected a TOML file"));
  // A regular file of bounded size: a FIFO would block the open and a device
  // such as /dev/zero would be read until memory runs out.
  const std::string text = read_bounded_file(file.string(), "config file", kMaxConfigBytes);
  return parse_config_string(text, file.string(), overrides);
}

ConfigArgs parse_config_args(const std::vector<std::string>& args, const std::vector<std::string>& value_flags) {
  ConfigArgs out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (std::find(value_flags.begin(), value_flags.end(), a) != value_flags.end()) {
      // "--steps 3": the 3 is the flag's, not the CONFIG; the command reads both.
      out.rest.push_back(a);
      if (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) out.rest.push_back(args[++i]);
    } else if (a == "--set") {
      if (i + 1 >= args.size()) throw Error("--set needs a value: --set section.key=value");
      out.overrides.push_back(args[++i]);
    } else if (a.rfind("--set=", 0) == 0) {
      out.overrides.push_back(a.substr(6));
    } else if (out.file.empty() && !a.empty() && a[0] != '-') {
      out.file = a;
    } else {
      out.rest.push_back(a);
    }
  }
  if (out.file.empty()) throw Error("missing CONFIG: expected CONFIG [--set section.key=value]...");
  return out;
}

}  // namespace loom
