// A stand-in for the communicator of a run that is only planned: `loom check
// CONFIG --world N` lays out and prints the run of N ranks as its rank 0
// would, without starting the other ranks. It answers rank 0 and size N;
// every collective refuses (nothing is exchanged while planning). split()
// returns another stand-in: the sharding plugins lay out their units from the
// world and node sizes they are created with, not from the groups' sizes.
#pragma once
#include <memory>

#include "loom/comm.hpp"

namespace loom {

std::unique_ptr<Communicator> make_plan_communicator(int world);

}  // namespace loom
