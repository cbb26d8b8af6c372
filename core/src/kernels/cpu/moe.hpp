// The CPU fp32 reference of HF Mixtral's sparse mixture-of-experts block
// (transformers' MixtralSparseMoeBlock) and of its load-balancing loss
// (load_balancing_loss_func), forward and backward.
//
// Why here, beside the other reference kernels, and not in model/: like
// rmsnorm.cpp or swiglu.cpp this file defines what every backend must compute
// for one layer, and the CUDA routing kernels and the future `moe` FFN block
// (blocks/) are checked against it. It is the whole layer, GEMMs
// included, because the expert GEMMs only make sense together with the routing
// that chooses their rows; the block will run its GEMMs through the precision
// plugin and keep this file as the definition. It has its own header (rather
// than a section of cpu_kernels.hpp) because the layer's saved state is a set
// of buffers the other kernels do not have.
//
// The computation, for N tokens x[N, h], E experts, top_k = k:
//   xin      = x, or x * noise under router jitter (training only; HF multiplies
//              the hidden states, so the experts see the jittered input too)
//   logits   = xin Wr^T                           [N, E]   (Wr = gate.weight [E, h])
//   probs    = softmax(logits) per row            [N, E]   (row sums in double)
//   experts  = top-k of probs, descending; equal probabilities go to the lower
//              expert index (torch.topk's CPU choice among exact ties is an
//              artifact of its selection and is not reproduced; the values
//              picked, hence the weights, are the same)   [N, k]
//   weights  = the k probs / their sum            [N, k]
//   sort     = the N*k (token, slot) pairs, stably sorted by expert: per-expert
//              counts and offsets, perm (sorted row -> token*k + slot) and its
//              inverse row_of; within an expert rows keep token order
//   xs       = xin[token of each sorted row]      [N*k, h]
//   per expert e over its rows [offsets[e], offsets[e+1]):
//     gate = xs W1e^T, up = xs W3e^T [., f]; act = silu(gate) * up; eout = act W2e^T [., h]
//   y[t]     = sum over t's slots, in ascending expert order (HF's index_add_
//              order), of weight * eout. Dropless: no capacity, every pair runs.
//
// Backward (y's gradient dy given) goes through all of it: the combine, each
// expert's SwiGLU, the renormalisation (dw_j -> dp_j = (dw_j - sum_i dw_i w_i) / S,
// S the sum of the k selected probs; unselected probs get nothing from the
// combine), the softmax, the router GEMM, the gather (a fixed-order scatter-add
// back to the token rows) and the jitter factor. The top-k choice itself is
// piecewise constant and has no gradient. The load-balancing loss adds
// d(aux)/d(probs) (moe_aux_grad) before the softmax backward.
//
// Conventions as in cpu_kernels.hpp: row-major, parameter gradients
// ACCUMULATED (+=), everything else written; float and double instantiations
// (the tests take finite differences in double); every sum in an order fixed
// by the shapes, in double, so results are bitwise equal for any thread count.
// Nothing here allocates except MoeBuffers and MoeAuxStats (built once).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace loom {
// The most experts a routing takes: the CUDA backend's pinned expert counts
// hold that many (model.num_experts is checked against it, config/run_config.hpp).
inline constexpr int64_t kMaxExperts = 4096;
}  // namespace loom

