// Which cuBLASLt algorithm a GEMM plan runs: precision.gemm_algo, read by
// every recipe whose GEMMs go through cuBLASLt (bf16, bf16_pure, fp8_delayed,
// fp8_current, fp8_block; the fp32 reference keeps the heuristic's answer).
//
//   "heuristic"  cuBLASLt's first answer for the problem: a function of the
//                problem, the library and the GPU, so two runs compute the
//                same bits;
//   "fastest"    the fastest of the heuristic's first kGemmAlgoCandidates
//                answers, timed on this GPU once per problem when its plan is
//                built (time_gemm_candidates); the pick can differ between
//                runs when two algorithms time alike, and so can the low bits;
//   "auto"       (the default) "fastest", or "heuristic" when
//                run.deterministic = true.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "loom/config.hpp"

namespace loom {

enum class GemmAlgo { heuristic, fastest };

// How many of the heuristic's answers GemmAlgo::fastest times.
inline constexpr int kGemmAlgoCandidates = 8;

// Reads `gemm_algo` from a recipe's table (before its finish()) and resolves
// "auto" with run.deterministic; "fastest" with run.deterministic = true is
// refused, naming the key and what to set.
GemmAlgo read_gemm_algo(const ConfigTable& c, bool deterministic);
const char* gemm_algo_name(GemmAlgo a);

// GemmAlgo::fastest, in CUDA builds only. Times candidates 0..n-1 of one GEMM
// problem on `stream` (a cudaStream_t): run(i, scratch) enqueues candidate i
// once, writing D (and C, where the problem has a C of its own) into
// `scratch` (scratch_bytes of zeroed device memory, stream-ordered, freed
// before returning) so that the call's own outputs and an accumulated dW are
// untouched; it returns false when candidate i cannot run (never picked).
// Each candidate runs twice untimed, then five times between two events.
// Returns the fastest's index: 0 (the heuristic's answer) unless another is at
// least 2% faster, and 0 without timing when n <= 1 or the scratch cannot be
// allocated. `where` names the problem in error messages.
int time_gemm_candidates(void* stream, int n, size_t scratch_bytes, const std::function<bool(int, void*)>& run,
                         const std::string& where);

// Problems timed by time_gemm_candidates in this process, and how many of
// them picked another answer than the heuristic's first (for tests and logs).
struct GemmTimingCounts {
  int64_t timed = 0, switched = 0;
};
GemmTimingCounts gemm_timing_counts();

}  // namespace loom
