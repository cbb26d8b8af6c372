// The backend of a run that is planned for a GPU this machine does not have
// (`loom check CONFIG --gpu h100` / `--device-memory 80GiB`): it says
// run.device's device, the planned card's name and memory, and refuses every
// operation (nothing is allocated or computed while planning). The plugins are
// created with PluginInit::planning, so that none of them touches a device
// either (loom/plugin.hpp).
#pragma once
#include <memory>

#include "loom/ops/backend.hpp"
#include "train/memory_budget.hpp"

namespace loom {

std::unique_ptr<Backend> make_planned_backend(Device device, const PlannedDevice& gpu, bool deterministic);

}  // namespace loom
