// Host entry points of the MoE routing kernels (moe.cu): what the `moe` FFN
// block runs on the GPU around its expert GEMMs. Each is the CUDA form of a
// step of the CPU reference (kernels/cpu/moe.hpp, which defines the
// computation and its names) and is checked against it by tests/test_cuda_moe.cpp.
//
// Layouts and types are the reference's: row-major, N tokens, E experts,
// k = top_k, R = N k (token, slot) pairs; pair p = token * k + slot.
//   router side, always fp32 (HF's router runs in fp32):
//     probs [N E], weights [N k], d_weights [N k], d_logits [N E], aux_dprobs [E]
//   indices: experts [N k] int32, perm [R] int32 (sorted row -> pair), row_of [R]
//     int32 (pair -> sorted row), counts [E] int64, offsets [E + 1] int64
//   hidden-size rows, fp32 or bf16 (one dtype per call, Tensors so that it is
//     checked): x, dx, y, dy [N h]; xs, eout, d_eout, d_xs [R h]
// The index and router arrays are raw device pointers (their types are fixed;
// a null pointer with a non-empty shape is refused); the Tensors are checked
// for device, dtype and shape. Everything is queued on `stream`, nothing waits
// and nothing is allocated: the sort's scratch comes from the caller.
//
// Determinism: no kernel uses atomics. Every sum runs in an order fixed by the
// shapes (and, for the block reductions, by the block size, itself a function
// of the shapes), so a call repeated on the same inputs gives the same bits.
// Where the reference sums serially and the kernel does the same serial sum
// (softmax, top-k, renormalisation, combine, renormalisation and softmax
// backward, scatter-add, aux loss and gradient) the kernels round every product
// and sum separately (__fmul_rn, __dadd_rn, ...) as the reference's baseline
// x86-64 build does, so the results match it to the last bit except where
// CUDA's exp differs from the host's in the last bit of a double.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cpu/moe.hpp"
#include "loom/tensor.hpp"

