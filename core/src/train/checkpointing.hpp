// The session's checkpoints: saving this rank's share of the training state,
// and resuming from whatever checkpoint.resume names — by parameter name,
// across world sizes, strategies, precision recipes and layer variants (see
// checkpoint/train_checkpoint.hpp for the format).
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>

#include "config/run_config.hpp"
#include "model/model.hpp"
#include "train/runtime.hpp"
#include "train/train_state.hpp"

namespace loom {

std::filesystem::path checkpoint_root(const Config& cfg);

// Every rank writes its share; rank 0 writes meta.json and COMPLETE after a
// barrier, then prunes to checkpoint.keep_last. Synchronises the device.
void save_checkpoint(const Config& cfg, Runtime& rt, TrainState& state, const Model& model, int64_t step);

// Loads the checkpoint checkpoint.resume asks for ("auto": the newest complete
// one, if any; a step number; "none") into `state` (parameters, master copy,
// AdamW moments), restores the data position and the recipe's state, and
// returns its step; nullopt when there is nothing to resume. Refuses a
// checkpoint of another model (architecture, or parameter names and shapes)
// before changing anything, naming what differs.
std::optional<int64_t> resume_checkpoint(const Config& cfg, Runtime& rt, TrainState& state, const Model& model);

}  // namespace loom
