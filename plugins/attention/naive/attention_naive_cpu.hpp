// Naive causal GQA attention on the CPU: each query row's softmax is
// materialised (one row of S scores at a time), so the code reads like the
// formulas. The reference the other attention plugins are checked against,
// also for document masking (AttnDims::positions: a query sees the keys of
// its own document span only).
//
// Layout BSHD: q, out, dq, dout are [B, S, H, D]; k, v, dk, dv are
// [B, S, Hkv, D]; query head h reads kv head h / (H / Hkv). Each tensor has
// its own element strides for b, s and h (views into a fused QKV buffer work);
// d is contiguous. stats is [B, H, S] contiguous: the log-sum-exp of each
// query row's scaled scores, saved by forward so backward can rebuild P.
//
// Work and scratch: forward runs (b, h) pairs in parallel, backward runs
// (b, kv head) pairs (the query heads of one group add into the same dk and dv,
// so they stay on one thread, in order: no races, no atomics, results bitwise
// independent of the thread count). Every dot product and sum accumulates in
// double. The caller provides `scratch`: `workers` times the per-worker
// doubles from *_scratch_doubles(); at most `workers` threads are used.
#pragma once
#include <cstdint>

namespace loom::naive {

// Element strides of a [B, S, heads, D] view (the D stride is 1).
struct Bshd {
  int64_t b = 0, s = 0, h = 0;
  static Bshd packed(int64_t S, int64_t heads, int64_t D) { return {S * heads * D, heads * D, D}; }
};

struct AttnDims {
  int64_t B = 0, S = 0, H = 0, Hkv = 0, D = 0;
  double scale = 0.0;  // softmax scale, normally 1/sqrt(D)
  bool causal = true;  // query i sees keys j <= i
  // Document masking (loom/attention.hpp's DocumentSpans::positions, in the
  // memory of the call's device): query i of row b sees keys
  // j in [i - positions[b * S + i], i] only. Null: every key the mask above allows.
  const int32_t* positions = nullptr;
};

// Checks the dims (positive, H % Hkv == 0, scale finite and > 0); throws loom::Error.
void check_dims(const AttnDims& d);

int64_t forward_scratch_doubles(const AttnDims& d);   // per worker
int64_t backward_scratch_doubles(const AttnDims& d);  // per worker

template <typename T>
void attention_forward(const AttnDims& d, T* out, Bshd os, T* stats, const T* q, Bshd qs, const T* k, Bshd ks,
                       const T* v, Bshd vs, double* scratch, int workers);

// Writes (not accumulates) dq, dk, dv.
template <typename T>
void attention_backward(const AttnDims& d, T* dq, Bshd dqs, T* dk, Bshd dks, T* dv, Bshd dvs, const T* dout, Bshd dos,
                        const T* q, Bshd qs, const T* k, Bshd ks, const T* v, Bshd vs, const T* stats,
                        double* scratch, int workers);

}  // namespace loom::naive
