// CPU fp32 reference kernels, one file per layer in this folder. They define
// what every other backend must compute: the CUDA kernels and the golden
// tests are checked against them.
//
// Conventions: row-major contiguous fp32 arrays; N = rows (tokens), h = hidden.
// Backward kernels ACCUMULATE (+=) into parameter gradients (dw), and into dx
// where the comment says so (the residual stream sums gradients from two
// paths); everything else is written. OpenMP over rows where it pays.
//
// Every function also has a double overload computing the same thing in
// float64: the gradient tests take central finite differences in double, which
// fp32 cannot resolve. Both overloads come from one template per kernel.
//
// Determinism: no kernel uses atomics or an OpenMP reduction; every sum runs in
// an order fixed by the shapes alone, so results are bitwise equal for any
// thread count (run.deterministic and reproducible losses rely on it).
// Reductions (norms, softmax sums, the loss) accumulate in double.
//
// The mixture-of-experts layer (HF Mixtral's sparse MoE block, its routing and
// its load-balancing loss) is declared in moe.hpp: it carries a saved routing
// state that the one-op kernels here do not have.
#pragma once
#include <cstdint>

namespace loom::cpu {

// embedding.cpp -------------------------------------------------------------
// The embedding kernels index wte with the tokens unchecked (they do not know
// V); call this on each batch as it arrives. Throws loom::Error naming the
// first token outside [0, V) and its position.
void check_tokens(const int32_t* tokens, int64_t N, int64_t V);
// out[n, :] = wte[tokens[n], :]
void embedding_forward(float* out, const int32_t* tokens, const float* wte, int64_t N, int64_t h);
// dwte[tokens[n], :] += dout[n, :]   (deterministic: serial over n per row of wte)
void embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t h);
void embedding_forward(double* out, const int32_t* tokens, const double* wte, int64_t N, int64_t h);
void embedding_backward(double* dwte, const double* dout, const int32_t* tokens, int64_t N, int64_t h);

// rmsnorm.cpp ---------------------------------------------------------------
// out = x * rstd * w, rstd[n] = 1 / sqrt(mean(x[n]^2) + eps)  (rstd saved for backward)
void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t N, int64_t h, float eps);
// dx += d(out)/dx^T dout ; dw += sum_n dout * x * rstd
void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w, const float* rstd,
                      int64_t N, int64_t h);
void rmsnorm_forward(double* out, double* rstd, const double* x, const double* w, int64_t N, int64_t h, double eps);
void rmsnorm_backward(double* dx, double* dw, const double* dout, const double* x, const double* w,
                      const double* rstd, int64_t N, int64_t h);

// rope.cpp -----------------------------------------------------------------
// In place on x[B, S, nh, D] (any row stride: `row_stride` elements between
// consecutive (b, s) rows; heads contiguous inside a row). HF Llama convention
// ("rotate_half"): pairs (i, i + D/2), angle = pos * theta^(-2i/D), pos = s,
// or pos = positions[b * S + s] when `positions` is given (each in [0, S):
// positions that restart at document starts, train.reset_position_ids).
// The angles are HF's fp32 angles (see rope.cpp and rope_angle below), so the
// float kernel reproduces transformers' fp32 rotary embedding; D must be even.
void rope_forward(float* x, int64_t B, int64_t S, int64_t nh, int64_t D, int64_t row_stride, double theta,
                  const int32_t* positions = nullptr);
// The inverse rotation applied to the gradient, in place.
void rope_backward(float* dx, int64_t B, int64_t S, int64_t nh, int64_t D, int64_t row_stride, double theta,
                   const int32_t* positions = nullptr);
void rope_forward(double* x, int64_t B, int64_t S, int64_t nh, int64_t D, int64_t row_stride, double theta,
                  const int32_t* positions = nullptr);
void rope_backward(double* dx, int64_t B, int64_t S, int64_t nh, int64_t D, int64_t row_stride, double theta,
                   const int32_t* positions = nullptr);
// The rotation angle of pair i at position pos, exactly as HF computes it in
// fp32: inv_freq = fp32(theta^(-(fp32(2i/D)))), angle = fp32(pos * inv_freq).
// Exposed so that the CUDA kernels and the tests use the same table.
float rope_angle(int64_t pos, int64_t i, int64_t D, double theta);

// swiglu.cpp ---------------------------------------------------------------
// out = silu(gate) * up
void swiglu_forward(float* out, const float* gate, const float* up, int64_t n);
// dgate, dup written
void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate, const float* up, int64_t n);
void swiglu_forward(double* out, const double* gate, const double* up, int64_t n);
void swiglu_backward(double* dgate, double* dup, const double* dout, const double* gate, const double* up,
                     int64_t n);

// residual.cpp -------------------------------------------------------------
// out = a + b (out may alias a)
void residual_forward(float* out, const float* a, const float* b, int64_t n);
// dst += src
void accumulate(float* dst, const float* src, int64_t n);
void residual_forward(double* out, const double* a, const double* b, int64_t n);
void accumulate(double* dst, const double* src, int64_t n);

// cross_entropy.cpp --------------------------------------------------------
// Fused softmax + cross-entropy. Returns the SUM over rows of -log p[target].
// When dlogits_scale != 0, overwrites logits with (softmax - onehot) * dlogits_scale
// (the logits gradient, in place). Targets < 0 are ignored (no loss, zero grad).
// A target >= V throws loom::Error (checked before anything is written).
double cross_entropy(float* logits, const int32_t* targets, int64_t N, int64_t V, float dlogits_scale);
double cross_entropy(double* logits, const int32_t* targets, int64_t N, int64_t V, double dlogits_scale);

// adamw.cpp ----------------------------------------------------------------
// AdamW with decoupled weight decay and bias correction (step is 1-based):
//   g = grad * grad_scale; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2
//   p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)
void adamw(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
           float eps, float weight_decay, int64_t step, float grad_scale);
void adamw(double* param, const double* grad, double* m, double* v, int64_t n, double lr, double beta1,
           double beta2, double eps, double weight_decay, int64_t step, double grad_scale);

// norm.cpp -----------------------------------------------------------------
// sum of squares, accumulated in double
double sq_norm(const float* x, int64_t n);
// x *= s
void scale(float* x, float s, int64_t n);
double sq_norm(const double* x, int64_t n);
void scale(double* x, double s, int64_t n);

}  // namespace loom::cpu
