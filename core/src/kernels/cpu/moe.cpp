// HF Mixtral's sparse MoE block and its load-balancing loss: the reference
// (see moe.hpp for the computation and the conventions).
#include "kernels/cpu/moe.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/cpu/cpu_kernels.hpp"
#include "loom/error.hpp"

namespace loom::cpu {
namespace {

// Per-token slot arrays live on the stack (no allocation per token).
constexpr int64_t kMaxTopK = 64;

// The three products of a linear layer with W [n, kin] (HF's [out, in]), each
// output element one serial double sum, rows in parallel: fixed order.
// y[m, n] = x[m, kin] W^T
template <typename T>
void lin_fwd(T* y, const T* x, const T* w, int64_t m, int64_t kin, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    const T* xr = x + i * kin;
    for (int64_t j = 0; j < n; ++j) {
      const T* wr = w + j * kin;
      double acc = 0.0;
      for (int64_t c = 0; c < kin; ++c) acc += static_cast<double>(xr[c]) * wr[c];
      y[i * n + j] = static_cast<T>(acc);
    }
  }
}

// dx[m, kin] (+)= dy[m, n] W
template <typename T>
void lin_dx(T* dx, const T* dy, const T* w, int64_t m, int64_t kin, int64_t n, bool accumulate) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    const T* dyr = dy + i * n;
    for (int64_t c = 0; c < kin; ++c) {
      double acc = 0.0;
      for (int64_t j = 0; j < n; ++j) acc += static_cast<double>(dyr[j]) * w[j * kin + c];
      T& out = dx[i * kin + c];
      out = accumulate ? static_cast<T>(out + acc) : static_cast<T>(acc);
    }
  }
}

// dW[n, kin] += dy^T x over the m rows (rows of dW in parallel, m in order)
template <typename T>
void lin_dw(T* dw, const T* dy, const T* x, int64_t m, int64_t kin, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t c = 0; c < kin; ++c) {
      double acc = 0.0;
      for (int64_t i = 0; i < m; ++i) acc += static_cast<double>(dy[i * n + j]) * x[i * kin + c];
      dw[j * kin + c] += static_cast<T>(acc);
    }
  }
}

uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The router's and the experts' input: x, or the jittered copy in a.xin.
template <typename T>
const T* expert_input(const T* x, const T* noise, const MoeActs<T>& a) {
  return noise ? a.xin : x;
}

}  // namespace

void moe_check(const MoeDims& d) {
  LOOM_CHECK(d.E >= 1, "moe: num_experts = ", d.E, " must be at least 1");
  LOOM_CHECK(d.k >= 1, "moe: top_k = ", d.k, " must be at least 1 (num_experts = ", d.E, ")");
  LOOM_CHECK(d.k <= d.E, "moe: top_k = ", d.k, " exceeds num_experts = ", d.E,
             " (each token picks top_k distinct experts)");
  LOOM_CHECK(d.k <= kMaxTopK, "moe: top_k = ", d.k, " is above ", kMaxTopK,
             ", the most the CPU reference's per-token slot arrays hold");
  LOOM_CHECK(d.N >= 0 && d.h >= 1 && d.f >= 1, "moe: tokens = ", d.N, ", hidden = ", d.h, ", ffn = ", d.f,
             " must be non-negative, positive, positive");
  LOOM_CHECK(d.N <= std::numeric_limits<int32_t>::max() / d.k, "moe: tokens x top_k = ", d.N, " x ", d.k,
             " exceeds the int32 range of the routing permutation");
  LOOM_CHECK(d.row_align >= 1 && d.row_align <= 1024, "moe: row_align = ", d.row_align, " must be in [1, 1024]");
  LOOM_CHECK(d.padded_rows() <= std::numeric_limits<int32_t>::max(), "moe: tokens x top_k = ", d.N, " x ", d.k,
             " plus ", d.E, " experts' padding to ", d.row_align, " rows exceeds the int32 range of the routing "
             "permutation");
}

