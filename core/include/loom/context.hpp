// What every plugin call sees about where and how it runs.
#pragma once
#include <cstdint>

#include "loom/dtype.hpp"

namespace loom {

struct ExecContext {
  Device device = Device::cpu;
  void* stream = nullptr;        // cudaStream_t on CUDA, null on CPU
  void* blas_handle = nullptr;   // cublasLtHandle_t on CUDA (owned by the core)
  bool deterministic = false;    // pick deterministic kernels
  int rank = 0;
  int world = 1;
};

}  // namespace loom
