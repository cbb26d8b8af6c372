// Data plugin `synthetic`: generated tokens, no files (benchmarks, tests).
// Keys of its TOML table:
//   pattern = "random" | "ramp"   (default "random"; ramp = (start + position) % vocab, learnable)
//   vocab   = 1000                (ids < vocab; default the model's vocab_size)
//   document_length = 1000        (mean tokens of a document, log-normal; 0 = no documents, the default)
//   document_sigma  = 1.0         (sigma of the log of a document's length)
#pragma once
#include "data/synthetic/synthetic_source.hpp"
#include "loom/config.hpp"
#include "loom/error.hpp"
#include "loom/plugin.hpp"

namespace loom::plugins {

class SyntheticData final : public data::SyntheticSource {
 public:
  explicit SyntheticData(const PluginInit& init)
      : SyntheticSource(read_options(init.config)),
        vocab_at_(init.config.has("vocab") ? init.config.where("vocab") : std::string()) {}
  // Settings given directly (tests, programs embedding Loom); init.config is not read.
  SyntheticData(const PluginInit&, data::SyntheticOptions opt) : SyntheticSource(std::move(opt)) {}

  // data.vocab is checked against the model when the data is opened: its
  // refusal is located at the key, like the table's own checks.
  void open(const DataSpec& spec) override {
    try {
      SyntheticSource::open(spec);
    } catch (const Error& e) {
      if (vocab_at_.empty()) throw;
      throw Error(cat(vocab_at_, ": ", e.what()));
    }
  }

  static data::SyntheticOptions read_options(const ConfigTable& cfg) {
    data::SyntheticOptions o;
    o.pattern = cfg.get_choice("pattern", "random", {"random", "ramp"});
    o.vocab = cfg.get_int("vocab", 0, 0, INT32_MAX);
    o.document_length = cfg.get_float("document_length", 0.0, 0.0, 1e9);
    if (o.document_length > 0 && o.document_length < 1)
      cfg.fail("document_length", cat("data.document_length = ", o.document_length, " is below one token: give a "
                                       "mean length of at least 1, or 0 for no documents"));
    o.document_sigma = cfg.get_float("document_sigma", 1.0, 0.0, 4.0);
    cfg.finish();
    return o;
  }

 private:
  std::string vocab_at_;  // where data.vocab was set, "" when it was not
};

}  // namespace loom::plugins
