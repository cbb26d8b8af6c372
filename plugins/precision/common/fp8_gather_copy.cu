// See fp8_gather_copy.hpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "loom/error.hpp"
#include "precision/common/fp8_gather_copy.hpp"

namespace loom::fp8_gather {
namespace {

struct Pieces {
  CopyPiece p[kCopyPiecesPerLaunch];
};

// Block row y copies piece y; the blocks of a row stride over its bytes, 16
// at a time where source, destination and length allow it (the gains are
// bf16 or fp32 rows; the codec keeps its copies of them 16-byte aligned), a
// byte at a time otherwise.
__global__ void copy_pieces_kernel(Pieces ps) {
  const CopyPiece& c = ps.p[blockIdx.y];
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const auto s = reinterpret_cast<uintptr_t>(c.src), d = reinterpret_cast<uintptr_t>(c.dst);
  if (((s | d | static_cast<uintptr_t>(c.bytes)) & 15) == 0) {
    const auto* src = static_cast<const uint4*>(c.src);
    auto* dst = static_cast<uint4*>(c.dst);
    for (int64_t i = start; i < c.bytes / 16; i += step) dst[i] = src[i];
  } else {
    const auto* src = static_cast<const unsigned char*>(c.src);
    auto* dst = static_cast<unsigned char*>(c.dst);
    for (int64_t i = start; i < c.bytes; i += step) dst[i] = src[i];
  }
}

}  // namespace

void copy_pieces(const CopyPiece* pieces, int n, void* stream) {
  for (int at = 0; at < n; at += kCopyPiecesPerLaunch) {
    const int k = std::min(kCopyPiecesPerLaunch, n - at);
    Pieces ps{};
    int64_t most = 0;
    for (int i = 0; i < k; ++i) {
      ps.p[i] = pieces[at + i];
      most = std::max(most, pieces[at + i].bytes);
    }
    if (most == 0) continue;
    const int threads = 256;
    // Enough blocks for the largest piece at 16 bytes a thread, at most 64 a piece.
    const int64_t blocks = std::clamp<int64_t>((most / 16 + threads - 1) / threads, 1, 64);
    copy_pieces_kernel<<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(k)), threads, 0,
                         static_cast<cudaStream_t>(stream)>>>(ps);
    const cudaError_t e = cudaGetLastError();
    LOOM_CHECK(e == cudaSuccess, "FP8 gathers: launching copy_pieces_kernel for ", k, " pieces (the largest ", most,
               " bytes) failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e));
  }
}

}  // namespace loom::fp8_gather
