// Naive causal GQA attention on a CUDA device: the GPU reference. Same
// formulas, layout and GQA mapping as attention_naive_cpu.hpp, with the
// softmax materialised for the whole batch at once:
//
//   workspace = scores [B, H, S, S] fp32 (forward: P, backward: P, then dS)
//
// q/k/v/out and their gradients are fp32 or bf16 (`bf16` below), read and
// written through their BSHD strides; stats is [B, H, S] contiguous fp32 in
// both cases. All arithmetic is fp32. Every output element is produced by one
// thread (or one block's fixed-order tree reduction) summing in a fixed order:
// no atomics, so results are bitwise reproducible run to run. GQA: dk/dv of a
// kv head sum over the query heads of its group in one thread, in head order.
//
// Kernels are enqueued on `stream` (a cudaStream_t; null = the legacy default
// stream) and not waited for. Launch failures throw loom::Error naming the
// kernel and the shape; errors of the kernels themselves surface at the
// caller's next synchronisation.
#pragma once
#include <cstddef>

#include "attention/naive/attention_naive_cpu.hpp"

namespace loom::naive::cuda {

// Bytes of device workspace forward and backward need for these dims.
size_t workspace_bytes(const AttnDims& d);

void attention_forward(const AttnDims& d, bool bf16, void* out, Bshd os, float* stats, const void* q, Bshd qs,
                       const void* k, Bshd ks, const void* v, Bshd vs, void* workspace, void* stream);

// Writes (not accumulates) dq, dk, dv.
void attention_backward(const AttnDims& d, bool bf16, void* dq, Bshd dqs, void* dk, Bshd dks, void* dv, Bshd dvs,
                        const void* dout, Bshd dos, const void* q, Bshd qs, const void* k, Bshd ks, const void* v,
                        Bshd vs, const float* stats, void* workspace, void* stream);

}  // namespace loom::naive::cuda
