// Data plugin `megatron`: Megatron-LM / PaddleNLP indexed datasets
// (PREFIX.bin + PREFIX.idx from preprocess_data.py). Keys of its TOML table:
//   prefix     = "data/owt2_text_document"  or a list of prefixes   (required)
//   weights    = [0.3, 0.7]          one per prefix (Megatron's blend); default: by size
//   split      = "969,30,1"          train, validation, test shares of each dataset's documents
//   val_prefix = "data/val_text_document"  or a list: validation from other datasets
//   shuffle    = true                shuffle documents and samples every epoch
#pragma once
#include <algorithm>

#include "data/megatron/megatron_source.hpp"
#include "loom/config.hpp"
#include "loom/error.hpp"
#include "loom/plugin.hpp"

namespace loom::plugins {

class MegatronData final : public data::MegatronSource {
 public:
  explicit MegatronData(const PluginInit& init) : MegatronSource(read_options(init.config)) {}
  MegatronData(const PluginInit&, data::MegatronOptions opt) : MegatronSource(std::move(opt)) {}

  static data::MegatronOptions read_options(const ConfigTable& cfg) {
    data::MegatronOptions o;
    if (!cfg.has("prefix"))
      cfg.fail("prefix", "data.prefix is required: the path prefix of a Megatron dataset (PREFIX.bin + PREFIX.idx), e.g. "
                         "prefix = \"data/owt2/owt2_text_document\", or a list of them");
    o.prefixes = strings(cfg, "prefix");
    if (cfg.has("weights")) {
      o.weights = cfg.get_float_list("weights", {}, 0.0, 1e300);
      if (o.weights.size() != o.prefixes.size())
        cfg.fail("weights", cat("data.weights has ", o.weights.size(), " entries but data.prefix names ", o.prefixes.size(),
                                " dataset(s); give one weight per prefix"));
      if (std::all_of(o.weights.begin(), o.weights.end(), [](double w) { return w == 0; }))
        cfg.fail("weights", "data.weights sum to 0; give at least one prefix a positive weight");
    }
    o.split = cfg.get_string("split", "");
    if (cfg.has("split") && o.split.empty()) cfg.fail("split", "data.split is empty; write e.g. \"969,30,1\"");
    if (cfg.has("val_prefix")) o.val_prefixes = strings(cfg, "val_prefix");
    o.shuffle = cfg.get_bool("shuffle", true);
    cfg.finish();
    // The split string is checked here so its error points at the key.
    if (!o.split.empty()) {
      try {
        data::megatron_split_indices(o.split, 1000, "data.split");
      } catch (const Error& e) {
        cfg.fail("split", e.what());
      }
    }
    return o;
  }

 private:
  static std::vector<std::string> strings(const ConfigTable& cfg, std::string_view key) {
    std::vector<std::string> v;
    try {
      v = cfg.get_string_list(key);
    } catch (const Error&) {
      v = {cfg.get_string(key, "")};
    }
    if (v.empty() || std::any_of(v.begin(), v.end(), [](const std::string& s) { return s.empty(); }))
      cfg.fail(key, cat("data.", key, " is empty: give the path prefix of a dataset (PREFIX.bin + PREFIX.idx)"));
    return v;
  }
};

}  // namespace loom::plugins
