// What the C++ GPU benchmarks share: checked cuBLASLt calls, device buffers,
// random bf16 operands, and a main() that turns an error into one message.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <random>
#include <vector>

#include "hf/safetensors.hpp"
#include "loom/ops/cuda_check.hpp"
#include "loom/error.hpp"

#define LT_CHECK(call, ...)                                                                                     \
  do {                                                                                                          \
    const cublasStatus_t st_ = (call);                                                                          \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                           \
      throw ::loom::Error(::loom::cat(#call, " failed: ", cublasLtGetStatusName(st_), " [", __VA_ARGS__, "]")); \
  } while (0)

namespace loom::bench {

// Fills `elems` bf16 values ~ N(0, sd) (a 4 Mi-value host pattern, repeated).
// Random operands, not zeros: a GEMM's power draw, and so its clock on a
// power-capped GPU, depends on the data.
inline void fill_bf16(void* dst, size_t elems, float sd, uint32_t seed) {
  constexpr size_t kPattern = size_t{1} << 22;
  std::vector<uint16_t> pattern(kPattern);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, sd);
  for (auto& h : pattern) h = loom::hf::f32_to_bf16(nd(rng));
  for (size_t off = 0; off < elems; off += kPattern) {
    const size_t n = std::min(kPattern, elems - off);
    LOOM_CUDA_CHECK(cudaMemcpy(static_cast<uint16_t*>(dst) + off, pattern.data(), n * 2, cudaMemcpyHostToDevice),
                    "fill ", n, " bf16 values");
  }
}

// A device buffer of `n` bytes, freed with the object.
struct DevMem {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevMem(size_t n) : bytes(n) { LOOM_CUDA_CHECK(cudaMalloc(&p, n), "bench buffer of ", n, " bytes"); }
  ~DevMem() {
    if (p) cudaFree(p);
  }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
};

// main() of a benchmark: run(argc, argv), an error printed as "NAME: message" with exit code 1.
template <typename Run>
int main_of(const char* name, Run&& run, int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace loom::bench
