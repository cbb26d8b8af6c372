// Which kernel the CPU GEMMs (loom/cpu_gemm.hpp) run: both compute the same
// fixed chain of fused multiply-adds per output element, so they give the same
// bits; the choice is speed only. avx2_fma is taken where the processor has
// both; LOOM_CPU_GEMM=portable in the environment forces the portable one.
// Tests switch paths to prove the two agree.
#pragma once

namespace loom::cpu::detail {

enum class GemmPath { portable = 0, avx2_fma = 1 };

GemmPath gemm_path();
void set_gemm_path(GemmPath p);  // avx2_fma on a processor without AVX2 + FMA is refused

}  // namespace loom::cpu::detail
