// A stand-in for the communicator of a run that is only planned: `loom check
// CONFIG --world N` lays out and prints the run of N ranks as its rank 0
// would, without starting the other ranks. It answers rank 0 and size N;
// every collective refuses (nothing is exchanged while planning). split()
// returns another stand-in of the same size: the sharding plugins lay out
// their units from the world and node sizes they are created with, not from
// the groups' sizes; a group whose size the core knows (the expert-parallel
// group) is made with make_plan_communicator(size) instead. device_tensors:
// what the planned run's communicator would move (NCCL on a GPU: device
// buffers), so that what checks it plans as the run would.
#pragma once
#include <memory>

#include "loom/comm.hpp"

namespace loom {

std::unique_ptr<Communicator> make_plan_communicator(int world, bool device_tensors = false);

}  // namespace loom
