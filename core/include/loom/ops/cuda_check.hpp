// Error checks for CUDA runtime calls and kernel launches, usable from .cpp
// and .cu files alike (no fmt). Every runtime call and every launch in the
// CUDA backend goes through one of these, so a failure names the call, the
// values it was given and the place, instead of surfacing later as an
// unrelated "unspecified launch failure".
#pragma once
#include <cuda_runtime_api.h>

#include "loom/error.hpp"

// LOOM_CUDA_CHECK(cudaMalloc(&p, n), "arena of ", n, " bytes"): the context parts
// are required, so every message says what the call was doing.
#define LOOM_CUDA_CHECK(call, ...)                                                                        \
  do {                                                                                                    \
    const cudaError_t loom_err_ = (call);                                                                 \
    if (loom_err_ != cudaSuccess)                                                                         \
      throw ::loom::Error(::loom::cat("CUDA call " #call " failed: ", cudaGetErrorName(loom_err_), " (",   \
                                      cudaGetErrorString(loom_err_), ") [", __VA_ARGS__, "] at ", \
                                      __FILE__, ":", __LINE__));                                          \
  } while (0)

// After every <<<...>>>: a bad configuration (grid, block, shared memory)
// is reported by cudaGetLastError right away; faults inside the kernel show
// up at the next synchronising call, which is checked too.
#define LOOM_CUDA_LAUNCH_CHECK(kernel_name, ...)                                                          \
  do {                                                                                                    \
    const cudaError_t loom_err_ = cudaGetLastError();                                                     \
    if (loom_err_ != cudaSuccess)                                                                         \
      throw ::loom::Error(::loom::cat("CUDA launch of ", kernel_name, " failed: ", cudaGetErrorName(loom_err_), \
                                      " (", cudaGetErrorString(loom_err_), ") [", __VA_ARGS__, "] at ",    \
                                      __FILE__, ":", __LINE__));                                          \
  } while (0)
