// time_gemm_candidates (loom/gemm_algo.hpp): picks the fastest of a GEMM
// problem's cuBLASLt algorithms by timing each on the problem's own operands.
#include <cuda_runtime.h>

#include <atomic>

#include "loom/error.hpp"
#include "loom/gemm_algo.hpp"

namespace loom {
namespace {
std::atomic<int64_t> g_timed{0}, g_switched{0};
}  // namespace

GemmTimingCounts gemm_timing_counts() { return {g_timed.load(), g_switched.load()}; }

int time_gemm_candidates(void* stream_p, int n, size_t scratch_bytes, const std::function<bool(int, void*)>& run,
                         const std::string& where) {
  auto stream = static_cast<cudaStream_t>(stream_p);
  ++g_timed;
  if (n <= 1) return 0;
  // Stream-ordered, so the memory is back in the pool once the plans are
  // built; where even this much is not free, the heuristic's answer stays.
  void* scratch = nullptr;
  if (cudaMallocAsync(&scratch, scratch_bytes, stream) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky
    return 0;
  }
  auto check = [&](cudaError_t e, const char* call) {
    LOOM_CHECK(e == cudaSuccess, where, ": timing cuBLASLt's algorithms: ", call, " failed: ", cudaGetErrorName(e),
               " (", cudaGetErrorString(e), ")");
  };
  check(cudaMemsetAsync(scratch, 0, scratch_bytes, stream), "cudaMemsetAsync(scratch)");
  cudaEvent_t t0 = nullptr, t1 = nullptr;
  check(cudaEventCreate(&t0), "cudaEventCreate");
  check(cudaEventCreate(&t1), "cudaEventCreate");
  constexpr int kWarm = 2, kTimed = 5;
  int best = -1;
  float first_ms = -1.0f, best_ms = 0.0f;
  for (int i = 0; i < n; ++i) {
    bool ok = true;
    for (int r = 0; r < kWarm && ok; ++r) ok = run(i, scratch);
    if (!ok) continue;  // an answer that does not run here is never picked
    check(cudaEventRecord(t0, stream), "cudaEventRecord");
    for (int r = 0; r < kTimed && ok; ++r) ok = run(i, scratch);
    check(cudaEventRecord(t1, stream), "cudaEventRecord");
    check(cudaEventSynchronize(t1), "cudaEventSynchronize");
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, t0, t1), "cudaEventElapsedTime");
    if (!ok) continue;
    if (i == 0) first_ms = ms;
    if (best < 0 || ms < best_ms) {
      best = i;
      best_ms = ms;
    }
  }
  check(cudaEventDestroy(t0), "cudaEventDestroy");
  check(cudaEventDestroy(t1), "cudaEventDestroy");
  check(cudaFreeAsync(scratch, stream), "cudaFreeAsync(scratch)");
  // Another answer replaces the first only when 2% faster: within timing
  // noise the pick stays the heuristic's.
  if (best < 0 || (first_ms >= 0.0f && best_ms >= 0.98f * first_ms)) best = 0;
  if (best != 0) ++g_switched;
  return best;
}

}  // namespace loom
