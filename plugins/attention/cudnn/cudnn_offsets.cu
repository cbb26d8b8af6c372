// See cudnn_offsets.hpp.
#include <cuda_runtime.h>

#include <algorithm>

#include "attention/cudnn/cudnn_offsets.hpp"
#include "loom/error.hpp"

namespace loom::cudnn_offsets {
namespace {

struct Strides {
  int64_t s[5];
};

__global__ void ragged_offsets_kernel(const int32_t* cu, int64_t n, Strides st, int64_t* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = cu[i];
#pragma unroll
    for (int a = 0; a < 5; ++a) out[a * n + i] = t * st.s[a];
  }
}

}  // namespace

void ragged_offsets(const int32_t* cu, int64_t n, const int64_t* strides, int64_t* out, void* stream) {
  Strides st{};
  for (int a = 0; a < 5; ++a) st.s[a] = strides[a];
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 4096);
  ragged_offsets_kernel<<<static_cast<unsigned>(std::max<int64_t>(blocks, 1)), threads, 0,
                          static_cast<cudaStream_t>(stream)>>>(cu, n, st, out);
  const cudaError_t e = cudaGetLastError();
  LOOM_CHECK(e == cudaSuccess, "cudnn attention: launching ragged_offsets_kernel for ", n, " sequence starts failed: ",
             cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}

}  // namespace loom::cudnn_offsets
