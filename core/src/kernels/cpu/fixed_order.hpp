// Reductions whose summation order depends on the problem size alone.
//
// An OpenMP `reduction(+:...)` adds per-thread partials, so the rounding of a
// floating-point sum changes with the thread count. Here the index range is cut
// into chunks of fixed length; chunks are summed in parallel (each serially) and
// the chunk sums are then added serially in chunk order. The result is bitwise
// the same for 1 or N threads, which run.deterministic relies on.
#pragma once
#include <algorithm>
#include <cstdint>

namespace loom::cpu::detail {

// Sum of part(begin, end) over consecutive chunks [begin, end) of [0, n),
// each `chunk` long (the last one shorter). part returns the chunk's sum.
template <typename Part>
double fixed_order_sum(int64_t n, int64_t chunk, const Part& part) {
  // Chunk sums are staged on the stack in batches, so no heap allocation.
  constexpr int64_t kBatch = 256;
  double total = 0.0;
  const int64_t nchunks = (n + chunk - 1) / chunk;
  for (int64_t c0 = 0; c0 < nchunks; c0 += kBatch) {
    double partial[kBatch];
    const int64_t nc = std::min(kBatch, nchunks - c0);
#pragma omp parallel for schedule(static) if (nc > 1)
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t begin = (c0 + c) * chunk;
      partial[c] = part(begin, std::min(n, begin + chunk));
    }
    for (int64_t c = 0; c < nc; ++c) total += partial[c];
  }
  return total;
}

}  // namespace loom::cpu::detail
