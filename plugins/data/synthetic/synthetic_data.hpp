// Data plugin `synthetic`: generated tokens, no files (benchmarks, tests).
// Keys of its TOML table:
//   pattern = "random" | "ramp"   (default "random"; ramp = (start + position) % vocab, learnable)
//   vocab   = 1000                (ids < vocab; default the model's vocab_size)
#pragma once
#include "data/synthetic_source.hpp"
#include "loom/config.hpp"
#include "loom/plugin.hpp"

namespace loom::plugins {

class SyntheticData final : public data::SyntheticSource {
 public:
  explicit SyntheticData(const PluginInit& init) : SyntheticSource(read_options(init.config)) {}
  // Settings given directly (tests, programs embedding Loom); init.config is not read.
  SyntheticData(const PluginInit&, data::SyntheticOptions opt) : SyntheticSource(std::move(opt)) {}

  static data::SyntheticOptions read_options(const ConfigTable& cfg) {
    data::SyntheticOptions o;
    o.pattern = cfg.get_choice("pattern", "random", {"random", "ramp"});
    o.vocab = cfg.get_int("vocab", 0, 0, INT32_MAX);
    cfg.finish();
    return o;
  }
};

}  // namespace loom::plugins