template <typename T>
MoeBuffers<T>::MoeBuffers(const MoeDims& d) {
  moe_check(d);
  const size_t N = d.N, h = d.h, f = d.f, E = d.E, k = d.k, R = d.rows();
  // [xin, logits, probs, weights, xs, gate, up, act, eout] then the scratch.
  const size_t sizes[] = {N * h, N * E, N * E, N * k, R * h, R * f, R * f, R * f, R * h,
                          R * h, R * f, R * f, R * f, R * h, N * k, N * E, N * E};
  size_t total = 0;
  for (size_t s : sizes) total += s;
  // NaN-filled: an element a kernel should write but does not shows in the tests.
  t_.assign(total, std::numeric_limits<T>::quiet_NaN());
  T* p = t_.data();
  T** slots[] = {&acts.xin, &acts.logits, &acts.probs, &acts.weights, &acts.xs, &acts.gate, &acts.up,
                 &acts.act, &acts.eout, &scratch.d_eout, &scratch.d_act, &scratch.d_gate, &scratch.d_up,
                 &scratch.d_xs, &scratch.d_weights, &scratch.d_probs, &scratch.d_logits};
  for (size_t i = 0; i < std::size(sizes); ++i) {
    *slots[i] = p;
    p += sizes[i];
  }
  i32_.assign(N * k + 2 * R, -1);
  acts.experts = i32_.data();
  acts.perm = acts.experts + N * k;
  acts.row_of = acts.perm + R;
  i64_.assign(2 * E + 1, -1);
  acts.counts = i64_.data();
  acts.offsets = acts.counts + E;
}

template <typename T>
void moe_route(T* logits, T* probs, int32_t* experts, T* weights, const T* xin, const T* router, const MoeDims& d) {
  moe_check(d);
  const int64_t N = d.N, E = d.E, k = d.k;
  lin_fwd(logits, xin, router, N, d.h, E);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const T* l = logits + n * E;
    T* p = probs + n * E;
    // Softmax in the router's fp32 (HF: F.softmax(..., dtype=torch.float)), the
    // max subtracted and the sum in double.
    double mx = l[0];
    for (int64_t e = 1; e < E; ++e) mx = std::max(mx, static_cast<double>(l[e]));
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<double>(l[e]) - mx);
    for (int64_t e = 0; e < E; ++e) p[e] = static_cast<T>(std::exp(static_cast<double>(l[e]) - mx) / sum);
    // Top-k by k passes of an argmax with a strict '>': among equal
    // probabilities the lower expert index is taken first. torch.topk on the
    // CPU does not promise an order among ties (the goldens record cases where
    // it returns higher indices first), so exact ties are the one place this
    // may pick another of the tied experts than HF; any device can reproduce
    // this rule.
    int32_t* sel = experts + n * k;
    double s = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken = taken || sel[i] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      sel[j] = static_cast<int32_t>(best);
      s += p[best];
    }
    for (int64_t j = 0; j < k; ++j) weights[n * k + j] = static_cast<T>(p[sel[j]] / s);
  }
}

void moe_sort(int64_t* counts, int64_t* offsets, int32_t* perm, int32_t* row_of, const int32_t* experts,
              const MoeDims& d) {
  moe_check(d);
  const int64_t E = d.E, R = d.rows();
  // A counting sort: serial, O(N k + E), and stable by construction (pairs are
  // visited in token-major order), so each expert's rows keep token order.
  std::fill(counts, counts + E, int64_t{0});
  for (int64_t i = 0; i < R; ++i) {
    const int32_t e = experts[i];
    LOOM_CHECK(e >= 0 && e < E, "moe: routed expert ", e, " of pair ", i, " is outside [0, ", E, ")");
    ++counts[e];
  }
  offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + counts[e];
  for (int64_t e = 0; e < E; ++e) counts[e] = 0;  // reused as fill cursors, then restored
  for (int64_t i = 0; i < R; ++i) {
    const int32_t e = experts[i];
    const int64_t row = offsets[e] + counts[e]++;
    perm[row] = static_cast<int32_t>(i);
    row_of[i] = static_cast<int32_t>(row);
  }
}

template <typename T>
void moe_jitter_noise(T* noise, int64_t n, double eps, uint64_t seed) {
  LOOM_CHECK(eps >= 0.0 && eps < 1.0, "moe: router_jitter_noise = ", eps, " must be in [0, 1)");
  const uint64_t base = splitmix64(seed);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    // 53 random bits -> u in [0, 1)
    const double u = static_cast<double>(splitmix64(base + static_cast<uint64_t>(i)) >> 11) * 0x1.0p-53;
    noise[i] = static_cast<T>(1.0 - eps + 2.0 * eps * u);
  }
}

template <typename T>
void moe_jitter_apply(T* xin, const T* x, const T* noise, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) xin[i] = x[i] * noise[i];
}

