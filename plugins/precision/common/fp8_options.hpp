// What every FP8 recipe (fp8_delayed, fp8_current: fp8_recipe.hpp; fp8_block:
// fp8_block.hpp) reads and checks alike, on the CPU and on CUDA: the
// weight_cache key, the master / stochastic_rounding pair, the amax-history
// keys only fp8_delayed takes, and the shape of a registered linear.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "loom/config.hpp"
#include "loom/error.hpp"
#include "loom/gemm_algo.hpp"
#include "loom/plugin.hpp"
#include "loom/precision.hpp"

namespace loom::fp8_options {

// precision.weight_cache: where the FP8 copies of the weights live. "step":
// cast once per optimizer step, kept for every micro-batch; "layer": cast
// into one shared scratch before each fprop (W) and dgrad (Wᵀ); "auto":
// "layer" when train.grad_accum = 1 or the strategy shards the parameters,
// else "step".
enum class WeightCache { step, layer, automatic };

inline const char* weight_cache_name(WeightCache c) {
  switch (c) {
    case WeightCache::step: return "step";
    case WeightCache::layer: return "layer";
    case WeightCache::automatic: return "auto";
  }
  return "?";
}

// "auto" resolved with train.grad_accum and the strategy's layout
// (PrecisionSetup::params_sharded): true for "layer". With one micro-batch a
// step each weight is cast once either way; with the parameters sharded
// (zero3, hybrid_shard) a cache for the step would hold the cast weights of
// the whole, unsharded model on every rank (W and its transpose: 2 bytes a
// parameter, what zero3 is chosen to avoid), and every micro-batch gathers
// the weights again anyway, so "layer" casts them per GEMM as
// TransformerEngine does under FSDP.
inline bool weight_cache_per_layer(WeightCache c, int grad_accum, bool params_sharded = false) {
  return c == WeightCache::layer || (c == WeightCache::automatic && (grad_accum <= 1 || params_sharded));
}

// "weight_cache auto (layer: grad_accum 1)" for a setup log line.
inline std::string weight_cache_summary(WeightCache c, bool per_layer, bool params_sharded = false) {
  return cat("weight_cache ", weight_cache_name(c),
             c != WeightCache::automatic ? ""
             : !per_layer                ? " (step: grad_accum > 1)"
             : params_sharded            ? " (layer: parameters sharded)"
                                         : " (layer: grad_accum 1)");
}

inline WeightCache read_weight_cache(const ConfigTable& c) {
  const std::string v = c.get_choice("weight_cache", "auto", {"auto", "step", "layer"});
  return v == "step" ? WeightCache::step : v == "layer" ? WeightCache::layer : WeightCache::automatic;
}

// master = "fp32" | "bf16", optimizer_state = "fp32" | "bf16" and
// stochastic_rounding, read before the table's finish() (unknown keys first)
// and checked after it by check().
struct Master {
  bool bf16 = false;
  bool state_bf16 = false;  // AdamW's m and v in bf16 (default: as the master)
  bool stochastic_rounding = false;

