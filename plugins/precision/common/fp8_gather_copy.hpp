// The FP8 gathers' small copies on CUDA as one kernel: a decode copies each
// decoder layer's norm gains (a few KB, one piece per gain and rank that
// holds part of it) out of the codec's state into the unit's parameters.
// cudaMemcpyAsync would queue each piece on a copy engine, behind whatever
// the copy engines are moving then: over one rank NCCL's collectives are
// themselves copies of hundreds of MB, and a 16 KB decode waited 0.4-1.0 ms
// behind them. A kernel runs on the SMs at its turn on the stream.
#pragma once
#include <cstdint>

namespace loom::fp8_gather {

struct CopyPiece {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t bytes = 0;
};

// dst = src for every piece (device memory, pieces not overlapping), queued on
// `stream` (a cudaStream_t) in launches of up to kCopyPiecesPerLaunch pieces;
// not waited for. A launch failure throws loom::Error naming the kernel and
// the pieces.
constexpr int kCopyPiecesPerLaunch = 32;
void copy_pieces(const CopyPiece* pieces, int n, void* stream);

}  // namespace loom::fp8_gather