template <typename T>
void moe_gather(T* xs, const T* xin, const int32_t* perm, const MoeDims& d) {
  const int64_t R = d.rows(), h = d.h, k = d.k;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) std::copy_n(xin + (perm[r] / k) * h, h, xs + r * h);
}

template <typename T>
void moe_combine(T* y, const T* eout, const T* weights, const int32_t* row_of, const MoeDims& d) {
  const int64_t N = d.N, h = d.h, k = d.k;
  // Per token, its slots' rows in ascending row order, which is ascending
  // expert order (the sort is by expert and a token's k experts differ) — the
  // order of HF's index_add_ loop over experts, from zero, in T.
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    int32_t slots[kMaxTopK];
    int64_t order[kMaxTopK];
    const int64_t kk = std::min<int64_t>(k, kMaxTopK);  // == k (moe_check)
    for (int64_t j = 0; j < kk; ++j) {
      slots[j] = row_of[t * k + j];
      order[j] = j;
    }
    std::sort(order, order + kk, [&](int64_t p, int64_t q) { return slots[p] < slots[q]; });
    T* yr = y + t * h;
    std::fill(yr, yr + h, T(0));
    for (int64_t jj = 0; jj < kk; ++jj) {
      const int64_t j = order[jj];
      const T wt = weights[t * k + j];
      const T* o = eout + static_cast<int64_t>(slots[j]) * h;
      for (int64_t c = 0; c < h; ++c) yr[c] += o[c] * wt;
    }
  }
}

template <typename T>
void moe_forward(T* y, const T* x, const T* noise, const MoeWeights<T>& w, const MoeActs<T>& a, const MoeDims& d) {
  moe_check(d);
  const int64_t N = d.N, h = d.h, f = d.f, E = d.E;
  LOOM_CHECK(static_cast<int64_t>(w.w1.size()) == E && static_cast<int64_t>(w.w2.size()) == E &&
                 static_cast<int64_t>(w.w3.size()) == E,
             "moe: ", w.w1.size(), "/", w.w2.size(), "/", w.w3.size(), " w1/w2/w3 pointers for ", E, " experts");
  if (noise) moe_jitter_apply(a.xin, x, noise, N * h);
  const T* xin = expert_input(x, noise, a);
  moe_route(a.logits, a.probs, a.experts, a.weights, xin, w.router, d);
  moe_sort(a.counts, a.offsets, a.perm, a.row_of, a.experts, d);
  moe_gather(a.xs, xin, a.perm, d);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = a.offsets[e], m = a.counts[e];
    if (m == 0) continue;  // an expert no token chose: nothing to compute
    lin_fwd(a.gate + r0 * f, a.xs + r0 * h, w.w1[e], m, h, f);
    lin_fwd(a.up + r0 * f, a.xs + r0 * h, w.w3[e], m, h, f);
    swiglu_forward(a.act + r0 * f, a.gate + r0 * f, a.up + r0 * f, m * f);
    lin_fwd(a.eout + r0 * h, a.act + r0 * f, w.w2[e], m, f, h);
  }
  moe_combine(y, a.eout, a.weights, a.row_of, d);
}

template <typename T>
void moe_combine_backward(T* d_eout, T* d_weights, const T* dy, const T* eout, const T* weights, const int32_t* perm,
                          const MoeDims& d) {
  const int64_t h = d.h, k = d.k, R = d.rows();
  // The combine y[t] = sum_j w[t, j] eout[row(t, j)]:
  //   d_weights[t, j] = <dy[t], eout[row]>, d_eout[row] = w[t, j] dy[t].
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r) {
    const int64_t pair = perm[r], t = pair / k;
    const T* dyr = dy + t * h;
    const T* o = eout + r * h;
    const T wt = weights[pair];
    double acc = 0.0;
    T* de = d_eout + r * h;
    for (int64_t c = 0; c < h; ++c) {
      acc += static_cast<double>(dyr[c]) * o[c];
      de[c] = wt * dyr[c];
    }
    d_weights[pair] = static_cast<T>(acc);
  }
}