namespace loom::cpu {

struct MoeDims {
  int64_t N = 0;  // tokens (rows of x)
  int64_t h = 0;  // hidden size
  int64_t f = 0;  // each expert's ffn size
  int64_t E = 0;  // experts
  int64_t k = 0;  // experts per token (top_k)
  // Each expert's run of sorted rows starts at a multiple of row_align and
  // spans its row count rounded up to one (the CUDA sort, for a precision
  // recipe's row multiple, MoeRouting::row_align; the CPU reference packs
  // them: 1). The rows
  // between runs hold no (token, slot) pair: the gather zeroes them and the
  // combine backward writes zeros into their gradient.
  int64_t row_align = 1;
  int64_t rows() const { return N * k; }  // (token, slot) pairs = expert rows
  // Sorted rows the buffers hold: every pair plus the most padding E runs can take.
  int64_t padded_rows() const { return rows() + (row_align > 1 ? E * (row_align - 1) : 0); }
};

// Throws loom::Error naming the values when the shape is unusable:
// top_k < 1, top_k > num_experts, num_experts < 1, negative sizes, or more
// rows than the int32 permutation indices hold.
void moe_check(const MoeDims& d);

// Parameters, HF layout: router [E, h]; per expert w1 (gate) [f, h], w2 (down)
// [h, f], w3 (up) [f, h]. One pointer per expert, so the block can point into
// its unit's flat buffer (HF order: gate, then experts.0.w1, w2, w3, ...).
template <typename T>
struct MoeWeights {
  const T* router = nullptr;
  std::vector<const T*> w1, w2, w3;
};
template <typename T>
struct MoeGrads {
  T* router = nullptr;
  std::vector<T*> w1, w2, w3;
};

// What moe_forward writes and moe_backward reads (element counts in brackets).
template <typename T>
struct MoeActs {
  T* xin = nullptr;          // [N h] x * noise; unused (may be null) without jitter
  T* logits = nullptr;       // [N E]
  T* probs = nullptr;        // [N E]
  int32_t* experts = nullptr;  // [N k] selected experts, descending probability
  T* weights = nullptr;      // [N k] renormalised routing weights
  int64_t* counts = nullptr;   // [E] rows per expert
  int64_t* offsets = nullptr;  // [E + 1] first sorted row of each expert; offsets[E] = N k
  int32_t* perm = nullptr;     // [N k] sorted row -> token * k + slot
  int32_t* row_of = nullptr;   // [N k] token * k + slot -> sorted row
  T* xs = nullptr;           // [N k, h] gathered expert inputs
  T* gate = nullptr;         // [N k, f]
  T* up = nullptr;           // [N k, f]
  T* act = nullptr;          // [N k, f] silu(gate) * up
  T* eout = nullptr;         // [N k, h] expert outputs before weighting
};
// Backward-only scratch.
template <typename T>
struct MoeScratch {
  T* d_eout = nullptr;     // [N k, h]
  T* d_act = nullptr;      // [N k, f]
  T* d_gate = nullptr;     // [N k, f]
  T* d_up = nullptr;       // [N k, f]
  T* d_xs = nullptr;       // [N k, h]
  T* d_weights = nullptr;  // [N k]
  T* d_probs = nullptr;    // [N E]
  T* d_logits = nullptr;   // [N E]
};

// MoeActs and MoeScratch backed by vectors of one shape (tests, CPU callers).
template <typename T>
class MoeBuffers {
 public:
  explicit MoeBuffers(const MoeDims& d);
  MoeActs<T> acts;
  MoeScratch<T> scratch;

