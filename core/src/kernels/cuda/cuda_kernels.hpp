// Host entry points of the CUDA kernels, one .cu per layer (the same split as
// kernels/cpu). Each takes Tensors, checks device, dtypes and shapes, picks
// the template instance for the dtypes (fp32 / bf16 combinations of
// backend.hpp) and the packed or scalar path, and launches on `stream`.
// Plain C++: cuda_backend.cpp includes it without nvcc.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "loom/ops/backend.hpp"
#include "loom/tensor.hpp"

namespace loom::gpu {

// Device scratch owned by the backend, allocated once when it is created
// (never inside a step). Kernels that need partial sums (rmsnorm dw, the
// norms) use it; they run on the one stream, so they never overlap.
struct Scratch {
  void* ptr = nullptr;
  size_t bytes = 0;
};

// embedding.cu
void embedding_forward(Tensor& out, const Tensor& tokens, const Tensor& wte, cudaStream_t stream);
void embedding_backward(Tensor& dwte, const Tensor& dout, const Tensor& tokens, cudaStream_t stream);

// rmsnorm.cu
// amax (may be null): max |v| over the stored values (after rounding to out's
// dtype; NaN as +inf) max-accumulated into this device float, the amax the
// FP8 recipe's cast of out would measure (Fp8OperandAmax, loom/precision.hpp).
void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& x, const Tensor& w, float eps, cudaStream_t stream,
                     float* amax = nullptr);
// RMSNorm writing a linear's FP8 operand instead of its bf16 output
// (Fp8Operand, loom/precision.hpp): every value as rmsnorm_forward stores it
// (bf16), encoded as q = encode(v * *scale) into q [N, h] and q_t [h, N], max
// |v| max-accumulated into *amax (may be null), rstd as rmsnorm_forward
// writes it: bitwise rmsnorm_forward followed by fp8_cast. x, w bf16, 16-byte
// aligned; N and h multiples of 16; q and q_t contiguous, 16-byte aligned; q
// may be empty (no data): q_t alone is written.
void rmsnorm_forward_fp8(const Tensor& q, const Tensor& q_t, Tensor& rstd, const Tensor& x, const Tensor& w, float eps,
                         const float* scale, float* amax, cudaStream_t stream);
void rmsnorm_backward(Tensor& dx, Tensor& dw, const Tensor& dout, const Tensor& x, const Tensor& w,
                      const Tensor& rstd, const Scratch& scratch, cudaStream_t stream);

// rope.cu: x [B, S, nh, D] with row stride x.stride[1], in place. cos_table and
// sin_table are device fp32 arrays [S, D/2] (the CPU's angles, see rope.cpp);
// sign = +1 forward, -1 backward (the inverse rotation). Row (b, s) takes
// position s, or positions[b * S + s] (device int32, each in [0, S)) when
// positions is not null (train.reset_position_ids).
void rope_apply(Tensor& x, const float* cos_table, const float* sin_table, int sign, cudaStream_t stream,
                const int32_t* positions = nullptr);

// swiglu.cu: [rows, f] row views (fold_rows; row strides may exceed f, as for
// the halves of a packed [N, 2f] gate_up buffer), or 1-D contiguous. amax
// (may be null): as rmsnorm_forward's, over out (forward) or dgate and dup
// together (backward: the gate_up projection's dy).
void swiglu_forward(Tensor& out, const Tensor& gate, const Tensor& up, cudaStream_t stream, float* amax = nullptr);
void swiglu_backward(Tensor& dgate, Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up,
                     cudaStream_t stream, float* amax = nullptr);
// SwiGLU writing a linear's FP8 operand instead of bf16 (Fp8Operand,
// loom/precision.hpp): forward v = silu(gate) up into q [rows, f] and q_t
// [f, rows]; backward v = [dgate, dup] into q [rows, 2f] and q_t [2f, rows]
// (dgate in columns [0, f), dup in [f, 2f): the packed gate_up gradient).
// Each v is rounded to bf16, then q = encode(v * *scale) in q's format, and
// max |v| is max-accumulated into *amax (may be null; NaN as +inf): bitwise
// swiglu_forward/backward followed by fp8_cast. gate, up, dout: bf16 row
// views as above, 16-byte aligned, row strides multiples of 8; rows and f
// multiples of 16; q and q_t contiguous, 16-byte aligned; q may be empty (no
// data): q_t alone is written.
void swiglu_forward_fp8(const Tensor& q, const Tensor& q_t, const Tensor& gate, const Tensor& up, const float* scale,
                        float* amax, cudaStream_t stream);
void swiglu_backward_fp8(const Tensor& q, const Tensor& q_t, const Tensor& dout, const Tensor& gate, const Tensor& up,
                         const float* scale, float* amax, cudaStream_t stream);

// residual.cu
void add(Tensor& out, const Tensor& a, const Tensor& b, cudaStream_t stream);
void accumulate(Tensor& dst, const Tensor& src, cudaStream_t stream);

// cross_entropy.cu
void cross_entropy(Tensor& logits, const Tensor& targets, Tensor& losses, float dlogits_scale, cudaStream_t stream);

// norm.cu: sum (square = false) or sum of squares of x[begin, end), fp32 or
// bf16, reduced in double in an order fixed by (end - begin) alone. The
// result goes through `host_result` (pinned) and the stream is synchronised.
double reduce_sum(const Tensor& x, int64_t begin, int64_t end, bool square, const Scratch& scratch,
                  double* host_result, cudaStream_t stream);
// The same reduction added into acc[0] (a device f64) on the device: queued,
// never waits; end == begin adds nothing.
void sum_into(Tensor& acc, const Tensor& x, int64_t begin, int64_t end, bool square, const Scratch& scratch,
              cudaStream_t stream);
// Backend::clip_scale on the device StepScalars (f64[kStepScalars]): one
// thread, bitwise the CPU's result for a finite norm. Queued, never waits.
void clip_scale(Tensor& scalars, float grad_scale, float clip_norm, cudaStream_t stream);
void scale(Tensor& x, float s, cudaStream_t stream);

// timestamp.cu: dst[0] = the device's global timer in ms when the stream gets there.
void timestamp(Tensor& dst, cudaStream_t stream);

// adamw.cu: a.scalars, when set, points to device StepScalars (skip, update
// scale), read by the kernel itself.
void adamw(Tensor& param, Tensor* master, const Tensor& grad, Tensor& m, Tensor& v, const Backend::AdamWArgs& a,
           cudaStream_t stream);
// The stochastic rounding stream: 32 random bits for element `index` of a
// call with (seed, step). Exposed so that tests can reproduce a rounding.
uint32_t sr_random_bits(uint64_t seed, uint64_t step, uint64_t index);

// convert.cu
void convert(Tensor& dst, const Tensor& src, cudaStream_t stream);

}  // namespace loom::gpu
