// precision.gemm_algo (loom/gemm_algo.hpp): the key every cuBLASLt recipe reads.

#include "loom/gemm_algo.hpp"

namespace loom {

GemmAlgo read_gemm_algo(const ConfigTable& c, bool deterministic) {
  const std::string v = c.get_choice("gemm_algo", "auto", {"auto", "heuristic", "fastest"});
  if (v == "fastest" && deterministic)
    c.fail("gemm_algo",
           "gemm_algo = \"fastest\" picks each GEMM's cuBLASLt algorithm by timing it on this GPU, so two runs can "
           "pick differently and compute different low bits, but run.deterministic = true asks for the same bits "
           "every run: set gemm_algo = \"heuristic\" (or \"auto\", which is \"heuristic\" in deterministic runs), "
           "or run.deterministic = false");
  if (v == "heuristic" || (v == "auto" && deterministic)) return GemmAlgo::heuristic;
  return GemmAlgo::fastest;
}

const char* gemm_algo_name(GemmAlgo a) { return a == GemmAlgo::fastest ? "fastest" : "heuristic"; }

}  // namespace loom
