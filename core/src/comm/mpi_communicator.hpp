// The MPI communicator: collectives over host tensors between processes started
// by mpirun / srun. Every collective is issued in its non-blocking form and
// polled, so a rank that died or skipped a collective turns into a loom::Error
// on the others after `timeout_s` instead of a hang.
//
// Types: fp32, fp64 and int32 reduce natively; bf16 and fp16 reduce through an
// fp32 staging buffer (sum in fp32, rounded once to nearest-even at the end);
// all_gather and broadcast copy raw bytes, so they take every dtype. avg of
// int32 is refused (integer division would silently truncate).
//
// Byte counters use the ring-algorithm volume per rank, in bytes on the wire
// (fp32 for staged bf16/fp16 reductions), so that they compare with the ZeRO
// paper's formulas: with p ranks, all_reduce of B bytes counts 2(p-1)/p*B,
// reduce_scatter and all_gather (p-1)/p of the full (size*n) buffer, broadcast
// (p-1)/p*B (integer bytes, rounded down).
// all_to_all (MPI_Ialltoallv of raw bytes, any dtype) counts the bytes this
// rank sends to the other ranks: each byte crosses once, there is no ring.
//
// After a timeout or an MPI error the communicator refuses further collectives
// (the ranks no longer agree on the sequence) and the caller is expected to
// report the error and call abort_all().
#pragma once
#include <memory>

#include "loom/comm.hpp"

namespace loom {

// A communicator over a duplicate of MPI_COMM_WORLD; initialises MPI if needed.
// timeout_s > 0 bounds every collective. Throws without MPI support.
std::unique_ptr<Communicator> make_mpi_communicator(double timeout_s);

}  // namespace loom
