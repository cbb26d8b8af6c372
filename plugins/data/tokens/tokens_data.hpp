// Data plugin `tokens`: flat token shards written by `loom prepare` (or any
// tool writing the format of loom/token_shard.hpp). Keys of its TOML table:
//   train   = "data/x/train_*.bin"  or ["a/*.bin", "b/*.bin"]   (required)
//   val     = "data/x/val.bin"      (path, glob or list; optional)
//   shuffle = true                  (permute windows every epoch)
//   bos, eos = 1, 2                 (document markers of shards that record none; both or neither)
#pragma once
#include "data/tokens/tokens_source.hpp"
#include "loom/config.hpp"
#include "loom/error.hpp"
#include "loom/plugin.hpp"

namespace loom::plugins {

class TokensData final : public data::TokensSource {
 public:
  explicit TokensData(const PluginInit& init) : TokensSource(read_options(init.config)) {}
  // Settings given directly (tests, programs embedding Loom); init.config is not read.
  TokensData(const PluginInit&, data::TokensOptions opt) : TokensSource(std::move(opt)) {}

  static data::TokensOptions read_options(const ConfigTable& cfg) {
    data::TokensOptions o;
    if (!cfg.has("train"))
      cfg.fail("train", "data.train is required: a glob pattern or a list of them naming token shards, e.g. "
                        "train = \"data/fortunes/train_*.bin\" (write them with loom prepare text)");
    o.train = patterns(cfg, "train");
    if (cfg.has("val")) o.val = patterns(cfg, "val");
    o.shuffle = cfg.get_bool("shuffle", true);
    if (cfg.has("bos") != cfg.has("eos"))
      cfg.fail(cfg.has("bos") ? "bos" : "eos", "data.bos and data.eos come together: the ids that begin and end "
                                               "each document of shards that record no markers");
    if (cfg.has("bos"))
      o.markers = DocumentMarkers{static_cast<uint32_t>(cfg.get_int("bos", 0, 0, kMaxVocabSize - 1)),
                                  static_cast<uint32_t>(cfg.get_int("eos", 0, 0, kMaxVocabSize - 1))};
    cfg.finish();
    // Patterns that match nothing, or name folders that cannot be listed, are
    // told here, located at their key (the shards are opened later, with the model).
    for (const auto& [key, list] : {std::pair<const char*, const std::vector<std::string>*>{"train", &o.train},
                                    {"val", &o.val}}) {
      if (list->empty()) continue;
      try {
        (void)data::expand_patterns(*list, key);
      } catch (const Error& e) {
        cfg.fail(key, e.what());
      }
    }
    return o;
  }

 private:
  // A key that holds one pattern or a list of them.
  static std::vector<std::string> patterns(const ConfigTable& cfg, std::string_view key) {
    std::vector<std::string> v;
    try {
      v = cfg.get_string_list(key);
    } catch (const Error&) {
      v = {cfg.get_string(key, "")};  // a single string; its own type error if it is neither
    }
    if (v.empty() || (v.size() == 1 && v[0].empty()))
      cfg.fail(key, cat("data.", key, " is empty: give a path or glob pattern of token shards"));
    return v;
  }
};

}  // namespace loom::plugins
