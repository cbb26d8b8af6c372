// What the CUDA test suites share (test_cuda_fp8, test_cuda_gemm, the FP8 GPU
// suites through gpu_fp8_linear_pair.hpp): the checked CUDA call, a device
// buffer freed at scope end, and a download. CUDA builds only.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <vector>

// A CUDA runtime call that must succeed (a gtest assertion naming the call).
#ifndef CUDA_OK
#define CUDA_OK(call)                                                                                     \
  do {                                                                                                    \
    const cudaError_t e_ = (call);                                                                        \
    ASSERT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorName(e_) << " " << cudaGetErrorString(e_); \
  } while (0)
#endif

namespace loom_test {

// Device memory freed at scope end (p is null when cudaMalloc failed; a
// zero-byte buffer still gets an address).
struct DevBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t n) : bytes(n) {
    if (cudaMalloc(&p, n == 0 ? 256 : n) != cudaSuccess) p = nullptr;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// n elements from the device (empty when the copy failed).
template <typename T>
std::vector<T> download(const void* p, size_t n) {
  std::vector<T> h(n);
  if (cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost) != cudaSuccess) h.clear();
  return h;
}

}  // namespace loom_test