  static Master read(const ConfigTable& c) {
    Master m;
    m.bf16 = c.get_choice("master", "fp32", {"fp32", "bf16"}) == "bf16";
    m.state_bf16 = c.get_choice("optimizer_state", m.bf16 ? "bf16" : "fp32", {"fp32", "bf16"}) == "bf16";
    m.stochastic_rounding = c.get_bool("stochastic_rounding", false);
    return m;
  }
  // Stochastic rounding needs bf16 master storage, and bf16 master storage
  // or AdamW state needs the CUDA backend (the CPU stores and updates fp32).
  void check(const ConfigTable& c, Device device) const {
    if (stochastic_rounding && !bf16)
      c.fail("stochastic_rounding",
             "stochastic_rounding = true rounds updates into bf16 parameters that have no fp32 master copy; with "
             "master = \"fp32\" the master copy keeps every update exactly. Set master = \"bf16\" or remove "
             "stochastic_rounding");
    if (bf16 && device != Device::cuda)
      c.fail("master", "master = \"bf16\" keeps the parameters in bf16 without an fp32 copy, but the CPU backend "
                       "stores and updates parameters in fp32 only: on the CPU use master = \"fp32\" (the default)");
    if (state_bf16 && device != Device::cuda)
      c.fail("optimizer_state", "optimizer_state = \"bf16\" keeps AdamW's m and v in bf16, but the CPU backend "
                                "keeps them in fp32 only: on the CPU use optimizer_state = \"fp32\" (the default)");
  }
};

// The options every FP8 recipe takes alike, read after the family's own
// keys by read_common, which then finishes the table (unknown keys are
// refused first) and checks the master pair against the device.
struct Common {
  WeightCache weight_cache = WeightCache::automatic;
  bool fp8_head = false;                     // the LM head in FP8 too
  bool master_bf16 = false;                  // master = "bf16": bf16 parameters and AdamW state, no fp32 copy
  bool state_bf16 = false;                   // optimizer_state = "bf16": AdamW's m and v in bf16
  bool stochastic_rounding = false;
  GemmAlgo gemm_algo = GemmAlgo::heuristic;  // precision.gemm_algo, resolved (loom/gemm_algo.hpp)
};

inline Common read_common(const ConfigTable& c, const PluginInit& init) {
  const Master master = Master::read(c);
  Common o;
  o.fp8_head = c.get_bool("fp8_head", false);
  o.weight_cache = read_weight_cache(c);
  o.gemm_algo = read_gemm_algo(c, init.deterministic);  // CUDA's GEMMs; the CPU emulation has one way
  c.finish();
  master.check(c, init.device);
  o.master_bf16 = master.bf16;
  o.state_bf16 = master.state_bf16;
  o.stochastic_rounding = master.stochastic_rounding;
  return o;
}

// The keys of delayed scaling's amax history, refused by a recipe that takes
// every scale at the cast; `what` says from what (e.g. "its tensor's own amax").
inline void refuse_history_keys(const ConfigTable& c, const std::string& plugin, const std::string& what) {
  for (const char* key : {"amax_history_len", "amax_compute_algo", "margin"})
    if (c.has(key))
      c.fail(key, cat("precision.plugin = \"", plugin, "\" takes every scale from ", what,
                      " just before the cast and keeps no amax history, so '", key,
                      "' has no meaning here: remove it, or use precision.plugin = \"fp8_delayed\", whose key it is"));
}

// precision.fused_casts belongs to delayed scaling alone: a block's kernel can
// write a tensor in FP8 only with a scale known before the tensor exists.
// `why` says where the refusing recipe's scale comes from instead.
inline void refuse_fused_casts(const ConfigTable& c, const std::string& plugin, const std::string& why) {
  if (c.has("fused_casts"))
    c.fail("fused_casts", cat("precision.plugin = \"", plugin, "\" ", why,
                              ", so no kernel can write a tensor in FP8 before it exists and 'fused_casts' has no "
                              "meaning here: remove it, or use precision.plugin = \"fp8_delayed\", whose key it is"));
}

// precision.producer_amax belongs to current per-tensor scaling alone: the
// fused layers' kernels measure a tensor's amax as they write it for a recipe
// that would otherwise read the tensor once just to measure it. `why` says
// what the refusing recipe does instead.
inline void refuse_producer_amax(const ConfigTable& c, const std::string& plugin, const std::string& why) {
  if (c.has("producer_amax"))
    c.fail("producer_amax", cat("precision.plugin = \"", plugin, "\" ", why,
                                ", so 'producer_amax' has no meaning here: remove it, or use precision.plugin = "
                                "\"fp8_current\", whose key it is"));
}

// A count a recipe restores from a checkpoint's f64 tensor: a whole number
// in [0, max] (2^53 at most, where f64 stops being exact), checked before it
// is converted; else loom::Error naming the tensor, the element, what it
// counts and the value (the core adds the checkpoint and the way back).
inline int64_t restored_count(double v, const std::string& tensor, int index, const char* what,
                              double max = 9007199254740992.0) {
  if (!(std::isfinite(v) && v == std::floor(v) && v >= 0.0 && v <= max)) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    throw Error(cat("precision state '", tensor, "' [", index, "] (", what, ") is ", buf,
                    ": a count is a whole number in [0, ", max == 9007199254740992.0 ? std::string("2^53") : cat(static_cast<int64_t>(max)), "]"));
  }
  return static_cast<int64_t>(v);
}

// A linear an FP8 recipe can plan its cast copies for (max_rows > 0).
inline void check_linear_shape(const std::string& plugin, const LinearDesc& d) {
  LOOM_CHECK(d.in > 0 && d.out > 0 && d.max_rows > 0, "precision ", plugin, ": linear '", d.name,
             "' has invalid shape in=", d.in, " out=", d.out, " max_rows=", d.max_rows,
             " (an FP8 recipe plans its cast copies from max_rows, which must be positive)");
}

// The refusal of a linear whose dims a recipe's FP8 GEMMs cannot take
// (multiples of 16 per tensor, of 128 per block): where its rows come from,
// and which keys change them (model.head_chunk sets the LM head's rows).
inline std::string rows_origin(const LinearDesc& d) {
  return cat(" rows (tokens per micro-batch", d.role == LinearRole::lm_head ? " or per LM-head chunk" : "", ")");
}
// rows_checked: the recipe requires the rows too (not for fp8_block's variable-row linears).
inline std::string dims_to_change(const LinearDesc& d, int64_t multiple, bool rows_checked) {
  return cat("Change the model dims",
             !rows_checked                    ? ""
             : d.role == LinearRole::lm_head ? ", the micro-batch (train.micro_batch x train.seq_len) or model.head_chunk (fused layers)"
                                             : " or the micro-batch (train.micro_batch x train.seq_len)",
             " to multiples of ", multiple);
}

// For a recipe's set-up log line: how many of `linears` run in FP8
// (Linear::fp8) and the names of the others ("" when none), comma-separated.
struct LinearSplit {
  int fp8 = 0;
  std::string full;
};
template <class Linear>
LinearSplit split_linears(const std::vector<Linear>& linears) {
  LinearSplit s;
  for (const Linear& l : linears) {
    if (l.fp8) ++s.fp8;
    else s.full += cat(s.full.empty() ? "" : ", ", l.desc.name);
  }
  return s;
}

}  // namespace loom::fp8_options
