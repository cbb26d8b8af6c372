// See cudnn_ragged.hpp.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "attention/cudnn/cudnn_ragged.hpp"
#include "loom/error.hpp"

namespace loom::cudnn_ragged {
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

void check_launch(const char* kernel, int64_t n) {
  const cudaError_t e = cudaGetLastError();
  LOOM_CHECK(e == cudaSuccess, "cudnn attention: launching ", kernel, " for ", n, " spans failed: ",
             cudaGetErrorName(e), ": ", cudaGetErrorString(e));
}

// One block per span (grid-stride): spans of another length exit at once,
// which is nearly all of them in a corpus of real documents.
template <typename T>
__global__ void one_token_span_grads_kernel(const int32_t* lengths, const int32_t* cu, int64_t n, GradTensor dq,
                                            GradTensor dk, GradTensor dv, GradTensor dout, int heads, int kv_heads,
                                            int head_dim) {
  const int group = heads / kv_heads;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    if (lengths[i] != 1) continue;
    const int64_t t = cu[i];
    T* q = static_cast<T*>(dq.data) + t * dq.token_stride;
    T* k = static_cast<T*>(dk.data) + t * dk.token_stride;
    T* v = static_cast<T*>(dv.data) + t * dv.token_stride;
    const T* o = static_cast<const T*>(dout.data) + t * dout.token_stride;
    for (int e = threadIdx.x; e < heads * head_dim; e += blockDim.x)
      q[(e / head_dim) * dq.head_stride + e % head_dim] = T(0.f);
    for (int e = threadIdx.x; e < kv_heads * head_dim; e += blockDim.x) {
      const int g = e / head_dim, d = e % head_dim;
      k[g * dk.head_stride + d] = T(0.f);
      float sum = 0.f;  // the group's query heads in order: the same bits every run
      for (int h = g * group; h < (g + 1) * group; ++h) sum += float(o[h * dout.head_stride + d]);
      v[g * dv.head_stride + d] = T(sum);
    }
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
  check_launch("ragged_offsets_kernel", n);
}

void one_token_span_grads(const int32_t* lengths, const int32_t* cu, int64_t n, GradTensor dq, GradTensor dk,
                          GradTensor dv, GradTensor dout, int64_t heads, int64_t kv_heads, int64_t head_dim,
                          bool half, void* stream) {
  LOOM_CHECK(kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0, "cudnn attention: one_token_span_grads for ",
             heads, " query heads, ", kv_heads, " kv heads of ", head_dim);
  const unsigned blocks = static_cast<unsigned>(std::clamp<int64_t>(n, 1, 8192));
  auto* s = static_cast<cudaStream_t>(stream);
  if (half)
    one_token_span_grads_kernel<__half><<<blocks, 128, 0, s>>>(lengths, cu, n, dq, dk, dv, dout, int(heads),
                                                               int(kv_heads), int(head_dim));
  else
    one_token_span_grads_kernel<__nv_bfloat16><<<blocks, 128, 0, s>>>(lengths, cu, n, dq, dk, dv, dout, int(heads),
                                                                      int(kv_heads), int(head_dim));
  check_launch("one_token_span_grads_kernel", n);
}

}  // namespace loom::cudnn_ragged
