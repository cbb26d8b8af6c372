// The ragged offsets of the cudnn plugin's document-masked (THD) SDPA graphs:
// for each of five tensors (q, k, v, out, stats) the element offset of every
// sequence's first token, cu_seqlens[i] * that tensor's token stride, as
// cuDNN reads them (int64). One small kernel on the call's stream, so that
// the spans staged with the tokens never visit the host.
#pragma once
#include <cstdint>

namespace loom::cudnn_offsets {

// out[a * n + i] = cu[i] * strides[a] for a < 5, i < n (cu: device int32 [n],
// out: device int64 [5 n]). Queued on `stream` (a cudaStream_t), not waited
// for; a launch failure throws loom::Error naming the kernel and n.
void ragged_offsets(const int32_t* cu, int64_t n, const int64_t* strides, int64_t* out, void* stream);

}  // namespace loom::cudnn_offsets