template <typename T>
void moe_route_backward(T* dxin, T* d_router, T* d_probs, T* d_logits, const T* d_weights, const T* xin,
                        const T* router, const T* probs, const int32_t* experts, const T* weights,
                        const T* aux_dprobs, const MoeDims& d) {
  const int64_t N = d.N, h = d.h, E = d.E, k = d.k;
  // Renormalisation w_j = p_j / S and softmax, per token.
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    const T* p = probs + t * E;
    const int32_t* sel = experts + t * k;
    const T* wt = weights + t * k;
    const T* dw = d_weights + t * k;
    T* dp = d_probs + t * E;
    for (int64_t e = 0; e < E; ++e) dp[e] = aux_dprobs ? aux_dprobs[e] : T(0);
    double S = 0.0, dot = 0.0;
    for (int64_t j = 0; j < k; ++j) {
      S += p[sel[j]];
      dot += static_cast<double>(dw[j]) * wt[j];
    }
    for (int64_t j = 0; j < k; ++j) dp[sel[j]] += static_cast<T>((dw[j] - dot) / S);
    double pd = 0.0;
    for (int64_t e = 0; e < E; ++e) pd += static_cast<double>(p[e]) * dp[e];
    T* dl = d_logits + t * E;
    for (int64_t e = 0; e < E; ++e) dl[e] = static_cast<T>(p[e] * (dp[e] - pd));
  }
  // Router: dWr += d_logits^T xin; dxin = d_logits Wr.
  lin_dw(d_router, d_logits, xin, N, h, E);
  lin_dx(dxin, d_logits, router, N, h, E, false);
}

template <typename T>
void moe_scatter_add(T* dx, const T* d_xs, const int32_t* row_of, const T* noise, const MoeDims& d) {
  const int64_t N = d.N, h = d.h, k = d.k;
  // The expert rows' gradients, added per token in ascending row (= expert) order.
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    int32_t rows[kMaxTopK];
    const int64_t kk = std::min<int64_t>(k, kMaxTopK);  // == k (moe_check)
    for (int64_t j = 0; j < kk; ++j) rows[j] = row_of[t * k + j];
    std::sort(rows, rows + kk);
    T* dr = dx + t * h;
    for (int64_t j = 0; j < kk; ++j) {
      const T* src = d_xs + static_cast<int64_t>(rows[j]) * h;
      for (int64_t c = 0; c < h; ++c) dr[c] += src[c];
    }
    // Jitter: xin = x * noise, so dx = dxin * noise.
    if (noise)
      for (int64_t c = 0; c < h; ++c) dr[c] *= noise[t * h + c];
  }
}

template <typename T>
void moe_backward(T* dx, MoeGrads<T>& g, const T* dy, const T* x, const T* noise, const MoeWeights<T>& w,
                  const MoeActs<T>& a, const MoeScratch<T>& s, const T* aux_dprobs, const MoeDims& d) {
  moe_check(d);
  const int64_t h = d.h, f = d.f, E = d.E;
  moe_combine_backward(s.d_eout, s.d_weights, dy, a.eout, a.weights, a.perm, d);
  // Each expert's SwiGLU over its rows.
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = a.offsets[e], m = a.counts[e];
    if (m == 0) continue;  // no rows: its weight gradients stay as they are
    lin_dx(s.d_act + r0 * f, s.d_eout + r0 * h, w.w2[e], m, f, h, false);
    lin_dw(g.w2[e], s.d_eout + r0 * h, a.act + r0 * f, m, f, h);
    swiglu_backward(s.d_gate + r0 * f, s.d_up + r0 * f, s.d_act + r0 * f, a.gate + r0 * f, a.up + r0 * f, m * f);
    lin_dw(g.w1[e], s.d_gate + r0 * f, a.xs + r0 * h, m, h, f);
    lin_dw(g.w3[e], s.d_up + r0 * f, a.xs + r0 * h, m, h, f);
    lin_dx(s.d_xs + r0 * h, s.d_gate + r0 * f, w.w1[e], m, h, f, false);
    lin_dx(s.d_xs + r0 * h, s.d_up + r0 * f, w.w3[e], m, h, f, true);
  }
  moe_route_backward(dx, g.router, s.d_probs, s.d_logits, s.d_weights, expert_input(x, noise, a), w.router, a.probs,
                     a.experts, a.weights, aux_dprobs, d);
  moe_scatter_add(dx, s.d_xs, a.row_of, noise, d);
}

template <typename T>
void moe_aux_accumulate(MoeAuxStats& s, const T* probs, const int32_t* experts, const MoeDims& d) {
  moe_check(d);
  LOOM_CHECK(static_cast<int64_t>(s.counts.size()) == d.E, "moe: aux statistics of ", s.counts.size(),
             " experts fed a layer of ", d.E);
  for (int64_t i = 0; i < d.rows(); ++i) ++s.counts[experts[i]];
  // Serial over rows: a fixed order.
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t e = 0; e < d.E; ++e) s.prob_sum[e] += probs[n * d.E + e];
  s.rows += d.N;
}

