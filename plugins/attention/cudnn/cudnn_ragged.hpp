// The device helpers of the cudnn plugin's document-masked (THD) SDPA graphs.
// Each is one small kernel queued on the call's stream, so that the spans
// staged with the tokens never visit the host.
#pragma once
#include <cstdint>

namespace loom::cudnn_ragged {

// The ragged offsets cuDNN reads (int64): for each of five tensors (q, k, v,
// out, stats) the element offset of every sequence's first token,
// out[a * n + i] = cu[i] * strides[a] for a < 5, i < n (cu: device int32 [n],
// out: device int64 [5 n]). Not waited for; a launch failure throws
// loom::Error naming the kernel and n.
void ragged_offsets(const int32_t* cu, int64_t n, const int64_t* strides, int64_t* out, void* stream);

// One token's attention gradients, for a tensor of `heads` heads of head_dim
// elements at (token stride, head stride) in elements.
struct GradTensor {
  void* data = nullptr;
  int64_t token_stride = 0, head_stride = 0;
};

// The gradients of every one-token span (lengths[i] == 1, token cu[i]),
// written exactly: such a token attends only to itself, so its softmax is 1
// and constant, dq = dk = 0 and dv = the sum of dout over the query heads of
// its group. cuDNN's ragged backward returns non-finite dq and dk for these
// spans on sm_90 (every span of a micro-batch one token long, an H200), so
// the plugin overwrites them after each ragged backward. bf16 or fp16
// (half = true) tensors; lengths/cu: device int32 [n] / [n + 1]. Not waited
// for; a launch failure throws loom::Error naming the kernel and n.
void one_token_span_grads(const int32_t* lengths, const int32_t* cu, int64_t n, GradTensor dq, GradTensor dk,
                          GradTensor dv, GradTensor dout, int64_t heads, int64_t kv_heads, int64_t head_dim,
                          bool half, void* stream);

}  // namespace loom::cudnn_ragged
