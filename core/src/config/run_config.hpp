// The typed run configuration: the core sections of a run's TOML file, read
// and validated through ConfigTable, plus the four plugin tables handed on to
// their plugins. docs/CONFIG.md documents every key.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/cpu/moe.hpp"  // kMaxExperts: the kernels' bound
#include "loom/config.hpp"
#include "loom/data.hpp"
#include "loom/model.hpp"

namespace loom {

// Limits of values the device computes with (docs/CONFIG.md). Token ids are
// int32. The optimizer and RMSNorm take their float keys as fp32: a value
// meant to be > 0 must stay a normal fp32 number (a smaller one becomes 0 or
// a subnormal the GPU flushes to 0), none may become inf, and a beta must stay
// below 1 after rounding (0.99999999 is 1.0f: the moment never moves again).
// kMaxVocabSize (token ids are int32) is the SDK's: loom/data.hpp.
// Ranges of the model's sizes (model.* keys, and an HF folder's config.json):
// any width, length or batch beyond kMaxDim is a typo; layers and heads at most
// 4096; experts at most 4096 (the CUDA backend's pinned expert counts hold that
// many), each token picking at most 64.
inline constexpr int64_t kMaxDim = int64_t{1} << 20;
inline constexpr int64_t kMaxLayersOrHeads = 4096;
inline constexpr int64_t kMaxTopK = 64;
// Products of those sizes can leave 64 bits long before any one key leaves
// its range, so the counts a run computes in int64 are bounded as well: the
// parameters (every expert included) at most 2^50 (~1.1e15: 18 PB of fp32
// weights, gradients and AdamW state; no machine holds it, and every byte
// count of the plan stays far inside 64 bits), and the tokens of one rank's
// step (micro_batch x seq_len x grad_accum) at most 2^40, so that times any
// number of ranks (at most 2^20) they stay an int64.
inline constexpr int64_t kMaxParams = int64_t{1} << 50;
// Experts of every layer together (num_layers x num_experts) at most 2^20:
// each is three tensors described on the host before any plan exists, and
// past a million experts that description alone takes gigabytes and minutes.
inline constexpr int64_t kMaxModelExperts = int64_t{1} << 20;
inline constexpr int64_t kMaxTokensPerStep = int64_t{1} << 40;
inline constexpr double kFp32MinNormal = 1.17549435e-38;  // FLT_MIN (every double from here rounds to >= it)
inline constexpr double kFp32Max = 3.40282347e+38;        // FLT_MAX (every double up to here rounds to <= it)
inline constexpr double kMaxBeta = 0.9999999;             // 0.99999988f; nearer 1 is 1.0f in fp32
// The float [model] keys' ranges, shared with what sets them otherwise (an
// HF folder's config.json, a checkpoint's model record): a value from there
// is held to the range of the key it becomes, so that the config.toml a run
// writes is one `loom check` takes. model.rope_theta is >= kMinRopeTheta
// (no upper bound), model.norm_eps in [kFp32MinNormal, 1].
inline constexpr double kMinRopeTheta = 1.0;
inline constexpr double kMaxNormEps = 1.0;
inline constexpr double kMaxRouterAuxLossCoef = 1e6;
inline constexpr double kMaxRouterJitterNoise = 0.999;

struct RunSection {
  std::string name = "run";
  std::string out_dir = "runs/run";  // default: runs/<name>
  std::string device = "cpu";        // cpu | cuda
  uint64_t seed = 1234;
  bool deterministic = false;
  std::string log_level = "info";    // trace | debug | info | warn | error
  int threads = 0;                   // CPU threads, 0 = all cores
  double collective_timeout = 300;   // seconds a collective may take before the run stops with an error
  std::vector<std::string> plugin_path;
  // A signal that asks for a checkpoint and a stop, like SIGTERM, SIGINT and
  // SIGHUP (Slurm's --signal=USR1@120 early warning): "USR1", "USR2" or "none".
  std::string stop_signal = "USR1";
  bool overwrite = false;            // a fresh run may replace a previous run's files in out_dir / checkpoint.dir
  bool tensorboard = false;          // also write TensorBoard event files (<out_dir>/tensorboard)
};

struct ModelSection {
  std::string init = "random";       // "random" | "hf:/path/to/dir"
  std::string layers = "native";     // an attention variant (blocks/block_table.cpp): native | fused
  std::string ffn = "dense";         // dense (model.layers' own) | a feed-forward variant: moe (spec.num_experts, top_k, router_* keys), ...
  ModelSpec spec;
  double init_std = 0.02;
  double embedding_init_std = 0.02;  // the token embedding's (untied); model.init_std unless set
  std::string recompute = "none";    // none | attention | full
  int64_t head_chunk = 0;            // fused layers: tokens per LM-head chunk, 0 = auto (256 MiB of logits)
};

struct TrainSection {
  int64_t steps = 100;
  int64_t micro_batch = 8;           // sequences per rank per micro-step
  int64_t seq_len = 256;
  int64_t grad_accum = 1;
  double lr = 3e-4;
  double min_lr = 3e-5;
  int64_t warmup_steps = 0;
  std::string schedule = "cosine";   // cosine | linear | constant
  double grad_clip = 1.0;            // 0 disables
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  int64_t log_every = 1;
  int64_t validation_every = 0;      // 0 = never
  int64_t validation_batches = 8;
  int64_t max_skipped_steps = 5;     // consecutive non-finite steps that stop the run; 0 = no limit
  // Packed documents (Megatron-LM's switches of the same names; docs/CONFIG.md):
  bool reset_attention_mask = false; // attention within each document only (causal, block-diagonal)
  bool reset_position_ids = false;   // RoPE positions restart at 0 at each document start
  bool eod_mask_loss = false;        // no loss on a document's last token (its target begins the next one)
  bool documents() const { return reset_attention_mask || reset_position_ids || eod_mask_loss; }
};

struct CheckpointSection {
  int64_t every = 0;                 // 0 = never
  int64_t keep_last = 3;             // 0 = keep all
  std::string resume = "auto";       // "auto" | "none" | decimal step
  std::string dir;                   // default <run.out_dir>/checkpoints
};

// [profile]: a window of steps for profilers (train/profiler.hpp).
struct ProfileSection {
  int64_t start = 0, stop = 0;       // steps [start, stop], 1-based and inclusive; 0 = no window
  bool trace = false;                // write a Chrome/Perfetto trace per rank for the window
  bool enabled() const { return start > 0; }
};

struct PluginSection {
  std::string plugin;
  std::string path;                  // optional explicit .so file
  // The whole section, with `plugin` and `path` marked used: handed to the
  // plugin, which reads its own keys and calls finish().
  ConfigTable table;
};

struct Config {
  std::string source;
  std::string effective_toml;        // the config after overrides, as TOML text
  RunSection run;
  ModelSection model;
  TrainSection train;
  CheckpointSection checkpoint;
  ProfileSection profile;
  PluginSection precision, attention, sharding, data;
  // sharding.expert_parallel: each MoE layer's experts split over groups of
  // this many consecutive ranks (1: every rank runs every expert). A core key
  // in the sharding section: it holds for every strategy.
  int64_t expert_parallel = 1;
  // The document the values were read from (overrides applied).
  ConfigTable document;