 private:
  std::vector<T> t_;
  std::vector<int32_t> i32_;
  std::vector<int64_t> i64_;
};

// The router alone: logits, probs, top-k experts and renormalised weights of xin.
template <typename T>
void moe_route(T* logits, T* probs, int32_t* experts, T* weights, const T* xin, const T* router, const MoeDims& d);

// The stable counting sort of the (token, slot) pairs by expert.
void moe_sort(int64_t* counts, int64_t* offsets, int32_t* perm, int32_t* row_of, const int32_t* experts,
              const MoeDims& d);

// Router jitter factors: noise[i] = uniform in [1 - eps, 1 + eps), a pure
// function of (seed, i) (splitmix64), so any thread count or device draws the
// same numbers. HF draws torch's uniform_, which cannot be reproduced; the
// distribution is the same.
template <typename T>
void moe_jitter_noise(T* noise, int64_t n, double eps, uint64_t seed);

// Forward: y [N h] written. noise [N h] (from moe_jitter_noise) or null for no
// jitter (HF applies jitter only in training with router_jitter_noise > 0).
template <typename T>
void moe_forward(T* y, const T* x, const T* noise, const MoeWeights<T>& w, const MoeActs<T>& a, const MoeDims& d);

// Backward of moe_forward with the same x, noise, weights and acts: dx [N h]
// written, parameter gradients accumulated. aux_dprobs [E] (moe_aux_grad) is
// added to d(loss)/d(probs[n, e]) for every row, or null for no aux loss.
template <typename T>
void moe_backward(T* dx, MoeGrads<T>& g, const T* dy, const T* x, const T* noise, const MoeWeights<T>& w,
                  const MoeActs<T>& a, const MoeScratch<T>& s, const T* aux_dprobs, const MoeDims& d);

// The steps of moe_forward and moe_backward, for a caller that runs the
// expert GEMMs itself (the `moe` FFN block runs them through the precision
// plugin, between these steps; blocks/ffn_moe.cpp):
//   forward:  [moe_jitter_apply] moe_route moe_sort moe_gather | experts | moe_combine
//   backward: moe_combine_backward | experts | moe_route_backward moe_scatter_add
// xin = x * noise (n elements).
template <typename T>
void moe_jitter_apply(T* xin, const T* x, const T* noise, int64_t n);
// xs[r] = xin[token of sorted row r]   [N k, h]
template <typename T>
void moe_gather(T* xs, const T* xin, const int32_t* perm, const MoeDims& d);
// y[t] = sum of t's weighted expert rows, in ascending expert order   [N, h] written
template <typename T>
void moe_combine(T* y, const T* eout, const T* weights, const int32_t* row_of, const MoeDims& d);
// d_eout [N k, h] and d_weights [N k] written from dy [N, h].
template <typename T>
void moe_combine_backward(T* d_eout, T* d_weights, const T* dy, const T* eout, const T* weights, const int32_t* perm,
                          const MoeDims& d);
// Through the renormalisation, the softmax (plus aux_dprobs [E] on every row,
// or null) and the router: d_probs, d_logits [N E] (scratch) and dxin [N h]
// written, d_router [E h] accumulated.
template <typename T>
void moe_route_backward(T* dxin, T* d_router, T* d_probs, T* d_logits, const T* d_weights, const T* xin,
                        const T* router, const T* probs, const int32_t* experts, const T* weights,
                        const T* aux_dprobs, const MoeDims& d);
// dx[t] += the gradients of t's expert rows (ascending row order), then, with
// jitter (noise not null), dx[t] *= noise[t].
template <typename T>
void moe_scatter_add(T* dx, const T* d_xs, const int32_t* row_of, const T* noise, const MoeDims& d);

// HF's load_balancing_loss_func. It concatenates the router logits of all
// layers and computes, over those R rows (tokens x layers),
//   aux = E * sum_e f_e * P_e,  f_e = (top-k selections of e) / R,  P_e = mean prob of e
// (f sums to k, so a perfectly balanced router gives aux = k). Only P carries a
// gradient: d aux / d probs[n, e] = E * f_e / R for every row n of every layer.
// Since f and P are over all layers together, the loss is not a sum of
// per-layer losses: accumulate every layer's rows, then take the loss and the
// per-expert gradient (which every layer's backward then uses).
//
// Scaling (how the trainer will use it): the aux loss of a micro-batch is
// computed over that micro-batch's local tokens, as HF and Megatron do, and its
// gradient gets the same 1 / (grad_accum * world) factor as the LM loss's mean,
// so the step optimises the mean over micro-batches and ranks of per-micro-batch
// aux values (Megatron divides by the number of micro-batches; HF's Trainer is
// reported to mis-scale the term under gradient accumulation and across ranks).
// The logged aux is that same mean. Note that this is not the aux of the whole
// global batch (f * P is not linear in the tokens).
struct MoeAuxStats {
  explicit MoeAuxStats(int64_t num_experts) : counts(num_experts, 0), prob_sum(num_experts, 0.0) {}
  std::vector<int64_t> counts;   // top-k selections per expert
  std::vector<double> prob_sum;  // sum of probs per expert
  int64_t rows = 0;              // R
};
template <typename T>
void moe_aux_accumulate(MoeAuxStats& s, const T* probs, const int32_t* experts, const MoeDims& d);
double moe_aux_loss(const MoeAuxStats& s);
// g[e] = coef * d aux / d probs[n, e] = coef * E * counts[e] / R^2.
template <typename T>
void moe_aux_grad(T* g, const MoeAuxStats& s, double coef);

// The same statistics as one flat array (a backend buffer, f64 [2E + 1]):
// selections per expert (exact integers in double), probability sums per
// expert, rows. moe_aux_loss_flat and moe_aux_grad_flat are moe_aux_loss and
// moe_aux_grad on it, with the same arithmetic.
template <typename T>
void moe_aux_accumulate_flat(double* stats, const T* probs, const int32_t* experts, const MoeDims& d);
double moe_aux_loss_flat(const double* stats, int64_t E);
template <typename T>
void moe_aux_grad_flat(T* g, const double* stats, int64_t E, double coef);

}  // namespace loom::cpu