double moe_aux_loss(const MoeAuxStats& s) {
  if (s.rows == 0) return 0.0;
  const double R = static_cast<double>(s.rows);
  double acc = 0.0;
  for (size_t e = 0; e < s.counts.size(); ++e) acc += (s.counts[e] / R) * (s.prob_sum[e] / R);
  return static_cast<double>(s.counts.size()) * acc;
}

template <typename T>
void moe_aux_grad(T* g, const MoeAuxStats& s, double coef) {
  const int64_t E = static_cast<int64_t>(s.counts.size());
  const double R = static_cast<double>(s.rows);
  for (int64_t e = 0; e < E; ++e) g[e] = s.rows ? static_cast<T>(coef * E * (s.counts[e] / R) / R) : T(0);
}

template <typename T>
void moe_aux_accumulate_flat(double* stats, const T* probs, const int32_t* experts, const MoeDims& d) {
  moe_check(d);
  const int64_t E = d.E;
  for (int64_t i = 0; i < d.rows(); ++i) {
    const int32_t e = experts[i];
    LOOM_CHECK(e >= 0 && e < E, "moe: routed expert ", e, " of pair ", i, " is outside [0, ", E, ")");
    stats[e] += 1.0;
  }
  for (int64_t n = 0; n < d.N; ++n)
    for (int64_t e = 0; e < E; ++e) stats[E + e] += probs[n * E + e];
  stats[2 * E] += static_cast<double>(d.N);
}

double moe_aux_loss_flat(const double* stats, int64_t E) {
  const double R = stats[2 * E];
  if (R == 0.0) return 0.0;
  double acc = 0.0;
  for (int64_t e = 0; e < E; ++e) acc += (stats[e] / R) * (stats[E + e] / R);
  return static_cast<double>(E) * acc;
}

template <typename T>
void moe_aux_grad_flat(T* g, const double* stats, int64_t E, double coef) {
  const double R = stats[2 * E];
  for (int64_t e = 0; e < E; ++e) g[e] = R != 0.0 ? static_cast<T>(coef * E * (stats[e] / R) / R) : T(0);
}

#define LOOM_MOE_INSTANTIATE(T)                                                                                  \
  template class MoeBuffers<T>;                                                                                  \
  template void moe_route<T>(T*, T*, int32_t*, T*, const T*, const T*, const MoeDims&);                         \
  template void moe_jitter_noise<T>(T*, int64_t, double, uint64_t);                                             \
  template void moe_jitter_apply<T>(T*, const T*, const T*, int64_t);                                           \
  template void moe_gather<T>(T*, const T*, const int32_t*, const MoeDims&);                                    \
  template void moe_combine<T>(T*, const T*, const T*, const int32_t*, const MoeDims&);                         \
  template void moe_combine_backward<T>(T*, T*, const T*, const T*, const T*, const int32_t*, const MoeDims&);  \
  template void moe_route_backward<T>(T*, T*, T*, T*, const T*, const T*, const T*, const T*, const int32_t*,   \
                                      const T*, const T*, const MoeDims&);                                      \
  template void moe_scatter_add<T>(T*, const T*, const int32_t*, const T*, const MoeDims&);                     \
  template void moe_forward<T>(T*, const T*, const T*, const MoeWeights<T>&, const MoeActs<T>&, const MoeDims&); \
  template void moe_backward<T>(T*, MoeGrads<T>&, const T*, const T*, const T*, const MoeWeights<T>&,           \
                                const MoeActs<T>&, const MoeScratch<T>&, const T*, const MoeDims&);             \
  template void moe_aux_accumulate<T>(MoeAuxStats&, const T*, const int32_t*, const MoeDims&);                  \
  template void moe_aux_grad<T>(T*, const MoeAuxStats&, double);                                               \
  template void moe_aux_accumulate_flat<T>(double*, const T*, const int32_t*, const MoeDims&);                  \
  template void moe_aux_grad_flat<T>(T*, const double*, int64_t, double);
LOOM_MOE_INSTANTIATE(float)
LOOM_MOE_INSTANTIATE(double)
#undef LOOM_MOE_INSTANTIATE

}  // namespace loom::cpu