  // Where a core key ("run.plugin_path", "checkpoint.resume") was set:
  // "file:line:col", or "--set section.key=value" when an override set it;
  // the section's header or the file when it was not. For checks made after
  // the config is read, so that their messages start where the value came from.
  std::string where(std::string_view dotted_key) const;
};

// Reads and validates `file` with `overrides` ("section.key=value") applied.
// Throws loom::Error naming file:line (or the --set) for every problem in the
// core sections; plugin keys are checked later by the plugins themselves.
Config load_config(const std::filesystem::path& file, const std::vector<std::string>& overrides);
Config parse_config_string(std::string_view toml_text, const std::string& source_name,
                           const std::vector<std::string>& overrides);

// Every value of a TOML document by dotted key ("train.lr" -> "0.001"; arrays
// and inline tables as one value), for comparing the effective configs of
// several ranks key by key.
std::map<std::string, std::string> flatten_config_toml(std::string_view toml_text);

struct ConfigArgs {
  std::string file;
  std::vector<std::string> overrides;
  std::vector<std::string> rest;
};
// "CONFIG [--set k=v]... [other args]" -> file (the first argument that is
// neither an option nor the value of --set or of one of `value_flags`),
// overrides ("--set k=v" and "--set=k=v"), anything else in rest, in order
// (callers reject what they do not know). A flag of `value_flags` given as
// "--flag value" keeps its value beside it in rest. Throws when --set lacks
// its value or no CONFIG is given.
ConfigArgs parse_config_args(const std::vector<std::string>& args, const std::vector<std::string>& value_flags = {});

}  // namespace loom
