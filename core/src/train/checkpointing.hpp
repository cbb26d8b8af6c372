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

// The checkpoint checkpoint.resume names (nullopt: a fresh start), checked as
// resume_checkpoint checks it before reading any tensor data: the marker,
// meta.json, the layout against a model of `spec`, every rank file's header
// and the tensors meta.json names. Throws the message resuming would — for a
// damaged checkpoint with the newest earlier one that validates and the way
// back to it. For `loom check`, and `loom train` before it creates anything.
// "auto" warns about an interrupted newer save it passes over; a folder named
// like a checkpoint but not as Loom names one is warned about and ignored.
// With `data` (this run's data source, opened) the checkpoint's data position
// (meta.json's "data_state") is given to it as resuming gives it, so a
// position the plugin refuses is refused here, naming meta.json and the
// field; the source is left at that position.
std::optional<std::string> check_resume_checkpoint(const Config& cfg, const ModelSpec& spec,
                                                   DataSource* data = nullptr);

// Loads the checkpoint checkpoint.resume asks for ("auto": the newest complete
// one, if any; a step number; "none") into `state` (parameters, master copy,
// AdamW moments), restores the data position and the recipe's state, and
// returns its step; nullopt when there is nothing to resume. Refuses a
// checkpoint of another model (architecture, or parameter names and shapes)
// or a damaged one before changing anything, naming what differs or what is
// damaged, and for damage the newest earlier checkpoint that validates.
std::optional<int64_t> resume_checkpoint(const Config& cfg, Runtime& rt, TrainState& state, const Model& model);

}  // namespace loom