namespace loom::gpu {

using cpu::MoeDims;

// The router after its GEMM: logits [N E] (fp32 or bf16 Tensor) -> softmax in
// fp32 (max subtracted, sum in double), the top-k experts in descending
// probability with exact ties to the lower expert index, and the k weights
// renormalised to sum to 1. One thread per token.
void moe_route(float* probs, int32_t* experts, float* weights, const Tensor& logits, const MoeDims& d,
               cudaStream_t stream);

// Scratch (int32 elements) for moe_sort's fastest split of dims d: E per
// chunk of kMoeSortChunk pairs. Less (at least E) is accepted: the chunks
// grow (multiples of kMoeSortChunk) until their counters fit, and the output
// is the same.
constexpr int64_t kMoeSortChunk = 256;  // 64 warps for mixtral-small's 16384 pairs (1024: 16, 21 us a pass)
int64_t moe_sort_scratch_elems(const MoeDims& d);

// The stable counting sort of the R (token, slot) pairs by expert: counts,
// offsets, perm [Rp = d.padded_rows()] and row_of [R], within an expert in
// pair (= token) order. Expert e's run starts at offsets[e], a multiple of
// d.row_align, and spans counts[e] rounded up to one; perm is -1 on the rows
// that hold no pair (the padding, and past offsets[E]). With row_align 1,
// offsets[E] = R. Each warp owns a chunk of kMoeSortChunk consecutive pairs: it counts
// its chunk per expert (longer chunks when the scratch is short, see
// moe_sort_scratch_elems), a warp per expert turns the chunk counts into chunk
// bases by a prefix sum over the chunks, and each warp then places its pairs,
// 32 at a time in pair order, ranking equal experts inside the 32 by lane
// (__match_any_sync). No atomics: the output is a function of `experts` alone.
// An expert index outside [0, E) (never produced by moe_route) is skipped: it
// is counted nowhere and its row_of entry is -1.
void moe_sort(int64_t* counts, int64_t* offsets, int32_t* perm, int32_t* row_of, const int32_t* experts,
              int32_t* scratch, int64_t scratch_elems, const MoeDims& d, cudaStream_t stream);

// xs[r] = x[perm[r] / k]: each expert's input rows, in sorted order; zeros on
// the rows that hold no pair (perm -1). xs [Rp h], x [N h].
void moe_gather(Tensor& xs, const Tensor& x, const int32_t* perm, const MoeDims& d, cudaStream_t stream);

// y[t] = sum over t's k slots, in ascending sorted row (= expert) order, of
// weights[t k + j] * eout[row_of[t k + j]], from zero, in fp32 (rounded once to
// bf16 for bf16 y). Written, not accumulated. y [N h], eout [Rp h].
void moe_combine(Tensor& y, const Tensor& eout, const float* weights, const int32_t* row_of, const MoeDims& d,
                 cudaStream_t stream);

// Backward of moe_combine: d_eout[r] = weights[p] * dy[p / k] and
// d_weights[p] = <dy[p / k], eout[r]> (summed in double, a block reduction of
// fixed order), p = perm[r]. Both written; a row that holds no pair (perm -1)
// gets zeros in d_eout. d_eout, eout [Rp h], dy [N h].
void moe_combine_backward(Tensor& d_eout, float* d_weights, const Tensor& dy, const Tensor& eout,
                          const float* weights, const int32_t* perm, const MoeDims& d, cudaStream_t stream);

// Backward of the renormalisation and the softmax, per token: dp = aux_dprobs
// (or 0), dp[sel_j] += (dw_j - sum_i dw_i w_i) / S (S the sum of the selected
// probs), d_logits = p * (dp - <p, dp>). aux_dprobs [E] (moe_aux_finish's
// gradient) or null for no aux loss. d_logits [N E] written.
void moe_route_backward(float* d_logits, const float* d_weights, const float* probs, const int32_t* experts,
                        const float* weights, const float* aux_dprobs, const MoeDims& d, cudaStream_t stream);

// Backward of the gather: dx[t] (+)= the d_xs rows of t's k slots, added in
// ascending sorted row (= expert) order in fp32 (rounded once to bf16 for bf16
// dx); accumulate = false writes their sum instead. dx [N h], d_xs [Rp h].
void moe_scatter_add(Tensor& dx, const Tensor& d_xs, const int32_t* row_of, bool accumulate, const MoeDims& d,
                     cudaStream_t stream);

// The load-balancing statistics of one layer, added to the device totals of
// every layer so far (zero them before the first layer): aux_counts[e] +=
// counts[e] (moe_sort's counts: the top-k selections of e), aux_prob_sum[e] +=
// the sum over the N tokens of probs[n, e] (in double, a block reduction of
// fixed order). The caller keeps the row total R (the sum of the layers' N).
void moe_aux_accumulate(int64_t* aux_counts, double* aux_prob_sum, const int64_t* counts, const float* probs,
                        const MoeDims& d, cudaStream_t stream);

// After the last layer: loss[0] = E * sum_e (counts_e / R) (prob_sum_e / R)
// (moe_aux_loss) and grad[e] = coef * E * (counts_e / R) / R (moe_aux_grad),
// both 0 when R = 0. loss may be null. One thread, serial over E.
void moe_aux_finish(double* loss, float* grad, const int64_t* aux_counts, const double* aux_prob_sum,
                    int64_t rows, double coef, int64_t num_experts, cudaStream_t stream);

// ---- the rest of the block's steps on the device (the CUDA backend's moe_*) ----

// The router GEMM in fp32: logits [N E] fp32 = x [N h] router^T ([E h]), x
// and router of one dtype (fp32 or bf16), products and sums in fp32, one warp
// per token, each dot a fixed-order warp reduction (deterministic).
void moe_router_forward(float* logits, const Tensor& x, const Tensor& router, const MoeDims& d, cudaStream_t stream);

// The router's backward: dx [N h] = d_logits [N E] router (written, x's dtype;
// serial over E in fp32) and d_router [E h] += d_logits^T x (fp32 or bf16
// gradient): per chunk of tokens a partial [E h] in fp32 into `scratch`, then
// the chunks summed in chunk order — no atomics, the order fixed by the shape
// and scratch_bytes. Where a chunk's [E h] partial does not fit the scratch,
// the experts are reduced in slices that do (one pass each); the scratch must
// hold one expert's [h] fp32 partial (checked).
void moe_router_backward(Tensor& dx, Tensor& d_router, const float* d_logits, const Tensor& x, const Tensor& router,
                         void* scratch, size_t scratch_bytes, const MoeDims& d, cudaStream_t stream);

// Router jitter: noise[i] = 1 - eps + 2 eps u_i, u_i = the top 53 bits of
// splitmix64(splitmix64(seed) + i) / 2^53 — the CPU reference's
// moe_jitter_noise, so both devices draw the same noise (rounded from double to
// the tensor's dtype; bf16 through fp32) — and xin = x * noise (fp32 product,
// rounded once). xin, noise, x: one dtype, n elements each.
void moe_jitter(Tensor& xin, Tensor& noise, const Tensor& x, double eps, uint64_t seed, cudaStream_t stream);

// dx *= noise, element-wise (the jitter's backward), fp32 product rounded once.
void moe_scale_by(Tensor& dx, const Tensor& noise, cudaStream_t stream);

// The aux statistics as the CPU backend keeps them, one flat f64 buffer [2E +
// 1]: selections per expert (as doubles), probability sums, rows. Adds this
// layer's counts (moe_sort's), its probability sums (block reductions in
// double of fixed order) and N.
void moe_aux_accumulate_flat(double* stats, const int64_t* counts, const float* probs, const MoeDims& d,
                             cudaStream_t stream);
// aux[0] (fp32) = moe_aux_loss_flat(stats), dprobs [E] (fp32) = moe_aux_grad_flat(stats, coef), one thread.
void moe_aux_finish_flat(float* aux, float* dprobs, const double* stats, double coef, int64_t E, cudaStream_t stream);

}  // namespace loom::gpu
