// Ranks that disagree, found at start-up (docs/RELIABILITY.md "Ranks"): every
// rank must run the same effective config with the same plugins, or the
// ranks fail inside a collective (MPI_ERR_TRUNCATE for another model shape),
// drift apart silently (another learning rate), or stall until the
// collective timeout. Before any collective whose size depends on the config,
// the ranks exchange a 64-bit digest of their effective config, the
// architecture in use (an HF folder's config.json may differ between nodes),
// and the plugins loaded (kind, name, version, build id) with loom's own
// version; when the digests differ they exchange the texts and every rank
// stops with one message naming each key that differs and its values.
#pragma once
#include <map>
#include <string>

#include "config/run_config.hpp"
#include "loom/model.hpp"
#include "train/runtime.hpp"

namespace loom {

// What the ranks compare, by key ("train.lr", "plugin.data", "model (in use)").
// Keys that may differ between ranks without changing the computation are
// left out: run.plugin_path and the plugin tables' `path` (where a plugin is
// found; the plugin itself is compared) and run.log_level.
std::map<std::string, std::string> agreement_keys(const Config& cfg, const ModelSpec& spec, const Runtime& rt);

// Throws loom::Error on every rank when the ranks' agreement_keys differ.
// Nothing to do alone.
void check_ranks_agree(const Config& cfg, const ModelSpec& spec, const Runtime& rt);

}  // namespace loom
